"""The batched native decode step (csrc/decode_batch.c, NativeModel.decode_batch): M rows in one call, each row's
logits those of the single-token step for it alone.

The reference is the native single step itself (tests/test_native_decode.py checks it against float64 transformers):
the batched step must compute the same arithmetic row by row. Tiny random models made by transformers, every family
the native step supports (Llama, Qwen2 with biases, Qwen3's q/k norms, Gemma 2's soft-capping, Gemma 3's sliding
windows and sandwich norms), every KV cache kind, one and two threads; then the real SmolLM2. Several sequences of
different lengths are decoded greedily, interleaved in one batch that they join and leave; rows that share a cache
at consecutive positions (speculative verification); and every input the step refuses, refused before anything is
written, by the Python checks and by C's own."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.kernels import native
from edgellm.kernels import abi
from edgellm.kernels.decoder import NativeDecoder
from edgellm.models.kv_arrays import ArrayKVCache
from edgellm.models.native_model import NativeModel
from tests.kernels import test_native_decode, test_native_gemma
from tests.support.tiny import VOCAB

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")

WINDOW = 64  # the models' context window here
KINDS = ("f32", "f16", "q8")
RTOL = ATOL = 1e-5  # the same arithmetic on the same machine: the rows agree to float32 rounding or better

# (maker, arch, option, quantization): every family the native step supports, both matmul formats
FAMILIES = [(test_native_decode, "llama", True, "q4f16_1"), (test_native_decode, "qwen2", False, "q8f16_1"),
            (test_native_gemma, "qwen3", None, "q4f16_1"), (test_native_gemma, "gemma2", 30.0, "q8f16_1"),
            (test_native_gemma, "gemma3", 30.0, "q4f16_1")]


def _convert(root: Path, maker, arch: str, option, quant: str) -> Path:
    if maker is test_native_decode:
        maker._make_model(root / "hf", arch, tied=option)
    else:
        maker._make_model(root / "hf", arch, softcap=option)
    return convert(root / "hf", root / "art", quantization=quant, progress=False)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda p: f"{p[1]}-{p[3]}")
def artifact(request, tmp_path_factory) -> Path:
    maker, arch, option, quant = request.param
    return _convert(tmp_path_factory.mktemp(f"batch-{arch}"), maker, arch, option, quant)


def native_model(folder: Path, threads: int = 1, **kwargs) -> NativeModel:
    art = open_artifact(folder)
    return NativeModel(art.config, art.weights(arrays=True), threads, WINDOW, **kwargs)


def prompts(lengths: tuple[int, ...], seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, VOCAB - 2, n).tolist() for n in lengths]


def interleaved_greedy(model: NativeModel, kind: str, ids: list[list[int]], new: list[int]) -> None:
    """Decode each prompt greedily for new[i] tokens, alone with the single step and all together in batched steps
    (a sequence leaves the batch when done; the rows' order rotates every step); the logits, tokens and caches of
    both must agree."""
    solo = [model.new_cache(WINDOW, kind=kind) for _ in ids]
    batched = [model.new_cache(WINDOW, kind=kind) for _ in ids]
    last = []
    for prompt, a, b in zip(ids, solo, batched):
        model.run(prompt[:-1], 0, a)
        model.run(prompt[:-1], 0, b)
        last.append(prompt[-1])
    tokens_solo, tokens_batched = [[t] for t in last], [[t] for t in last]
    for step in range(max(new)):
        running = [i for i in range(len(ids)) if step < new[i]]
        running = running[step % len(running):] + running[: step % len(running)]
        pos = [len(ids[i]) - 1 + step for i in running]
        got = model.decode_batch([tokens_batched[i][-1] for i in running], pos, [batched[i] for i in running])
        assert got.shape == (len(running), model.native.vocab) and got.dtype == np.float32
        for row, i in enumerate(running):
            want = model.run([tokens_solo[i][-1]], pos[row], solo[i])
            np.testing.assert_allclose(got[row], want, rtol=RTOL, atol=ATOL)
            tokens_solo[i].append(int(want.argmax()))
            tokens_batched[i].append(int(got[row].argmax()))
    assert tokens_batched == tokens_solo
    for i, (a, b) in enumerate(zip(solo, batched)):
        end = len(ids[i]) - 1 + new[i]
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            np.testing.assert_array_equal(x[..., :end, :], y[..., :end, :])


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_interleaved_sequences_decode_as_each_alone(artifact: Path, kind: str, threads: int) -> None:
    """Prompts of 3, 12 and 21 tokens (the Gemma models' sliding window is 8: crossed), 14, 5 and 9 new tokens."""
    model = native_model(artifact, threads)
    interleaved_greedy(model, kind, prompts((3, 12, 21)), [14, 5, 9])


@pytest.mark.parametrize("kind", KINDS)
def test_rows_sharing_a_cache_see_the_rows_before_them(artifact: Path, kind: str) -> None:
    """Speculative verification: one sequence's token and three drafted tokens at consecutive positions, with
    another sequence's row between them; each row's logits are the single step's after the rows before it."""
    model = native_model(artifact, 2)
    a_ids, b_ids = prompts((10, 5), seed=1)
    draft = [7, 100, 3, 42]
    solo_a, solo_b, bat_a, bat_b = (model.new_cache(WINDOW, kind=kind) for _ in range(4))
    for ids, c in ((a_ids, solo_a), (a_ids, bat_a), (b_ids, solo_b), (b_ids, bat_b)):
        model.run(ids, 0, c)
    want_a = [model.run([t], 10 + i, solo_a) for i, t in enumerate(draft)]
    want_b = model.run([9], 5, solo_b)
    got = model.decode_batch([draft[0], draft[1], 9, draft[2], draft[3]], [10, 11, 5, 12, 13],
                             [bat_a, bat_a, bat_b, bat_a, bat_a])
    np.testing.assert_allclose(got[[0, 1, 3, 4]], np.stack(want_a), rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(got[2], want_b, rtol=RTOL, atol=ATOL)
    np.testing.assert_array_equal(solo_a.keys[..., :14, :], bat_a.keys[..., :14, :])


def test_one_row_is_the_single_step(artifact: Path) -> None:
    model = native_model(artifact)
    a, b = model.new_cache(WINDOW), model.new_cache(WINDOW)
    ids = prompts((6,))[0]
    model.run(ids, 0, a), model.run(ids, 0, b)
    np.testing.assert_allclose(model.decode_batch([5], [6], [b])[0], model.run([5], 6, a), rtol=RTOL, atol=ATOL)


# ---- what the step refuses -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return _convert(tmp_path_factory.mktemp("batch-errors"), test_native_decode, "llama", True, "q4f16_1")


@pytest.fixture(scope="module")
def llama(llama_folder: Path) -> NativeModel:
    return native_model(llama_folder, max_batch=4)


def _filled(model: NativeModel, n: int = 4, kind: str = "f32") -> ArrayKVCache:
    cache = model.new_cache(WINDOW, kind=kind)
    model.run(prompts((n,), seed=5)[0], 0, cache)
    return cache


def _snapshot(*caches: ArrayKVCache) -> list[np.ndarray]:
    return [a.copy() for c in caches for a in (c.keys, c.values)]


@pytest.mark.parametrize("tokens, positions, which, message", [
    ([1, 2], [4], [0, 1], "1 positions and 2 caches for 2 tokens"),
    ([], [], [], "takes 1..4 rows"),
    ([1] * 5, [4, 5, 6, 7, 8], [0] * 5, "takes 1..4 rows"),
    ([VOCAB], [4], [0], f"row 0's token id {VOCAB} outside the vocabulary"),
    ([1, -1], [4, 4], [0, 1], "row 1's token id -1 outside the vocabulary"),
    ([2**32 + 1], [4], [0], "outside the vocabulary"),  # would wrap to 1 in int32
    ([1], [-1], [0], "row 0's position -1 outside its KV cache"),
    ([1, 2], [4, 4], [0, 0], "row 1 at position 4 follows position 4 of the same KV cache"),
    ([1, 2, 3], [4, 5, 7], [0, 0, 0], "row 2 at position 7 follows position 5"),
    ([1, 2], [5, 4], [0, 0], "row 1 at position 4 follows position 5"),
    ([1, 2, 3], [4, 4, 6], [0, 1, 0], "row 2 at position 6 follows position 4"),
])
def test_bad_rows_are_refused_before_anything_is_written(llama: NativeModel, tokens, positions, which,
                                                         message) -> None:
    caches = [_filled(llama), _filled(llama)]
    before = _snapshot(*caches)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        llama.native.step_batch(tokens, positions, [caches[i] for i in which])
    for a, b in zip(before, _snapshot(*caches)):
        np.testing.assert_array_equal(a, b)


def test_positions_beyond_the_window_and_the_table(llama: NativeModel) -> None:
    cache = _filled(llama)
    with pytest.raises(ValueError, match="position 64 outside the context window 64"):
        llama.decode_batch([1], [WINDOW], [cache])
    with pytest.raises(ValueError, match="3 tokens, 2 positions, 3 caches"):
        llama.decode_batch([1, 2, 3], [4, 5], [cache] * 3)
    small = llama.new_cache(WINDOW, block=8)
    llama.run([1, 2, 3], 0, small)
    with pytest.raises(ValueError, match=r"position 40 outside its KV cache \(capacity 8\)"):
        llama.native.step_batch([1], [40], [small])  # not reserved: beyond the cache's capacity so far
    long = llama.new_cache(2 * WINDOW)
    long.reserve(2 * WINDOW)
    with pytest.raises(ValueError, match=r"position 64 outside its KV cache \(capacity 128\) / RoPE table \(64\)"):
        llama.native.step_batch([1], [WINDOW], [long])


def test_decode_batch_grows_the_caches_first(llama: NativeModel) -> None:
    """Caches grow in blocks: decode_batch makes room for every row's position before the pointers cross."""
    small, other = llama.new_cache(WINDOW, block=8), llama.new_cache(WINDOW, block=8)
    ids = prompts((7,), seed=2)[0]
    llama.run(ids, 0, small), llama.run(ids, 0, other)
    want = [llama.run([t], 7 + i, other) for i, t in enumerate([3, 4])]
    got = llama.decode_batch([3, 4], [7, 8], [small, small])
    assert small.capacity >= 9
    np.testing.assert_allclose(got, np.stack(want), rtol=RTOL, atol=ATOL)


def test_caches_sharing_memory_and_caches_it_cannot_read(llama: NativeModel) -> None:
    cache = _filled(llama)
    alias = _filled(llama)
    alias.keys, alias.values = cache.keys, cache.values  # two objects, one memory: C finds the overlap
    before = _snapshot(cache)
    with pytest.raises(ValueError, match="KV caches that share memory"):
        llama.native.step_batch([1, 2], [4, 9], [cache, alias])
    for a, b in zip(before, _snapshot(cache)):
        np.testing.assert_array_equal(a, b)
    strided = _filled(llama)
    strided.keys = np.asfortranarray(strided.keys)
    with pytest.raises(ValueError, match="row 1's KV cache is not one the native step reads"):
        llama.native.step_batch([1, 2], [4, 4], [cache, strided])


@pytest.mark.parametrize("bad", [0, abi.BATCH_MAX_ROWS + 1])
def test_the_batch_maximum_is_checked(llama_folder: Path, bad: int) -> None:
    with pytest.raises(ValueError, match=f"batch maximum {bad}: the native decoder takes 1..{abi.BATCH_MAX_ROWS} rows"):
        native_model(llama_folder, max_batch=bad)


def test_c_checks_its_inputs_itself(llama: NativeModel) -> None:
    """The C entry point refuses, as codes, what the Python checks would have stopped (no signal on any input)."""
    lib, d = llama.native._lib, llama.native
    llama.decode_batch([1], [4], [_filled(llama)])  # the batch's scratch exists
    a, b = _filled(llama), _filled(llama, kind="q8")

    def arrays(*caches: ArrayKVCache, kind: int | None = None, capacity: int | None = None) -> ctypes.Array:
        out = (abi.KVCacheDesc * len(caches))()
        for i, c in enumerate(caches):
            scales = (c.key_scales.ctypes.data, c.value_scales.ctypes.data) if c.kind == "q8" else (None, None)
            out[i] = abi.KVCacheDesc(c.keys.ctypes.data, c.values.ctypes.data, *scales,
                                    {"f32": 0, "q8": 2}[c.kind] if kind is None else kind,
                                    c.keys.shape[3] if capacity is None else capacity)
        return out

    def step(tokens, pos, cache_of, caches, n=None) -> int:
        t, p, c = (np.asarray(v, dtype=np.int32) for v in (tokens, pos, cache_of))
        logits = np.empty((max(len(tokens), 1), VOCAB), dtype=np.float32)
        return lib.el_batch_step(d._batch, len(tokens), t.ctypes.data, p.ctypes.data, c.ctypes.data,
                                 caches, len(caches) if n is None else n, logits.ctypes.data)

    before = _snapshot(a, b)
    assert step([1], [4], [0], arrays(a)) == 0
    assert step([1, 2], [5, 4], [0, 1], arrays(a, b)) == 0
    before = _snapshot(a, b)
    assert step([1] * 5, [4, 5, 6, 7, 8], [0] * 5, arrays(a)) == 4  # more rows than the maximum
    assert step([1], [4], [1], arrays(a)) == 5  # a cache index outside the caches
    assert step([1], [4], [0], arrays(a, kind=7)) == 5  # no such kind
    assert step([1], [4], [0], arrays(a, capacity=0)) == 5
    assert step([1, 2], [4, 4], [0, 1], arrays(a, a)) == 5  # two caches, one memory
    assert step([1], [a.capacity], [0], arrays(a)) == 1  # outside the capacity
    assert step([1], [-3], [0], arrays(a)) == 1
    assert step([VOCAB], [4], [0], arrays(a)) == 2
    assert step([1, 2], [4, 6], [0, 0], arrays(a)) == 6  # not consecutive
    assert step([1, 2], [4, 5], [0, 0], arrays(a), n=0) == 5
    for x, y in zip(before, _snapshot(a, b)):
        np.testing.assert_array_equal(x, y)


# ---- the real model --------------------------------------------------------------------------------------------------
def test_smollm2_interleaved_sequences_decode_as_each_alone() -> None:
    from edgellm.runtime.engine import Engine

    engine = Engine.load("smollm2-135m", progress=False, threads=2)
    model = engine.session.model
    assert isinstance(model.native, NativeDecoder)
    texts = ["The capital of France is", "def fibonacci(n):\n    ",
             "Write a short list of three fruits, one per line, and nothing else:"]
    ids = [engine.tokenizer.encode(t) for t in texts]
    interleaved_greedy(model, "f32", ids, [24, 12, 18])
