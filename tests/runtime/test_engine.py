"""The generation stream: sampling controls, stops, limits, cache reuse, streaming text integrity."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pytest
import torch

from edgellm.errors import ContextOverflowError, EdgeLLMError
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from tests.support.tiny import VOCAB, tiny_engine

PROMPT = "t1 t2 t3 t4 t5"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return tiny_engine(tmp_path_factory.mktemp("engine"), "qwen2", tied=False)


def forcing(ids: Sequence[int]):
    """A logits processor that makes the model emit exactly `ids`."""

    def process(generated: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        forced = torch.full_like(logits, float("-inf"))
        forced[ids[min(len(generated), len(ids) - 1)]] = 0.0
        return forced

    return process


def test_seed_reproduces_and_differs(engine: Engine) -> None:
    p = GenerationParams(max_tokens=12, temperature=1.0, top_p=1.0, seed=7, ignore_eos=True)
    a, b = engine.generate(PROMPT, p).token_ids, engine.generate(PROMPT, p).token_ids
    c = engine.generate(PROMPT, GenerationParams(max_tokens=12, temperature=1.0, top_p=1.0, seed=8,
                                                 ignore_eos=True)).token_ids
    assert a == b and a != c


def test_max_tokens_gives_length(engine: Engine) -> None:
    r = engine.generate(PROMPT, GenerationParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.token_ids) == 5 and r.stats.completion_tokens == 5


def test_stop_token_and_stop_string(engine: Engine) -> None:
    r = engine.generate(PROMPT, GenerationParams(max_tokens=10, logits_processors=(forcing([7, 8, VOCAB - 1]),)))
    assert r.finish_reason == "stop" and r.token_ids == [7, 8]  # </s> is a stop token, not emitted
    r = engine.generate(PROMPT, GenerationParams(max_tokens=10, stop=("t8",), ignore_eos=True,
                                                 logits_processors=(forcing([7, 7, 8, 9]),)))
    assert r.finish_reason == "stop" and "t8" not in r.text and r.text.strip() == "t7 t7"


def test_context_full_gives_length(engine: Engine) -> None:
    small = Engine(engine.artifact, context_window=12, threads=1)
    r = small.generate(PROMPT, GenerationParams(max_tokens=100, temperature=0.0, ignore_eos=True))
    assert r.finish_reason == "length" and r.stats.prompt_tokens + r.stats.completion_tokens == 12
    with pytest.raises(ContextOverflowError, match="prompt is 13 tokens but the context window is 12"):
        small.generate(" ".join(["t3"] * 13))


def test_prefix_cache_reuse_changes_nothing(engine: Engine) -> None:
    engine = Engine(engine.artifact, threads=1)
    engine.prefill_chunk = 2  # so that whole chunks fit in the 5-token prompt
    p = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    cold = engine.generate(PROMPT, p)
    warm = engine.generate(PROMPT + " t6", p)
    assert warm.stats.cached_tokens == 4  # whole chunks only: the 5th token's chunk had another shape
    engine.reset()
    fresh = engine.generate(PROMPT + " t6", p)
    assert fresh.stats.cached_tokens == 0 and fresh.token_ids == warm.token_ids
    again = engine.generate(PROMPT, p)
    assert again.stats.cached_tokens == 4 and cold.token_ids == again.token_ids
    # the reply's tokens were written by decode steps: a continuation never reuses them
    follow = engine.generate(PROMPT + again.text + " t9", p)
    assert follow.stats.cached_tokens == 4


def test_stream_equals_generate_and_reports_stats(engine: Engine) -> None:
    p = GenerationParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True, top_logprobs=2)
    chunks = list(engine.stream(PROMPT, p))
    assert chunks[-1].finish_reason == "length" and all(c.finish_reason is None for c in chunks[:-1])
    whole = engine.generate(PROMPT, p)
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.token_ids
    lp = whole.logprobs[0]
    assert len(whole.logprobs) == 10 and lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1]
    s = whole.stats
    assert s.prompt_tokens == 5 and s.ttft_s > 0 and s.decode_tokens_per_s > 0 and s.total_s >= s.ttft_s


def test_one_stream_at_a_time(engine: Engine) -> None:
    first = engine.stream(PROMPT, GenerationParams(max_tokens=3, ignore_eos=True))
    next(first)
    with pytest.raises(EdgeLLMError, match="already generating"):
        next(engine.stream(PROMPT))
    first.close()
    assert engine.generate(PROMPT, GenerationParams(max_tokens=2)).stats.completion_tokens >= 1


def test_bad_requests(engine: Engine) -> None:
    with pytest.raises(EdgeLLMError, match="empty"):
        engine.generate("")
    with pytest.raises(EdgeLLMError, match="max_tokens"):
        engine.generate(PROMPT, GenerationParams(max_tokens=0))


def test_streamed_chinese_never_splits_a_character(smollm2_gguf: Path) -> None:
    engine = Engine.load("smollm2-135m:q4f16_1", progress=False)
    text = "边缘设备上的大语言模型：离线、私密、快速。温度 25℃，耗时 3.5 秒 🚀"
    ids = engine.tokenizer.encode(text)
    assert any("\ufffd" in engine.tokenizer.decode([i]) for i in ids)  # the tokenizer really splits characters
    chunks = list(engine.stream("Say something.", GenerationParams(
        max_tokens=len(ids), ignore_eos=True, logits_processors=(forcing(ids),))))
    assert all("\ufffd" not in c.text for c in chunks)
    assert "".join(c.text for c in chunks) == text
