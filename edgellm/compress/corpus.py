"""Token windows from local text files: what importance is measured on, and what distillation trains on."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from edgellm.compress.source import CompressError


def read_texts(paths: list[Path]) -> list[str]:
    """The files' text (UTF-8), each one a document; a missing or empty file is a one-line error."""
    texts = []
    for p in paths:
        if not Path(p).is_file():
            raise CompressError(f"no such text file: {p}")
        text = Path(p).read_text(encoding="utf-8")
        if not text.strip():
            raise CompressError(f"{p} is empty")
        texts.append(text)
    return texts


def token_windows(tokenizer: PreTrainedTokenizerBase, texts: list[str], length: int) -> torch.Tensor:
    """Non-overlapping windows [N, length] of each document's tokens (a document's tail shorter than one is left)."""
    if length < 2:
        raise CompressError(f"windows need at least 2 tokens, got {length}")
    rows = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        rows += [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
    if not rows:
        raise CompressError(f"the text holds no window of {length} tokens; give more text or a shorter --seq-len")
    return torch.tensor(rows, dtype=torch.long)


def sample_windows(windows: torch.Tensor, n: int | None, seed: int) -> torch.Tensor:
    """A seeded sample of ``n`` windows spread over the whole corpus, kept in corpus order (all when n is None).

    A large corpus is then read once, and the teacher's pass (the cache) covers only the windows trained on."""
    if n is None or n >= len(windows):
        return windows
    if n < 1:
        raise CompressError(f"--max-windows must be at least 1, got {n}")
    chosen = torch.randperm(len(windows), generator=torch.Generator().manual_seed(seed))[:n]
    return windows[chosen.sort().values]
