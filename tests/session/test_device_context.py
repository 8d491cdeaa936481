"""Context shift and chat sessions: generation past the window, a chat 3x past it, and the rebuild."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.models.rope_shift import rotate_keys
from edgellm.session.context import shifted_ids
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from edgellm.runtime.chat_session import ChatSession
from tests.support.tiny import make_tiny

TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"  # word-level tokens: one per word
WINDOW = 48


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("context")
    make_tiny(root / "hf", "qwen2", tied=False)
    return convert(root / "hf", root / "art", quantization="q0f32", progress=False)


def small_engine(artifact: Path, **kwargs) -> Engine:
    engine = Engine(open_artifact(artifact), context_window=WINDOW, threads=1, **kwargs)
    engine.chat_template = TEMPLATE
    return engine


class Recorder:
    """A logits processor that records the logits of every step (and changes nothing)."""

    def __init__(self) -> None:
        self.steps: list[torch.Tensor] = []

    def __call__(self, generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        self.steps.append(logits.clone())
        return logits


def test_rope_rotation_composes() -> None:
    from edgellm.models.blocks import Rope

    rope = Rope(16, 10000.0, None, 64, 64)
    cos, sin = rope.short_cos, rope.short_sin
    x = torch.randn(3, 16, dtype=torch.float64)
    at_40 = rotate_keys(x, cos[40].double(), sin[40].double())
    back_15 = rotate_keys(at_40, cos[15].double(), -sin[15].double())
    torch.testing.assert_close(back_15, rotate_keys(x, cos[25].double(), sin[25].double()), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("method,kv", [("reencode", "f32"), ("rope", "f32"), ("rope", "q8")])
def test_generation_shifts_instead_of_stopping(artifact: Path, method: str, kv: str) -> None:
    engine = small_engine(artifact, kv_cache=kv)
    engine.cache = engine.model.new_cache(WINDOW, kind=kv, block=8)  # it grows inside the model's forward
    prompt = [int(t) for t in torch.arange(1, 11)]
    plain = engine.generate(prompt, GenerationParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert plain.finish_reason == "length" and len(plain.token_ids) == WINDOW - len(prompt)
    rec = Recorder()
    p = GenerationParams(max_tokens=100, temperature=0.0, ignore_eos=True, context_shift=method, context_keep=3,
                         logits_processors=(rec,))
    r = engine.generate(prompt, p)
    assert len(r.token_ids) == 100 and r.stats.context_shifts >= 2 and r.stats.shift_s > 0
    assert r.token_ids[: len(plain.token_ids)] == plain.token_ids  # identical until the first shift
    first = WINDOW - 1 - len(prompt)  # the token sampled when the window filled
    kept, keep, drop = shifted_ids(prompt + r.token_ids[:first], WINDOW, 3)
    assert keep == 3 and kept[:3] == prompt[:3] and len(kept) == WINDOW - 1 - drop
    fresh = engine.logits(kept + [r.token_ids[first]])[-1]
    after = rec.steps[first + 1]
    if method == "reencode" and kv == "f32":  # exact: the cache is a fresh prefill of the kept tokens
        torch.testing.assert_close(after, fresh, rtol=1e-4, atol=1e-4)
    else:  # approximate: report, do not pin, how close it is
        assert torch.isfinite(after).all()


def test_bad_shift_method_is_refused(artifact: Path) -> None:
    engine = small_engine(artifact)
    with pytest.raises(EdgeLLMError, match="unknown context shift 'slide'; known: reencode, rope"):
        engine.generate([1, 2], GenerationParams(context_shift="slide"))


@pytest.mark.parametrize("shift", ["reencode", "rope"])
def test_chat_runs_three_times_past_its_window(artifact: Path, shift: str) -> None:
    engine = small_engine(artifact)
    session = ChatSession(engine, "t1 t2 t3", rebuild_every=4, reply_reserve=12, shift=shift)
    processed = 0
    p = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for turn in range(14):
        chunks = list(session.stream(" ".join(f"t{5 + (turn + i) % 50}" for i in range(6)), p))
        stats = chunks[-1].stats
        assert stats is not None and stats.completion_tokens == 8
        processed += stats.prompt_tokens - stats.cached_tokens + stats.completion_tokens
    long = list(session.stream("t9 t9", GenerationParams(max_tokens=60, temperature=0.0, ignore_eos=True)))
    assert long[-1].stats is not None and long[-1].stats.completion_tokens == 60
    assert processed > 3 * WINDOW
    assert session.messages[0] == {"role": "system", "content": "t1 t2 t3"}
    assert session.stats.dropped_messages > 0 and session.stats.rebuilds == 3 and session.stats.context_shifts >= 1
    assert session.messages[1]["role"] == "user" and session.stats.turns == 15


def test_rebuild_gives_a_fresh_prefills_next_token(artifact: Path) -> None:
    engine = small_engine(artifact)
    session = ChatSession(engine, "t1 t2 t3", rebuild_every=None, reply_reserve=12, shift="rope")
    p = GenerationParams(max_tokens=45, temperature=0.0, ignore_eos=True)
    for turn in range(4):  # long replies: rope shifts leave the cache unlike a fresh prefill
        list(session.stream(f"t{20 + turn} t{30 + turn}", p))
    assert session.stats.context_shifts >= 1
    session.rebuild()
    assert engine.cache.capacity <= 256
    rec = Recorder()
    list(session.stream("t40 t41", GenerationParams(max_tokens=1, temperature=0.0, logits_processors=(rec,))))
    kept = session.messages[:-1]  # what the turn was prompted with (the reply is the last message)
    fresh = small_engine(artifact)
    expected = fresh.logits(fresh.encode(fresh.render(kept)))[-1]
    torch.testing.assert_close(rec.steps[0], expected, rtol=1e-4, atol=1e-4)
    assert int(rec.steps[0].argmax()) == int(expected.argmax())
