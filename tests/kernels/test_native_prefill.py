"""The native prefill (edgellm/kernels/csrc/decoder/prefill.c, NativeDecoder.prefill) against torch's prefill path.

Both paths multiply with the same GEMM, el_gemm_bf16 (inputs rounded to bf16, weights to bf16, float32 sums):
torch's path takes it for every quantized matmul of more than NATIVE_MAX_M (2) rows on one torch thread, as here
(prompts of 3 tokens and more). The rest (embedding rows, norms, RoPE, attention, activations, soft-caps) both
compute in float32, in different orders. Where every bf16 rounding of a matmul input lands the same way, the two
agree to float32 rounding: measured at most 4e-7 relative per row of logits (Llama/Qwen rows mostly bit for bit);
``MATCH_TOL`` = 1e-5 leaves a 25x margin. Now and then the two float32 results of an input straddle a bf16
rounding boundary: that input moves by a bf16 step (2^-8 relative), which moves the logits of its position, and
through the keys/values of the next layers those of later positions, by up to 5.5e-3 relative (measured over these
models: 10 model/quantization pairs, 6 prompts of 60 tokens); ``FLIP_TOL`` = 0.03 bounds every row with a 5x margin,
while real mistakes (a window off by one, the wrong RoPE table, a soft-cap or scale missing) move rows by 0.1-1.
Since a flip carries into every later position, only a share of the rows (``MATCHED_SHARE``) must match to
``MATCH_TOL``; the first flip comes late enough in these prompts (measured: at least 48% of rows match).

What is asserted bit for bit: the native prefill against itself, chunked or in one call, on 1, 2 or 3 threads
(each score, softmax and output sums in an order that does not depend on the tiling, see prefill.c), and its
last-row logits against the last row of its all-logits call (el_gemm_bf16's lane path for a few rows against its
tiled path, which test_gemm_bf16_few_rows_are_the_tiled_bits also holds to the same bits on random weights).

Where the library has no AVX512-BF16 GEMM the native prefill multiplies with el_gemm_i8 in the x86 libraries (avx2,
avxvnni; test_this_module_on_the_avx2_library runs this module so in a child process: inputs quantized to int8 per
block of 32 as the decode step's, el_gemm_f32 for the formats it does not take) and with el_gemm_f32 (float32 operands,
weights dequantized exactly) in the NEON ones; _torch_prefill puts the same GEMM in the place of torch's path's bf16
one. With el_gemm_f32 the two agree to float32 rounding nearly everywhere (measured: logits rows within 1.3e-6
relative, keys/values but for the narrow kinds' rounding flips), so the same bounds hold; with el_gemm_i8 an int8
rounding flips where a bf16 one would (INT8 below has the measured bounds).

The tests run on each of the three KV cache kinds (``KINDS``): float32, IEEE half ("f16": new keys/values rounded to
nearest even as torch's .half()) and int8 with a float32 scale per token per head ("q8": quantized as
kv_cache.quantize_q8). Both paths write the chunk's keys/values in the narrow kind first and attend over every
position as stored (the chunk's own rounded ones included). The stored halves / ints and scales are the same bits
as torch's wherever the float32 values being stored are: ``test_stored_rows_are_torchs_bit_for_bit`` proves that on
layer 0 and bounds the rest (see there).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.kernels import native
from edgellm.models.kv_cache import quantize_q8
from edgellm.runtime.engine import Engine
from tests.kernels.test_native_decode import _make_model as _make_llama_model
from tests.kernels.test_native_decode import converted_engine, native_decoder
from tests.kernels.test_native_gemma import WINDOW, torch_without_each_feature
from tests.kernels.test_native_gemma import _make_model as _make_family_model
from tests.support.tiny import VOCAB, _save_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")
needs_bf16 = pytest.mark.skipif(native.prefill_matmul() != "bf16",
                                reason="the AVX512-BF16 GEMM (this CPU or library has none)")
needs_prefill = pytest.mark.skipif(native.prefill_matmul() is None, reason="no native prefill in this library")

MATCH_TOL = 1e-5  # rows where no bf16 rounding flipped: float32 rounding only (module doc)
FLIP_TOL = 0.03  # any row: room for flipped bf16 roundings (module doc)
MATCHED_SHARE = 0.4  # rows that must match to MATCH_TOL
# The f16 and q8 kinds round what both paths store: where their float32 results straddle a half (or q8 step) boundary,
# a stored element moves by a half ulp (2^-11 relative) or a q8 step, and the bf16 roundings after it flip far more
# often than for the float32 ulps alone. Measured over 20 prompts of 40 tokens on the 8 tiny models: the share of
# logits rows within MATCH_TOL averages 0.62-0.97 per model (f32: 0.75-0.95), the worst prompt's falls to 0 (f32:
# 0.07); this module's prompts keep at least 0.30 (``NARROW_SHARE`` = 0.25). What stays high on every prompt is the
# share of (layer, KV head, position) rows the two paths store bit for bit the same: at least 0.66 over those 480
# runs of any kind (``STORED_SHARE`` = 0.6).
NARROW_SHARE = 0.25
STORED_SHARE = 0.6
# el_gemm_i8 (the x86 libraries without AVX512-BF16) quantizes each matmul input to int8 per block of 32, as the decode
# step does: where the two paths' float32 inputs differ by an ulp across an int8 rounding boundary, that input moves by
# a step of 1/127 of its block's largest value, from layer 0 on (its keys/values, from normed embedding rows, measured
# 1.1e-5 off, against 0 with the float GEMMs), and such flips come earlier in the prompt than bf16 ones: measured on
# this module's prompts, the f16/q8 kinds' logits rows within MATCH_TOL fall to 0.12 (qwen3, f16), the worst row stays
# at 1.6e-2 (FLIP_TOL holds). Bounds with a 2x margin.
INT8 = native.prefill_matmul() == "int8"
if INT8:
    NARROW_SHARE = 0.06
FIRST_LAYER_TOL = 1e-4 if INT8 else MATCH_TOL
TIE_MARGIN = 0.5  # greedy tokens may differ where the top two logits are closer than this
CAPACITY = 64  # KV cache positions (the tiny models' context window is 128)
PROMPT = 40  # tokens: crosses the Gemma models' sliding window (WINDOW = 8) several times
KINDS = ("f32", "f16", "q8")  # the KV cache kinds (models/kv_cache.py)


def _make_head_dim_40_model(folder: Path) -> None:
    """A Llama whose head dim (40) is not a multiple of 16: the attention's vector tails (4 heads on 2 KV heads)."""
    torch.manual_seed(4)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=40, max_position_embeddings=128, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(5.0)  # clear winners among the logits, as tests/test_native_decode.py's models
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)


