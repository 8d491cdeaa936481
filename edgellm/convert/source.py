"""What every source reader (GGUF, Hugging Face folder) hands to the converter."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from edgellm.artifact.config import ModelConfig, SamplingDefaults, SourceInfo, TokenizerConfig
from edgellm.artifact.manifest import Tuning
from edgellm.errors import UnsupportedModelError
from edgellm.families.family import SourceTensor


@dataclass(frozen=True)
class SourceModel:
    """A source model, read lazily: tensors are produced one by one in Hugging Face naming, float32."""

    info: SourceInfo
    config: ModelConfig
    tokenizer_json: str
    tokenizer: TokenizerConfig
    chat_template: str | None
    sampling: SamplingDefaults
    tensor_names: tuple[str, ...]
    load_tensor: Callable[[str], torch.Tensor]
    # Weight formats ("q4", "q8") a tensor is stored in *exactly* by the source (a GGUF Q4_1 tensor is
    # q4 block for block), and the block rows of it in such a format (None if it turns out not exact).
    exact_formats: Callable[[str], tuple[str, ...]] = lambda name: ()
    load_blocks: Callable[[str, str], torch.Tensor | None] = lambda name, fmt: None
    tuning: Tuning = Tuning()  # instruction-tuned or base, as the source's metadata says (convert/tuning.py)

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.tensor_names:
            yield name, self.load_tensor(name)


def tensor_loader(what: str, sources: dict[str, SourceTensor], available: set[str],
                  read: Callable[[str], torch.Tensor]) -> Callable[[str], torch.Tensor]:
    """load(name) for every artifact tensor in `sources`, read from the source tensors named there.

    Checks first that every source tensor exists (UnsupportedModelError naming `what` otherwise). A fused
    source tensor is read once for all its row ranges (they are asked for one after the other)."""
    missing = sorted({s.name for s in sources.values()} - available)
    if missing:
        raise UnsupportedModelError(f"{what} lacks {len(missing)} expected tensors, e.g. {missing[0]}")
    last: dict[str, torch.Tensor] = {}

    def load(name: str) -> torch.Tensor:
        src = sources[name]
        if src.rows is None:
            return read(src.name)
        if src.name not in last:
            last.clear()
            last[src.name] = read(src.name)
        fused = last[src.name]
        start, stop = src.rows
        if fused.shape[0] < stop:
            raise UnsupportedModelError(f"{what}: {src.name} has {fused.shape[0]} rows, the config needs {stop}")
        return fused[start:stop].clone()

    return load
