"""Decoding under a real grammar without a model: scripted or random logits, the SmolLM2 tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from numpy.typing import ArrayLike
from pathlib import Path

import pytest
import numpy as np

from edgellm.tokenizer import Tokenizer
from edgellm.structured.budget_finish import BudgetFinish
from edgellm.structured.grammar import GrammarCache, compile_format, tokenizer_info
from edgellm.loop_guard_config import DEFAULT_LOOP_GUARD, LoopGuardConfig
from edgellm.structured.loop_guard import LoopGuard, token_texts
from edgellm.structured.processor import GrammarConstraint
from edgellm.response_format import ResponseFormat

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def smol_tokenizer(smollm2_gguf: Path) -> Tokenizer:
    """SmolLM2's tokenizer (the artifact is compiled on first use)."""
    from edgellm.resolve import resolve_model

    return Tokenizer.from_file(resolve_model("smollm2-135m", quantization="q4f16_1", progress=False)
                               / "tokenizer.json", eos_token_id=EOS)


@pytest.fixture(scope="module")
def cache(smol_tokenizer: Tokenizer) -> GrammarCache:
    """A grammar cache for SmolLM2's 49152 logits."""
    return GrammarCache(tokenizer_info(smol_tokenizer, VOCAB, [EOS]), threads=1)


def drive(cache: GrammarCache, tokenizer: Tokenizer, rf: ResponseFormat, logits_of: Callable[[str], ArrayLike],
          *, guard: bool | LoopGuardConfig = False, budget: bool = False,
          max_tokens: int = 120) -> tuple[str, GrammarConstraint]:
    """Greedy decoding of `logits_of(text so far)` under the format's grammar (and the guard, with its default
    thresholds or those given / the budget finish)."""
    compiled = compile_format(cache, rf)
    table = token_texts(tokenizer, VOCAB)
    cfg = guard if isinstance(guard, LoopGuardConfig) else DEFAULT_LOOP_GUARD
    constraint = GrammarConstraint(compiled, VOCAB, {EOS}, guard=LoopGuard(table, cfg) if guard else None,
                                   budget=BudgetFinish(table, max_tokens) if budget else None)
    generated: list[int] = []
    while len(generated) < max_tokens:
        raw = np.asarray(logits_of(tokenizer.decode(generated)), dtype=np.float32)  # the engine's logits are numpy
        logits = constraint.process(generated, raw)
        token = int(np.argmax(logits))
        if not constraint.accept(token) or token == EOS:
            break
        generated.append(token)
        if constraint.finished:
            break
    return tokenizer.decode(generated), constraint


__all__ = ["EOS", "VOCAB", "cache", "drive", "smol_tokenizer"]