@pytest.fixture(scope="module", params=[("llama", "tied", "q4f16_1"), ("llama", "untied", "q8f16_1"),
                                        ("llama", "head_dim=40", "q4f16_1"),
                                        ("qwen2", "untied", "q4f16_1"), ("qwen3", None, "q4f16_1"),
                                        ("gemma2", 30.0, "q8f16_1"), ("gemma3", 30.0, "q4f16_1"),
                                        ("gemma3", None, "q8f16_1")],
                ids=lambda p: "-".join(str(x) for x in p if x is not None))
def case(request, tmp_path_factory) -> Engine:
    """A one-thread engine on a tiny random model: Llama (tied / untied / a head dim of 40), Qwen2 (q/k/v biases),
    Qwen3 (q/k norms), Gemma 2 (soft-capped scores and logits, sandwich norms, sliding layers), Gemma 3 (q/k norms,
    sliding layers with a RoPE table of their own, with and without soft-capped logits)."""
    if native.prefill_matmul() is None:
        pytest.skip("no native prefill in this kernel library")
    arch, option, quant = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{quant}")
    if option == "head_dim=40":
        _make_head_dim_40_model(root / "hf")
    elif arch in ("llama", "qwen2"):
        _make_llama_model(root / "hf", arch, tied=option == "tied")
    else:
        _make_family_model(root / "hf", arch, softcap=option)
    engine = converted_engine(root, quant)
    assert engine.model.native is not None
    return engine


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB - 2, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _gemm_native(x2: torch.Tensor, st) -> torch.Tensor:
    """dispatch._gemm_bf16's stand-in where the native prefill multiplies with el_gemm_i8 (el_gemm_f32 for the formats
    it answers -2 to) or el_gemm_f32: the same GEMM."""
    x2 = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], st.n, dtype=torch.float32)
    lib, args = native.load_library(), (int(st.fmt[1:]), st.qweight.data_ptr(), st.n, st.k, x2.data_ptr(), x2.shape[0],
                                         y.data_ptr())
    rc = lib.el_gemm_i8(None, *args) if native.prefill_matmul() == "int8" else -2
    assert (rc if rc != -2 else lib.el_gemm_f32(None, *args)) == 0
    return y


