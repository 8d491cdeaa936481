"""The prompt cache across requests (session/prompt_cache.py) and on disk (session/prompt_store.py): several prefixes
by recency within a budget, only the true common prefix reused, the same tokens as a cold engine, files that are
checked before their bytes are trusted."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError, MemoryBudgetError
from edgellm.generation import GenerationParams
from edgellm.kernels import native
from edgellm.models.kv_arrays import ArrayKVCache
from edgellm.runtime.engine import Engine
from edgellm.session.prompt_cache import PromptCache, usable_prefix
from edgellm.session.prompt_store import SUFFIX, PromptStore
from tests.kernels.test_native_decode import _make_model

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.prefill_matmul() is None, reason="no native prefill in this kernel library")

CHUNK = 8
rng = np.random.default_rng(7)
SYSTEM = rng.integers(0, 250, 40).tolist()  # a shared "system prompt": five whole chunks
GREEDY = GenerationParams(temperature=0.0, max_tokens=12, ignore_eos=True, top_logprobs=0)
ANY = GenerationParams(temperature=0.0, max_tokens=12, ignore_eos=True, top_logprobs=0, prefix_reuse="any")


def tail(seed: int, n: int = 13) -> list[int]:
    return np.random.default_rng(seed).integers(0, 250, n).tolist()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prompt-cache")
    _make_model(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "art", quantization="q4f16_1", progress=False, prefill_chunk_size=CHUNK)


def engine(folder: Path, **kwargs) -> Engine:
    eng = Engine(open_artifact(folder), threads=1, **kwargs)
    if eng.session.prompt_cache is not None:
        eng.session.prompt_cache.min_tokens = CHUNK  # tiny prompts: keep them all
    return eng


@pytest.fixture(scope="module")
def cold(folder: Path) -> Engine:
    """No prompt cache, reset before each request: the reference tokens."""
    return engine(folder)


def cold_tokens(cold: Engine, ids: list[int], params: GenerationParams = GREEDY) -> list[tuple[int, float]]:
    """Each token with its log-probability (compared exactly: the same bits, not only the same argmax)."""
    cold.reset()
    return tokens_of(cold.generate(ids, params))


def tokens_of(result) -> list[tuple[int, float]]:
    return [(lp.token_id, lp.logprob) for lp in result.logprobs]


def test_usable_prefix_stops_at_the_first_difference() -> None:
    assert usable_prefix([1, 2, 3, 4, 5], 5, [1, 2, 9, 4, 5, 6], exact=False, chunk=2) == 2
    assert usable_prefix([1, 2, 3, 4, 5], 5, [1, 2, 3, 4, 5, 6], exact=True, chunk=2) == 4  # whole chunks
    assert usable_prefix([1, 2, 3, 4, 5], 2, [1, 2, 3, 4, 5, 6], exact=True, chunk=2) == 2  # fresh-prefill part
    assert usable_prefix([1, 2, 3], 3, [1, 2, 3], exact=False, chunk=1) == 2  # the last prompt token always runs
    ten = list(range(10))
    # a chunk-invariant model: any prefilled prefix but the last prefilled token ...
    assert usable_prefix(ten, 10, ten + [10], exact=True, chunk=4, invariant=True) == 9
    assert usable_prefix(ten, 10, ten + [10], exact=True, chunk=4) == 8
    # ... that leaves the prompt's last token alone in its chunk exactly when a fresh prefill does (9 = 2*4 + 1)
    assert usable_prefix(ten, 10, ten[:8] + [99], exact=True, chunk=4, invariant=True) == 8
    assert usable_prefix(ten, 10, ten[:7] + [99, 98], exact=True, chunk=4, invariant=True) == 4


def test_an_older_entry_gives_its_shared_prefix_and_the_same_tokens(folder: Path, cold: Engine) -> None:
    eng = engine(folder, prompt_cache=64 * 2**20)
    first, other, second = SYSTEM + tail(1), tail(2, 50), SYSTEM + tail(3)
    eng.generate(first, GREEDY)
    eng.generate(other, GREEDY)  # the live cache now holds another prompt: `first` went to the prompt cache
    result = eng.generate(second, GREEDY)
    assert result.stats.cached_tokens == len(SYSTEM)
    assert tokens_of(result) == cold_tokens(cold, second)
    assert eng.session.prompt_cache.hits == 1
    # without the prompt cache only the previous request is remembered: nothing shared with `other`
    plain = engine(folder)
    for ids in (first, other):
        plain.generate(ids, GREEDY)
    assert plain.generate(second, GREEDY).stats.cached_tokens == 0


def test_a_prompt_differing_in_its_middle_reuses_only_the_common_prefix(folder: Path, cold: Engine) -> None:
    eng = engine(folder, prompt_cache=64 * 2**20)
    # same length, same end, the middle differs; exact reuse on the native model (the same bits however a prompt
    # is chunked) takes any prefilled prefix, but a 49-token prompt's last token is a one-token chunk of a fresh
    # prefill (a decode step): reusing 21 would put it in a chunk of 4; 16 leaves it alone again (49 - 16 = 4 * 8 + 1)
    for end_len, exact_shared in ((20, 21), (22, 16)):
        end = tail(4, end_len)
        a, b = SYSTEM[:21] + tail(5, 6) + end, SYSTEM[:21] + tail(6, 6) + end
        assert a[:21] == b[:21] and a[21] != b[21]
        for params, shared in ((ANY, 21), (GREEDY, exact_shared)):
            eng.reset()
            eng.session.prompt_cache.entries.clear()
            eng.generate(a, params)
            eng.generate(tail(7, 30), params)  # `a` leaves the live cache
            result = eng.generate(b, params)
            assert result.stats.cached_tokens == shared
            cold_run = cold_tokens(cold, b, params)
            if params is GREEDY:  # the same bits as a cold prefill
                assert tokens_of(result) == cold_run
            else:  # any reuse promises the tokens' keys/values, not the last prompt token's path
                assert result.token_ids == [t for t, _ in cold_run]


def cache_with(values: float, length: int = 16) -> ArrayKVCache:
    cache = ArrayKVCache(2, 1, 4, 64, kind="q8")
    cache.reserve(length)
    for a in (cache.keys, cache.values, cache.key_scales, cache.value_scales):
        a[...] = values
    return cache


def test_entries_are_kept_by_recency_within_the_budget() -> None:
    one = cache_with(1.0)
    entry_bytes = 2 * 2 * 16 * 4 * 1 + 2 * 2 * 16 * 4  # int8 keys and values, float32 scales, 16 positions
    prompts = [list(range(i * 100, i * 100 + 16)) for i in range(3)]
    pc = PromptCache(2 * entry_bytes, min_tokens=4)
    for ids in prompts:
        pc.add(ids, 16, one)
    assert [list(k) for k in pc.entries] == prompts[1:] and pc.nbytes == 2 * entry_bytes  # the oldest went
    pc.best(prompts[1] + [5], exact=False, chunk=1)
    pc.restore(pc.entries[tuple(prompts[1])], 8, cache_with(0.0))  # used: now the most recent
    pc.add(list(range(900, 916)), 16, one)
    assert [list(k) for k in pc.entries] == [prompts[1], list(range(900, 916))]
    assert pc.best(prompts[0] + [1], exact=False, chunk=1) == (None, 0)
    # a prefix of a newer entry is covered by it; too short or too big an entry is not kept
    pc.add(prompts[1] + [7, 8, 9], 19, cache_with(2.0, 19))
    assert list(pc.entries) == [tuple(prompts[1] + [7, 8, 9])]  # covers prompts[1]; 19 positions: the other went
    pc.add(prompts[1][:10], 10, one)  # covered by the newer entry: nothing new kept
    pc.add([1, 2], 2, one)  # too short
    assert list(pc.entries) == [tuple(prompts[1] + [7, 8, 9])]
    PromptCache(10, min_tokens=4).add(prompts[0], 16, one)
    with pytest.raises(EdgeLLMError, match="negative"):
        PromptCache(-1)


def test_restore_copies_exactly_the_entry_positions() -> None:
    source = cache_with(0.0, 16)
    source.keys[..., :16, :] = np.arange(16, dtype=np.int8)[:, None]
    pc = PromptCache(2**20, min_tokens=4)
    pc.add(list(range(16)), 16, source)
    target = cache_with(-1.0, 16)
    entry, n = pc.best(list(range(12)) + [99], exact=False, chunk=1)
    assert n == 12
    pc.restore(entry, n, target)
    np.testing.assert_array_equal(target.keys[..., :12, :], source.keys[..., :12, :])
    assert (target.keys[..., 12:16, :] == -1).all()  # beyond the common prefix: untouched


def test_the_memory_estimate_and_the_budget_count_the_prompt_cache(folder: Path) -> None:
    eng = engine(folder, prompt_cache=5 * 2**20)
    assert eng.memory.prompt_cache_bytes == 5 * 2**20 and "prompt cache 5" in eng.memory.describe()
    assert eng.memory.total_bytes == engine(folder).memory.total_bytes + 5 * 2**20
    with pytest.raises(MemoryBudgetError):
        engine(folder, prompt_cache=2**30, memory_budget=engine(folder).memory.total_bytes + 2**20)


# ---- on disk ---------------------------------------------------------------------------------------------------
def test_a_persisted_prefix_survives_a_restart(folder: Path, cold: Engine, tmp_path: Path) -> None:
    first = engine(folder, prompt_cache_dir=tmp_path)
    first.generate(SYSTEM + tail(1), GREEDY)
    first.close()  # the live prefix is written on close
    files = list(tmp_path.glob(f"*{SUFFIX}"))
    assert len(files) == 1 and not list(tmp_path.glob(".*"))  # no temporary file left behind
    again = engine(folder, prompt_cache_dir=tmp_path)
    ids = SYSTEM + tail(3)
    result = again.generate(ids, GREEDY)
    assert result.stats.cached_tokens == len(SYSTEM)
    assert tokens_of(result) == cold_tokens(cold, ids)


def corrupt(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "foreign", "renamed"])
def test_a_damaged_or_foreign_file_is_refused_with_a_warning(folder: Path, tmp_path: Path, damage: str,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    eng = engine(folder, prompt_cache_dir=tmp_path)
    eng.generate(SYSTEM + tail(1), GREEDY)
    eng.close()
    (path,) = tmp_path.glob(f"*{SUFFIX}")
    if damage == "payload":
        corrupt(path, path.stat().st_size - 5)
    elif damage == "header":
        corrupt(path, 20)
    elif damage == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    else:
        store = eng.session.prompt_cache.store
        entry = store.read(path)
        if damage == "foreign":  # another artifact's file under this artifact's name
            PromptStore(tmp_path, "f" * 64, store.layout).save(entry)
            (other,) = tmp_path.glob("ffff*")
            other.replace(path)
        else:  # another prefix's file name
            path.replace(store.path((1, 2, 3)))
    caplog.set_level(logging.WARNING, "edgellm.prompt_cache")
    again = engine(folder, prompt_cache_dir=tmp_path)
    assert not again.session.prompt_cache.entries
    assert "ignoring" in caplog.text
    assert again.generate(SYSTEM + tail(3), GREEDY).stats.cached_tokens == 0


def test_another_artifacts_files_are_left_alone(folder: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / f"0123456789abcdef-{'0' * 32}{SUFFIX}").write_bytes(b"another model's file")
    caplog.set_level(logging.WARNING, "edgellm.prompt_cache")
    eng = engine(folder, prompt_cache_dir=tmp_path)
    assert not eng.session.prompt_cache.entries and not caplog.text
    with pytest.raises(EdgeLLMError, match="not a folder"):
        engine(folder, prompt_cache_dir=tmp_path / f"0123456789abcdef-{'0' * 32}{SUFFIX}")


def test_exact_reuse_skips_a_prompt_end_the_decode_step_wrote(folder: Path, cold: Engine) -> None:
    """A 41-token prompt's last token is a one-token chunk (8 * 5 + 1): its keys/values come from the decode step,
    not the prefill, so a longer prompt reuses 40 tokens of it, and gets the bits of a cold prefill."""
    eng = engine(folder)
    first = SYSTEM + [5]
    eng.generate(first, GREEDY)
    longer = first + tail(9, 15)
    result = eng.generate(longer, GREEDY)
    assert result.stats.cached_tokens == 40
    assert tokens_of(result) == cold_tokens(cold, longer)


def test_smollm2_a_shared_system_prompt_from_the_prompt_cache_changes_nothing(cold: Engine) -> None:
    """The real model: a request sharing a system prompt with an older entry (another request in between) reuses
    the prefix and gives the cold engine's tokens and log-probabilities, bit for bit."""
    from edgellm.eval.tasks import load_dataset, messages

    warm = Engine.load("smollm2-135m", progress=False, prompt_cache=64 * 2**20)
    reference = Engine.load("smollm2-135m", progress=False)
    items = load_dataset()
    system = messages(items[0])[0]["content"]
    ask = lambda text: warm.render([{"role": "system", "content": system}, {"role": "user", "content": text}])  # noqa: E731
    params = GenerationParams(temperature=0.0, max_tokens=24, top_logprobs=0)
    warm.generate(ask(items[0]["input"]), params)
    warm.generate(warm.render([{"role": "user", "content": "Say hello in French."}]), params)
    prompt = ask(items[3]["input"])
    result = warm.generate(prompt, params)
    system_tokens = len(warm.encode(warm.render([{"role": "system", "content": system}],
                                                add_generation_prompt=False)))
    assert result.stats.cached_tokens >= system_tokens - 1
    assert tokens_of(result) == tokens_of(reference.generate(prompt, params))