def _torch_prefill(engine: Engine, ids: list[int], start: int = 0, cache=None, kind: str = "f32"):
    """torch's prefill path: all logits (T, V) and the cache (a new one of `kind` unless given), on one torch thread
    (so that its matmuls take the same GEMM as the native prefill: el_gemm_bf16 where the CPU has it, else, put in
    its place here, el_gemm_f32)."""
    from edgellm.quant import dispatch

    model = engine.model.torch  # the torch half of torch prefill + native decode
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with pytest.MonkeyPatch.context() as mp:
            if native.prefill_matmul() in ("int8", "f32"):
                mp.setattr(dispatch, "_takes_gemm_bf16", lambda threads: True)
                mp.setattr(dispatch, "_gemm_bf16", _gemm_native)
            cache = cache if cache is not None else model.new_cache(CAPACITY, kind=kind)
            return model(torch.tensor([ids]), start, cache, all_logits=True)[0].float(), cache
    finally:
        torch.set_num_threads(threads)


def _native_prefill(engine: Engine, ids: list[int], start: int = 0, cache=None, *, all_logits: bool = True,
                    kind: str = "f32"):
    cache = cache if cache is not None else engine.model.new_cache(CAPACITY, kind=kind)
    logits = engine.model.native.prefill(ids, start, cache, all_logits=all_logits)
    assert logits is not None, f"the native prefill declined a {cache.kind} cache on a CPU with the bf16 GEMM"
    return torch.from_numpy(np.asarray(logits)), cache


def _row_errors(got: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """Relative error of each row (last dim) of got vs expected."""
    got, expected = got.double().flatten(0, -2), expected.double().flatten(0, -2)
    return (got - expected).norm(dim=-1) / expected.norm(dim=-1)


def _assert_close_rows(errors: torch.Tensor, what: str, share: float = MATCHED_SHARE) -> None:
    """Every row within FLIP_TOL, `share` of them within MATCH_TOL."""
    matched = (errors <= MATCH_TOL).double().mean().item()
    print(f"{what}: {matched:.0%} of rows match to {MATCH_TOL:.0e}, the worst is off by {errors.max():.1e}")
    assert errors.max() <= FLIP_TOL, f"{what}: a row is off by {errors.max():.2e} relative (bound {FLIP_TOL})"
    assert matched >= share, f"{what}: only {matched:.0%} of rows match to {MATCH_TOL:.0e}"


def _kv(cache, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions 0..end-1 as floats, (layers, 1, kv_heads, end, head_dim): as stored (f32), widened
    (f16) or dequantized (q8: int8 * scale), as torch's attention reads them."""
    if cache.kind == "q8":
        return (cache.keys[:, :, :, :end].float() * cache.key_scales[:, :, :, :end],
                cache.values[:, :, :, :end].float() * cache.value_scales[:, :, :, :end])
    return cache.keys[:, :, :, :end].float(), cache.values[:, :, :, :end].float()


def _stored_tensors(cache) -> list[torch.Tensor]:
    """Keys, values (float32, half or int8) and for q8 their scales: the cache's tensors, as stored."""
    return [cache.keys, cache.values, *((cache.key_scales, cache.value_scales) if cache.kind == "q8" else ())]


def _stored(cache, end: int) -> list[torch.Tensor]:
    """Copies of what the cache holds for positions 0..end-1 (_stored_tensors)."""
    return [t[:, :, :, :end].clone() for t in _stored_tensors(cache)]


def _same_bits(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _fill(cache, value: float) -> None:
    """Every stored element (scales included) set to `value`."""
    for t in _stored_tensors(cache):
        t.fill_(value)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_matches_torch_path(case: Engine, kind: str) -> None:
    """Every position's logits and the keys/values written (as attention reads them), against torch's prefill path
    on a cache of the same kind (module doc)."""
    ids = _ids(PROMPT, 5)
    expected, reference = _torch_prefill(case, ids, kind=kind)
    got, cache = _native_prefill(case, ids, kind=kind)
    assert got.shape == (PROMPT, VOCAB) and got.dtype == torch.float32
    _assert_close_rows(_row_errors(got, expected), "logits", share=MATCHED_SHARE if kind == "f32" else NARROW_SHARE)
    for name, mine, theirs in zip(("keys", "values"), _kv(cache, PROMPT), _kv(reference, PROMPT), strict=True):
        _assert_close_rows(_row_errors(mine, theirs), name)
    # the first layer's keys/values come from the embedding rows alone: no attention before them to flip a rounding
    for mine, theirs in zip(_kv(cache, PROMPT), _kv(reference, PROMPT), strict=True):
        assert _row_errors(mine[0], theirs[0]).max() <= FIRST_LAYER_TOL


@pytest.mark.parametrize("kind", ["f16", "q8"])
def test_stored_rows_are_torchs_bit_for_bit(case: Engine, kind: str) -> None:
    """The halves (f16) or int8 rows and scales (q8) the native prefill stores are torch's conversion of the float32
    values it stores, bit for bit, and torch's own wherever torch's float32 values are the same bits.

    What is provable: layer 0's keys/values are computed before any attention, so they do not depend on the cache
    kind, and a float32-cache prefill of either path shows them as they are before the conversion. On layer 0 then:
    (1) every native stored row is torch's .half() / quantize_q8 of the native float32 row, bit for bit; (2) wherever
    the native and torch float32 rows are the same bits (nearly everywhere: a bf16 rounding of a matmul input seldom
    flips between the two paths' float32 results, see the module doc), the stored rows are the same bits too. On the
    later layers the values being stored depend on attention over the rounded cache and are not observable: one flip
    moves a row by a bf16 step and every later row a little, so STORED_SHARE of the rows must be the same bits (see
    there) and every row, widened or dequantized, within FLIP_TOL. With el_gemm_f32 (no bf16 rounding of the matmul
    inputs to absorb the paths' different float32 roundings of a norm) the float32 rows of layer 0 seldom are the same
    bits: (1) and (2) are asserted, the shares are not, every row within FLIP_TOL."""
    bf16 = native.prefill_matmul() == "bf16"
    ids = _ids(PROMPT, 12)
    _, torch32 = _torch_prefill(case, ids)
    _, native32 = _native_prefill(case, ids)
    _, reference = _torch_prefill(case, ids, kind=kind)
    _, cache = _native_prefill(case, ids, kind=kind)
    mine, theirs = _stored(cache, PROMPT), _stored(reference, PROMPT)
    mine_f32, theirs_f32 = _stored(native32, PROMPT), _stored(torch32, PROMPT)
    for i in range(2):  # keys, values
        layer0 = mine_f32[i][0]  # (1, kv_heads, PROMPT, head_dim) float32
        if kind == "f16":  # (1)
            assert torch.equal(mine[i][0], layer0.half())
        else:
            q, scale = quantize_q8(layer0)
            assert torch.equal(mine[i][0], q) and torch.equal(mine[i + 2][0], scale)
        # rows (layer, 1, kv_heads, PROMPT) stored as torch's: the halves / ints (and for q8 the scale)
        rows_same = (mine[i] == theirs[i]).all(-1)
        if kind == "q8":
            rows_same &= (mine[i + 2] == theirs[i + 2]).squeeze(-1)
        same_floats = (layer0 == theirs_f32[i][0]).all(-1)  # layer 0's rows with the same float32 bits
        assert not bf16 or same_floats.double().mean() >= 0.9, "the float32 rows of layer 0 differ too often"
        assert bool(rows_same[0][same_floats].all()), "a row stored from the same float32 bits is not torch's"  # (2)
        assert not bf16 or rows_same.double().mean() >= STORED_SHARE, f"only {rows_same.double().mean():.0%} same"
    for name, a, b in zip(("keys", "values"), _kv(cache, PROMPT), _kv(reference, PROMPT), strict=True):
        _assert_close_rows(_row_errors(a, b), f"{kind} {name}", share=STORED_SHARE if bf16 else 0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_prefill_after_a_torch_prefill(case: Engine, kind: str) -> None:
    """A native chunk at start > 0 attends over keys/values torch's path wrote (and the other way round): the
    same cache layout. (A rounding flipped in either path's first chunk carries into every row of the second:
    only FLIP_TOL is asserted.)"""
    ids = _ids(PROMPT, 6)
    expected, _ = _torch_prefill(case, ids, kind=kind)
    _, cache = _torch_prefill(case, ids[:17], kind=kind)
    got, cache = _native_prefill(case, ids[17:], 17, cache)
    _assert_close_rows(_row_errors(got, expected[17:]), "logits after torch's first 17 positions", share=0.0)
    cache = _native_prefill(case, ids[:23], kind=kind)[1]
    after, _ = _torch_prefill(case, ids[23:], 23, cache)
    _assert_close_rows(_row_errors(after, expected[23:]), "torch's logits after 23 native positions", share=0.0)


@pytest.mark.parametrize("kind", KINDS)
def test_chunked_prefill_is_one_call_bit_for_bit(case: Engine, kind: str) -> None:
    """Three uneven chunks (the last two start past the sliding window) give the logits and cache of one call (a
    chunk reads the earlier ones' keys/values as stored, as one call reads its own)."""
    ids = _ids(PROMPT, 7)
    whole, cache = _native_prefill(case, ids, kind=kind)
    chunks, chunked = [], case.model.new_cache(CAPACITY, kind=kind)
    for a, b in ((0, 5), (5, 19), (19, PROMPT)):
        chunks.append(_native_prefill(case, ids[a:b], a, chunked)[0])
    assert torch.equal(torch.cat(chunks), whole)
    assert _same_bits(_stored(chunked, PROMPT), _stored(cache, PROMPT))
    last, _ = _native_prefill(case, ids[19:], 19, chunked, all_logits=False)
    assert torch.equal(last, whole[-1])


@pytest.mark.parametrize("kind", KINDS)
def test_last_row_logits_are_the_last_row_of_all(case: Engine, kind: str) -> None:
    ids = _ids(PROMPT, 8)
    every, _ = _native_prefill(case, ids, kind=kind)
    last, _ = _native_prefill(case, ids, all_logits=False, kind=kind)
    assert last.shape == (VOCAB,)
    assert torch.equal(last, every[-1])
    one, _ = _native_prefill(case, ids[:1], all_logits=False, kind=kind)  # a single token is a prefill too
    assert torch.equal(one, every[0])


def test_window_local_rope_and_softcap_are_exercised(case: Engine) -> None:
    """Past the window the native logits follow torch's path, and torch's path without the window, with the global
    RoPE table on the sliding layers (Gemma 3) or without soft-capped scores (Gemma 2) is ten times farther (so
    the comparisons above would see any of these mistakes)."""
    model = case.model.torch
    if not model.config.sliding_window:
        pytest.skip("no sliding layers")
    ids = _ids(PROMPT, 9)
    got, _ = _native_prefill(case, ids)
    late = slice(WINDOW + 1, None)
    close = _row_errors(got[late], _torch_prefill(case, ids)[0][late]).max().item()
    wrongs = torch_without_each_feature(model, lambda: _torch_prefill(case, ids)[0])
    for wrong in wrongs:
        assert _row_errors(got[late], wrong[late]).max() > 10 * max(close, 1e-3)


def _greedy_after(engine: Engine, prompt: list[int], cache, first: torch.Tensor,
                  steps: int) -> list[tuple[int, torch.Tensor]]:
    """Greedy tokens decoded by the native step after a prefill of `prompt` whose last logits are `first`, with the
    logits each token was chosen from."""
    out, logits = [], first
    for pos in range(len(prompt), len(prompt) + steps):
        token = int(logits.argmax())
        out.append((token, logits))
        logits = torch.as_tensor(np.asarray(engine.model.native.step(token, pos, cache))).reshape(-1)
    return out


def _assert_same_greedy_tokens(mine: list[tuple[int, torch.Tensor]], theirs: list[tuple[int, torch.Tensor]]) -> None:
    """The same tokens, up to a step where torch-prefill's run had a near-tie (top two within TIE_MARGIN): a flipped
    rounding may order it either way, and the runs part there."""
    for step, ((token, _), (best, row)) in enumerate(zip(mine, theirs, strict=True)):
        if token != best:
            margin = row[best] - row[token]
            assert margin <= TIE_MARGIN, f"step {step}: native prefill led to {token}, torch's to {best} ({margin:.3f})"
            return


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decode_after_native_prefill_matches_torch_prefill(case: Engine, kind: str) -> None:
    """The native steps after a native prefill pick torch-prefill's tokens, except where its top two logits are
    within TIE_MARGIN (a flipped rounding may order a near-tie either way; the runs part there)."""
    prompt = _ids(12, 10)
    logits, cache = _native_prefill(case, prompt, kind=kind)
    mine = _greedy_after(case, prompt, cache, logits[-1], 24)
    logits, cache = _torch_prefill(case, prompt, kind=kind)
    theirs = _greedy_after(case, prompt, cache, logits[-1], 24)
    _assert_same_greedy_tokens(mine, theirs)


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_range_prefills_are_refused_and_write_nothing(case: Engine, kind: str) -> None:
    model = case.model
    decoder = model.native
    cache = model.new_cache(CAPACITY, kind=kind)
    assert cache.keys.shape[3] == CAPACITY
    _fill(cache, 7.0)
    untouched = _stored(cache, CAPACITY)

    def unchanged() -> bool:
        return _same_bits(_stored(cache, CAPACITY), untouched)

    with pytest.raises(ValueError, match=r"positions 60\.\.69: position outside the KV cache / RoPE table \(cache capacity 64,"):
        decoder.prefill([1] * 10, 60, cache)
    assert unchanged()
    for tokens, bad in (([3, VOCAB, 4], VOCAB), ([3, -1], -1), ([3, 2**40], 2**40)):
        with pytest.raises(ValueError, match=f"token id {bad} outside the vocabulary"):
            decoder.prefill(tokens, 0, cache, all_logits=True)
        assert unchanged()
    with pytest.raises(ValueError, match="no tokens"):
        decoder.prefill([], 0, cache)
    with pytest.raises(ValueError, match="outside the KV cache"):
        decoder.prefill([1, 2], -1, cache)
    assert unchanged()
    rope_len = model.torch.rope.length  # a cache longer than the RoPE table: the table is the limit
    long = model.new_cache(rope_len + 16, block=0, kind=kind)
    assert long.keys.shape[3] == rope_len + 16
    _fill(long, 7.0)
    with pytest.raises(ValueError, match="RoPE table"):
        decoder.prefill([1, 2, 3, 4], rope_len - 2, long)
    assert all(bool((t == 7).all()) for t in _stored_tensors(long))
    decoder.prefill([1, 2], rope_len - 2, long)  # its last positions are fine
    assert not all(bool((t == 7).all()) for t in _stored_tensors(long))


def test_caches_the_step_refuses_are_declined(case: Engine) -> None:
    """A cache `accepts` refuses (an f32 cache of bfloat16, an f16 or q8 cache attending in bfloat16, a batch of
    2): None, nothing written; the caller keeps torch's path. The three kinds in float32 are taken."""
    model = case.model
    for kind in KINDS:
        assert model.native.prefill([1, 2, 3], 0, model.new_cache(CAPACITY, kind=kind)) is not None
    caches = model.torch.new_cache  # torch's caches of other dtypes and batches
    for cache in (caches(CAPACITY, dtype=torch.bfloat16), caches(CAPACITY, kind="f16", dtype=torch.bfloat16),
                  caches(CAPACITY, kind="q8", dtype=torch.bfloat16), caches(CAPACITY, batch=2)):
        cache.reserve(CAPACITY)
        _fill(cache, 0)
        assert model.native.prefill([1, 2, 3], 0, cache) is None
        assert not any(t.any() for t in _stored_tensors(cache))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [2, 3])
def test_thread_counts_give_the_same_bits(case: Engine, threads: int, kind: str) -> None:
    """Matmul tiles, rows and attention items are handed out dynamically, but each output is summed in one order:
    any thread count gives the same logits and cache (over 3 threads on this machine's cores too)."""
    model = case.model
    ids = _ids(PROMPT, 11)
    one, cache = _native_prefill(case, ids, kind=kind)
    tail, _ = _native_prefill(case, ids[25:], 25, _native_prefill(case, ids[:25], kind=kind)[1])
    decoder = model.native
    model.native = native_decoder(case, native.load_library(), native.pool(threads))
    try:
        assert model.native is not decoder and model.native.threads == threads
        many, many_cache = _native_prefill(case, ids, kind=kind)
        many_tail, _ = _native_prefill(case, ids[25:], 25, _native_prefill(case, ids[:25], kind=kind)[1])
    finally:
        model.native.close()
        model.native = decoder
    assert torch.equal(one, many) and torch.equal(tail, many_tail)
    assert _same_bits(_stored(cache, PROMPT), _stored(many_cache, PROMPT))


# ------------------------------------------------------------------- el_gemm_bf16 with a few activation rows

_BLOCK = {"q4": (160, 2), "q8": (272, 1)}  # bytes of an interleaved 8-row block, half vectors at its start (d, m)


def _random_weight(fmt: str, n: int, k: int, seed: int) -> np.ndarray:
    """Random interleaved q4 / q8 row groups ([n / 8][k / 32] blocks of csrc/edgellm_kernels.h) whose scales (and
    q4 mins) are finite halves of every magnitude, subnormals and zeros included, of either sign."""
    size, halves = _BLOCK[fmt]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n // 8 * (k // 32), size), dtype=np.uint8)
    scale = rng.choice([0.0, 1.0], p=[0.02, 0.98], size=(blocks.shape[0], 8 * halves)) * rng.choice(
        [-1.0, 1.0], size=(blocks.shape[0], 8 * halves)) * 2.0 ** rng.uniform(-26, 10, (blocks.shape[0], 8 * halves))
    blocks[:, :16 * halves] = scale.astype(np.float16).view(np.uint8)
    return blocks


def _activations(m: int, k: int, seed: int) -> np.ndarray:
    """Float32 rows of every magnitude: zeros, float32 subnormals (bf16 keeps some, the dot product flushes them),
    values whose bf16 rounding is a tie, large ones."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((m, k)) * 2.0 ** rng.uniform(-20, 20, (m, k))).astype(np.float32)
    x[rng.random((m, k)) < 0.03] = 0.0
    x[rng.random((m, k)) < 0.03] = np.float32(3e-39)
    ties = rng.random((m, k)) < 0.05
    x[ties] = (np.float32(1.0) + np.float32(2.0**-8)) * rng.choice([-1, 1], size=int(ties.sum())).astype(np.float32)
    return x


@needs_bf16
@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_gemm_bf16_few_rows_are_the_tiled_bits(fmt: str) -> None:
    """Up to 8 activation rows (the LM head of prefill's last position) take el_gemm_bf16's lane path: weight rows in
    the lanes, dequantized straight from the blocks. Its outputs are the tiled path's bits (each row's outputs do
    not depend on the other rows: the tiled path's are those of the same rows among 9 or 40), for N ending anywhere
    in a 64-row work item (one 8-row group alone at the end) and on pools of 1 and 3 threads."""
    lib = native.load_library()
    code = int(fmt[1:])
    pool = lib.el_pool_create(3)
    try:
        for n, k in ((8, 32), (24, 64), (136, 96), (1000, 224), (2056, 896)):
            w = _random_weight(fmt, n, k, seed=n + k)
            x = _activations(40, k, seed=n)

            def gemm(rows: np.ndarray, p: int | None) -> np.ndarray:
                rows = np.ascontiguousarray(rows)
                y = np.full((len(rows), n), np.nan, dtype=np.float32)
                assert lib.el_gemm_bf16(p, code, w.ctypes.data, n, k, rows.ctypes.data, len(rows), y.ctypes.data) == 0
                return y

            tiled = {rows: gemm(x[:rows], None) for rows in (9, 40)}
            assert np.array_equal(tiled[9].view(np.uint32), tiled[40][:9].view(np.uint32))
            for m in range(1, 9):
                for p in (None, pool):
                    few = gemm(x[:m], p)
                    assert np.array_equal(few.view(np.uint32), tiled[40][:m].view(np.uint32)), (n, k, m, p)
                    assert np.isfinite(few).all()
            shifted = gemm(x[31:34], pool)  # rows 31..33: a tile boundary of the tiled path, not of the lane path
            assert np.array_equal(shifted.view(np.uint32), tiled[40][31:34].view(np.uint32))
    finally:
        lib.el_pool_destroy(pool)


_PREFILL_IN_CHILD = """
import sys, torch
from edgellm.artifact.reader import open_artifact
from edgellm.kernels import native
from edgellm.runtime.engine import Engine
engine = Engine(open_artifact(sys.argv[1]), threads=1, runtime="torch")
assert engine.model.native is not None, engine.decode_path
declined = untouched = True
for kind in ("f32", "f16", "q8"):
    cache = engine.model.new_cache(64, kind=kind)
    cache.keys.fill_(7), cache.values.fill_(7)
    logits = engine.model.native.prefill([1, 2, 3, 4], 0, cache, all_logits=True)
    declined &= logits is None
    assert logits is None or bool(torch.isfinite(torch.as_tensor(logits)).all())
    untouched &= bool((cache.keys == 7).all()) and bool((cache.values == 7).all())
print(native.active_kernel()[0], native.prefill_matmul(), declined, untouched)
"""


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory) -> Path:
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert

    root = tmp_path_factory.mktemp("llama-q4")
    _make_llama_model(root / "hf", "llama", tied=True)
    return open_artifact(convert(root / "hf", root / "art", quantization="q4f16_1", progress=False)).folder


@pytest.mark.parametrize("variant", ["avx2", "avxvnni", "scalar", "avx2 f32"])
def test_libraries_without_bf16_gemm_prefill_with_the_int8_gemm(tiny_artifact: Path, variant: str) -> None:
    """A library built without AVX-512 (EDGELLM_KERNEL forces it, in a child process): the native decoder loads and
    prefills with el_gemm_i8 on every cache kind (with el_gemm_f32 where EDGELLM_PREFILL_GEMM=f32 asks for it); the scalar library has no native prefill: it answers None and
    leaves the cache as it was (the caller goes token by token, or keeps torch's path)."""
    variant, _, gemm = variant.partition(" ")
    if native.verdict(variant) is not None:
        pytest.skip(f"the {variant} library does not run here: {native.verdict(variant)}")
    env = dict(os.environ, **{native.ENV_VAR: variant, native.PREFILL_ENV_VAR: gemm})
    proc = subprocess.run([sys.executable, "-c", _PREFILL_IN_CHILD, str(tiny_artifact)], capture_output=True,
                          text=True, env=env, timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = [variant, "None", "True", "True"] if variant == "scalar" else [variant, gemm or "int8", "False", "False"]
    assert proc.stdout.split() == expected


def test_active_library_prefills_where_it_has_a_prefill(tiny_artifact: Path) -> None:
    """On this process's library: the prefill runs where native.prefill_matmul() names a GEMM, else answers None."""
    from edgellm.artifact.reader import open_artifact

    engine = Engine(open_artifact(tiny_artifact), threads=1)
    cache = engine.model.new_cache(CAPACITY)
    result = engine.model.native.prefill([1, 2, 3], 0, cache)
    assert (result is not None) == (native.prefill_matmul() is not None)


@pytest.mark.skipif(native.prefill_matmul() != "bf16" or native.verdict("avx2") is not None,
                    reason="this process already runs the float GEMM's prefill, or the avx2 library cannot run here")
def test_this_module_on_the_avx2_library() -> None:
    """Every test above (torch's path against the native prefill, chunked against one call and 1-3 threads bit for
    bit, every model family and cache kind) again with the avx2 library (EDGELLM_KERNEL, in a child process), whose
    prefill multiplies with el_gemm_i8 (and torch's path, as _torch_prefill sets it up, too)."""
    env = dict(os.environ, **{native.ENV_VAR: "avx2"})
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                           "not smollm2 and not this_module"], capture_output=True, text=True, env=env,
                          timeout=900, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert " passed" in proc.stdout and " failed" not in proc.stdout


# ---------------------------------------------------------------------------------- the real model


@pytest.fixture(scope="module")
def smollm2_engine() -> Engine:
    if native.prefill_matmul() is None:
        pytest.skip("no native prefill in this kernel library")
    return Engine.load("smollm2-135m", quantization="q4f16_1", progress=False, threads=1, runtime="torch")


# A real model multiplies far more values per position (30 layers, 1536-wide MLP): some bf16 rounding flips in nearly
# every row, often from the first position on, so no share of rows matches to MATCH_TOL. Measured over four prompts
# of 19-79 tokens: SmolLM2 rows off by at most 3.2e-2 relative, 1.1e-2 on average (Qwen2.5-Coder-0.5B 6.8e-3 /
# 2.9e-3, Gemma 3 270M 1.3e-2 / 5.2e-3), the same top token but at near-ties. The f16 kind is about as close; q8
# farther, as a flip moves the int8 rows after it by whole quantization steps (measured on prompts of 24 and 61 tokens:
# SmolLM2 4.4e-2 / 1.1e-2 and 7.9e-2 / 2.0e-2, about as far as torch's own q8 path is from its f32 one, 1.2e-1 /
# 2.1e-2; Qwen2.5-Coder-0.5B 1.3e-2 / 5.9e-3, Gemma 3 270M 6.9e-2 / 2.0e-2). Bounds with a 2-3x margin (on this
# test's prompt, q8 included):
REAL_MAX_TOL, REAL_MEAN_TOL = 0.1, 0.025
# With el_gemm_i8's int8 inputs the flips (see INT8 above) are whole int8 steps: measured on this test's prompt, rows
# off by at most 9.0e-2 / 3.3e-2 on average (f32 kind; f16 7.2e-2 / 2.8e-2, q8 6.1e-2 / 3.0e-2).
if INT8:
    REAL_MAX_TOL, REAL_MEAN_TOL = 0.2, 0.07


@needs_prefill
@pytest.mark.parametrize("kind", KINDS)
def test_smollm2_prefill_matches_torch_path(smollm2_engine: Engine, kind: str) -> None:
    """A real model's activations (outliers included): rows within REAL_MAX_TOL, on average REAL_MEAN_TOL, the same
    top token at every position but near-ties, and the same greedy tokens after either prefill."""
    ids = smollm2_engine.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    if n < 2:")
    assert len(ids) > 16
    expected, reference = _torch_prefill(smollm2_engine, ids, kind=kind)
    got, cache = _native_prefill(smollm2_engine, ids, kind=kind)
    errors = _row_errors(got, expected)
    print(f"{kind}: rows off by at most {errors.max():.1e}, {errors.mean():.1e} on average")
    assert errors.max() <= REAL_MAX_TOL and errors.mean() <= REAL_MEAN_TOL, errors
    top2 = expected.topk(2, dim=-1).values
    assert ((got.argmax(-1) == expected.argmax(-1)) | (top2[:, 0] - top2[:, 1] <= TIE_MARGIN)).all()
    mine = _greedy_after(smollm2_engine, ids, cache, got[-1], 16)
    theirs = _greedy_after(smollm2_engine, ids, reference, expected[-1], 16)
    _assert_same_greedy_tokens(mine, theirs)
