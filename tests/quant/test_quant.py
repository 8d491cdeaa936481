"""Quantization schemes, portable formats, the kernel-dispatch seam and the quantized layers.

Numbers proved here:
* q8 / q4 quantization error <= stored scale / 2 per weight (plus float32 arithmetic slack),
  exact round trips for on-grid weights, zero rows and constant groups handled.
* Every kernel agrees with ``x @ dequantize(parts).T`` computed in float64: f32/f16 to 1e-5
  relative; q8/q4 (bf16 activations and bf16 scales) to 1e-2 relative in norm and
  ``|y - ref| <= 1e-2 * (|x| @ |W|.T)`` per element (measured: <= 6e-3).
"""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch
from torch import nn

from edgellm.errors import ArtifactError, KernelUnavailableError, UnsupportedQuantizationError
from edgellm.quant import dispatch
from edgellm.quant.formats import (
    FORMAT_SUFFIXES,
    FORMATS,
    SOURCE_ONLY,
    bits_per_weight,
    dequantize,
    embed_rows,
    q4_fields,
    q8_fields,
    quantize,
    row_blocks,
    storage_bytes,
    tensor_names,
    weight_shape,
)
from edgellm.quant.layers import QuantEmbedding, QuantLinear, make_embedding, make_linear, resident_bytes
from edgellm.quant.schemes import SCHEMES, get_scheme

F32_F64 = torch.float64


def _nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Rows of very different magnitudes and offsets, one zero row, one constant group."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, n).unsqueeze(1)
    w += torch.randn(n, 1, generator=g)
    w[1] = 0.0
    w[2, :32] = 0.1  # constant group whose value is not an f16
    return w


# ---------------------------------------------------------------------------- schemes


QUANTIZABLE = tuple(f for f in FORMATS if f not in SOURCE_ONLY)  # the GGUF block types: tests/test_kquant.py


def test_schemes_map_roles_to_formats() -> None:
    assert [s for s, v in SCHEMES.items() if v.keeps_source] == ["source"]  # its formats are the source's
    assert {s: v.mix for s, v in SCHEMES.items() if v.mix} == {"q4_k_m": "q4_k_m", "q6_k": "q6_k"}  # per tensor
    assert {s: (v.linear, v.embedding, v.lm_head) for s, v in SCHEMES.items() if not v.keeps_source and not v.mix} == {
        "q0f32": ("f32", "f32", "f32"),
        "q0f16": ("f16", "f16", "f16"),
        "q8f16_1": ("q8", "q8", "q8"),
        "q4f16_1": ("q4", "q4", "q4"),
        "q4f16_1e8": ("q4", "q8", "q8"),
    }
    assert get_scheme("q4f16_1e8").format_for("lm_head") == "q8"
    assert all(f in FORMATS for s in SCHEMES.values() for f in (s.linear, s.embedding, s.lm_head))


def test_unknown_scheme_lists_known() -> None:
    with pytest.raises(UnsupportedQuantizationError, match=r"q3f16_0.*q0f32.*q4f16_1e8"):
        get_scheme("q3f16_0")


# ---------------------------------------------------------------------------- q8


def test_q8_error_at_most_half_scale() -> None:
    w = _weight(40, 96)
    parts = quantize(w, "q8")
    assert parts["qweight"].dtype == torch.uint8 and parts["qweight"].shape == (5, 3 * 34 * 8)
    scales, _ = q8_fields(row_blocks(parts["qweight"], "q8"))
    assert scales.dtype == torch.float16 and scales.shape == (40, 3)
    err = (dequantize(parts, "q8") - w).abs().view(40, 3, 32).amax(dim=-1)
    scale = scales.float()
    assert torch.all(scale * 127 >= w.abs().view(40, 3, 32).amax(dim=-1))  # scale rounded up: no clipping
    assert torch.all(err <= scale / 2 * (1 + 1e-6))
    assert torch.all(dequantize(parts, "q8")[1] == 0) and torch.all(scales[1] == 0)  # zero row


def test_q8_group_scales_beat_one_scale_per_row() -> None:
    """A row whose groups differ in magnitude: per-group scales keep the small groups precise."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(4))
    w[:, :32] *= 100.0
    err = (dequantize(quantize(w, "q8"), "q8") - w).view(40, 3, 32)[:, 1:].abs().flatten(1).amax(dim=1)
    row_step = w.abs().amax(dim=1) / 127  # what one scale per row would round to
    assert torch.all(err[row_step > 0] < 0.05 * row_step[row_step > 0] / 2)


def test_q8_on_grid_round_trip_is_exact() -> None:
    g = torch.Generator().manual_seed(1)
    q = torch.randint(-127, 128, (8, 64), generator=g, dtype=torch.int8)
    q[:, 0] = 127
    q[::2, 1] = -127
    q[:, 32] = -127
    s = (torch.rand(8, 2, generator=g) * 0.1).half()
    w = (q.float().view(8, 2, 32) * s.float().unsqueeze(-1)).view(8, 64)
    parts = quantize(w, "q8")
    scales, qs = q8_fields(row_blocks(parts["qweight"], "q8"))
    assert torch.equal(qs.reshape(8, 64), q) and torch.equal(scales, s)
    assert torch.equal(dequantize(parts, "q8"), w)


# ---------------------------------------------------------------------------- q4


def _minmax_q4_error(w: torch.Tensor) -> torch.Tensor:
    """Squared error per group of the textbook quantizer: scale = (max - min) / 15, min = group min."""
    g = w.view(w.shape[0], -1, 32)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-12)
    q = ((g - lo) / scale).round().clamp(0, 15)
    return (q * scale + lo - g).square().sum(-1)


def test_q4_range_search_beats_min_max_per_group() -> None:
    w = _weight(40, 128)
    parts = quantize(w, "q4")
    ours = (dequantize(parts, "q4") - w).square().view(40, 4, 32).sum(-1)
    textbook = _minmax_q4_error(w)
    f16_slack = 1e-5 * w.view(40, 4, 32).square().sum(-1)  # stored scale/min are rounded to f16
    assert torch.all(ours <= textbook + f16_slack)
    assert ours.sum() < 0.9 * textbook.sum()  # and clearly better overall on Gaussian-like weights
    # inside the stored range, rounding error is at most half a step
    scales, mins, _ = q4_fields(row_blocks(parts["qweight"], "q4"))
    scales, mins = scales.float().unsqueeze(-1), mins.float().unsqueeze(-1)
    g = w.view(40, 4, 32)
    inside = (g >= mins) & (g <= mins + 15 * scales)
    err = (dequantize(parts, "q4") - w).abs().view(40, 4, 32)
    assert torch.all(err[inside] <= (scales / 2 + 1e-6).expand_as(g)[inside])
    assert torch.all(dequantize(parts, "q4")[1] == 0)  # zero row
    # the constant, non-f16 group comes back as close as f16 rounding of its value
    assert (dequantize(parts, "q4")[2, :32] - 0.1).abs().max() <= abs(torch.tensor(0.1).half().float() - 0.1)


def test_q4_on_grid_round_trip_is_exact() -> None:
    g = torch.Generator().manual_seed(2)
    q = torch.randint(0, 16, (8, 64), generator=g)
    q[:, 0], q[:, 1], q[:, 32], q[:, 33] = 0, 15, 15, 0  # every group spans 0..15
    s = torch.randint(1, 64, (8, 2), generator=g).float() / 256  # exact in f16 and f32 arithmetic
    m = torch.randint(-64, 64, (8, 2), generator=g).float() / 64
    w = (q.view(8, 2, 32) * s.unsqueeze(-1) + m.unsqueeze(-1)).view(8, 64)
    parts = quantize(w, "q4")
    scales, mins, qs = q4_fields(row_blocks(parts["qweight"], "q4"))
    assert torch.equal(scales.float(), s) and torch.equal(mins.float(), m)
    assert torch.equal(qs.reshape(8, 64).long(), q)
    assert torch.equal(dequantize(parts, "q4"), w)


def test_q4_constant_and_representable_group_is_exact() -> None:
    w = torch.full((8, 32), 0.375)
    w[1] = -2.0
    parts = quantize(w, "q4")
    assert torch.equal(q4_fields(row_blocks(parts["qweight"], "q4"))[0], torch.zeros(8, 1, dtype=torch.float16))
    assert torch.equal(dequantize(parts, "q4"), w)


def test_q4_nibble_order_byte_by_byte() -> None:
    # row r: q = 0..15 then 15..0, plus r (mod 16), with min 0 and scale 1 (f16 0x3C00, little-endian);
    # el_block_q4x8 = d[8], m[8], then byte 32 t + 4 r + b = q[r][4t + b] | q[r][16 + 4t + b] << 4
    base = torch.cat([torch.arange(16.0), torch.arange(15.0, -1.0, -1.0)])
    q = torch.stack([(base + r) % 16 for r in range(8)])
    q[:, 0], q[:, 1] = 0, 15  # every row spans 0..15: scale 1, min 0
    parts = quantize(q, "q4")
    qi = q.long().tolist()
    nibbles = [qi[r][4 * t + b] | qi[r][16 + 4 * t + b] << 4 for t in range(4) for r in range(8) for b in range(4)]
    expected = [0x00, 0x3C] * 8 + [0x00, 0x00] * 8 + nibbles
    assert parts["qweight"].tolist() == [expected]


def test_q8_block_byte_by_byte() -> None:
    # scale rounds up to the f16 just above 127/127 = 1.0 only if needed: here w = q exactly, d = 1.0;
    # el_block_q8x8 = d[8], then byte 32 t + 4 r + b = q[r][4t + b]
    w = torch.stack([torch.arange(-16.0, 16.0).roll(r) for r in range(8)])
    w[:, 0] = -127.0
    parts = quantize(w, "q8")
    qi = w.long().tolist()
    expected = [0x00, 0x3C] * 8 + [qi[r][4 * t + b] & 0xFF for t in range(8) for r in range(8) for b in range(4)]
    assert parts["qweight"].tolist() == [expected]


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_block_formats_refuse_n_not_multiple_of_8(fmt: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=rf"{fmt} needs the output dim.*multiple of 8.*N=7.*f16"):
        quantize(torch.randn(7, 64), fmt)
    with pytest.raises(UnsupportedQuantizationError, match=r"multiple of 32 and N of 8"):
        storage_bytes(fmt, (7, 64))


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_block_formats_refuse_k_not_multiple_of_32(fmt: str) -> None:
    with pytest.raises(UnsupportedQuantizationError, match=rf"{fmt} needs.*multiple of 32.*K=48.*f16"):
        quantize(torch.randn(8, 48), fmt)


def test_quantize_refuses_bad_input() -> None:
    with pytest.raises(UnsupportedQuantizationError, match="NaN"):
        quantize(torch.tensor([[1.0, float("nan")] * 16] * 8), "q8")
    with pytest.raises(UnsupportedQuantizationError, match="overflows float16"):
        quantize(torch.full((2, 32), 1e6), "f16")
    with pytest.raises(UnsupportedQuantizationError, match="q5"):
        quantize(torch.randn(2, 32), "q5")


# ---------------------------------------------------------------------------- sizes and names


@pytest.mark.parametrize("fmt", QUANTIZABLE)
@pytest.mark.parametrize("shape", [(8, 32), (56, 64), (96, 576)])
def test_storage_bytes_matches_parts(fmt: str, shape: tuple[int, int]) -> None:
    parts = quantize(torch.randn(*shape), fmt)
    assert set(parts) == set(FORMAT_SUFFIXES[fmt])
    assert _nbytes(parts) == storage_bytes(fmt, shape)
    assert bits_per_weight(fmt, shape) == 8 * _nbytes(parts) / (shape[0] * shape[1])


def test_bits_per_weight() -> None:
    assert bits_per_weight("q4") == bits_per_weight("q4", (896, 4864)) == 5.0
    assert bits_per_weight("q8", (1536, 576)) == bits_per_weight("q8") == 8.5
    assert (bits_per_weight("f16"), bits_per_weight("f32")) == (16.0, 32.0)


def test_tensor_names() -> None:
    assert tensor_names("model.layers.0.mlp.up_proj", "q4") == [
        "model.layers.0.mlp.up_proj.qweight",
    ]


def test_malformed_parts_are_artifact_errors() -> None:
    parts = quantize(torch.randn(8, 64), "q4")
    with pytest.raises(ArtifactError, match=r"missing part.*qweight"):
        weight_shape("q4", {"weight": parts["qweight"]})
    with pytest.raises(ArtifactError, match=r"qweight.*uint8"):
        weight_shape("q4", {"qweight": parts["qweight"].view(torch.int8)})
    with pytest.raises(ArtifactError, match="not whole 272-byte blocks"):
        make_linear("q8", {"qweight": torch.zeros(4, 40 * 8, dtype=torch.uint8)})


# ---------------------------------------------------------------------------- kernels


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, tol: float) -> None:
    """y vs float64 x @ w.T + bias: relative norm error and per-element |x|@|w|.T bound."""
    ref = x.to(F32_F64) @ w.to(F32_F64).T
    if bias is not None:
        ref += bias.to(F32_F64)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    err = (y.to(F32_F64) - ref).abs()
    assert (err.norm() / ref.norm()).item() <= tol
    assert torch.all(err <= tol * (x.to(F32_F64).abs() @ w.to(F32_F64).abs().T) + 1e-6)


TOL = {"f32": 1e-5, "f16": 1e-5, "q8": 1e-2, "q4": 1e-2}
# M = 1 / 7 / 64 and one M above each dense-path threshold; N = 96 is not a multiple of 64.
MS = (1, 7, 64, dispatch.Q4_DENSE_MIN_M + 4)


@pytest.mark.parametrize("fmt", QUANTIZABLE)
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_reference(fmt: str, with_bias: bool) -> None:
    torch.manual_seed(0)
    w = torch.randn(96, 128) * 0.1
    parts = quantize(w, fmt)
    bias = torch.randn(96) if with_bias else None
    lin = make_linear(fmt, parts, bias)
    wq = dequantize(parts, fmt)
    for m in MS:
        x = torch.randn(m, 128)
        _check(lin(x), x, wq, bias, TOL[fmt])
    x = torch.randn(2, 3, 5, 128)  # batched leading dims
    y = lin(x)
    assert y.shape == (2, 3, 5, 96)
    _check(y.reshape(-1, 96), x.reshape(-1, 128), wq, bias, TOL[fmt])


@pytest.mark.parametrize("fmt", QUANTIZABLE)
def test_kernel_takes_strided_and_empty_inputs(fmt: str) -> None:
    parts = quantize(torch.randn(64, 64), fmt)
    lin = make_linear(fmt, parts)
    x = torch.randn(64, 5).T  # non-contiguous rows (the packed torch ops reject these as-is)
    _check(lin(x), x, dequantize(parts, fmt), None, TOL[fmt])
    assert lin(torch.randn(2, 0, 64)).shape == (2, 0, 64)


def test_q4_dense_path_and_packed_kernel_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_SLAB_WEIGHTS", 64 * 64)  # several slabs
    torch.manual_seed(1)
    w = torch.randn(200, 64)
    parts = quantize(w, "q4")
    state = dispatch._prepare_q4(parts)
    assert len(state.slabs) > 1
    x = torch.randn(9, 64)
    packed = dispatch._matmul_q4(x, dataclasses.replace(state, dense_min_m=sys.maxsize))
    dense = dispatch._matmul_q4(x, dataclasses.replace(state, dense_min_m=0))
    _check(packed, x, dequantize(parts, "q4"), None, 1e-2)
    _check(dense, x, dequantize(parts, "q4"), None, 1e-2)


@pytest.mark.parametrize("fmt", ["q8", "q4"])
def test_torch_kernels_match_reference_in_several_slabs(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The torch paths (what runs without native kernels, and for prefill) on their own."""
    monkeypatch.setattr(dispatch, "_SLAB_WEIGHTS", 64 * 64)
    torch.manual_seed(2)
    parts = quantize(torch.randn(200, 96), fmt)
    preps = [dispatch._prepare_q8, dispatch._prepare_q8_resident] if fmt == "q8" else [dispatch._prepare_q4]
    matmul = dispatch._matmul_q8 if fmt == "q8" else dispatch._matmul_q4
    for prepare in preps:
        state = prepare(parts)
        for m in (1, 9, 100):
            x = torch.randn(m, 96)
            _check(matmul(x, state), x, dequantize(parts, fmt), None, 1e-2)


# ---------------------------------------------------------------------------- int4pack layout


def _pack_by_layout(q: torch.Tensor, layout: tuple[int, bool]) -> torch.Tensor:
    """Reference packer written from the layout description in dispatch.int4pack_layout."""
    rows, split = layout
    n, k = q.shape
    out = torch.empty(n // rows, k, rows // 2, dtype=torch.uint8)
    for b in range(n // rows):
        blk = q[b * rows : (b + 1) * rows]
        for j in range(rows // 2):
            lo, hi = (blk[j], blk[j + rows // 2]) if split else (blk[2 * j], blk[2 * j + 1])
            out[b, :, j] = (lo | (hi << 4)).to(torch.uint8)
    return out.view(n, k // 2)


def test_int4pack_layout_byte_by_byte() -> None:
    layout = dispatch.int4pack_layout()
    assert layout is not None, "unknown int4pack layout: prefill would lose its dense path"
    q = ((torch.arange(128).unsqueeze(1) * 3 + torch.arange(64)) % 16).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    assert packed.shape == (128, 32) and packed.dtype == torch.uint8
    assert torch.equal(packed, _pack_by_layout(q, layout))
    if layout == (64, True):  # AVX-512: byte [k, j] of block b = q[64b + j, k] | q[64b + j + 32, k] << 4
        flat = packed.view(-1)
        assert flat[0].item() == q[0, 0] | q[32, 0] << 4
        assert flat[5 * 32 + 7].item() == q[7, 5] | q[39, 5] << 4
        assert flat[64 * 32 + 2 * 32 + 31].item() == q[64 + 31, 2] | q[64 + 63, 2] << 4


@pytest.mark.parametrize("layout", [(64, True), (32, True), (32, False)])
def test_unpack_inverts_every_known_layout(layout: tuple[int, bool]) -> None:
    q = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    unpacked = dispatch._unpack_int4pack_t(_pack_by_layout(q, layout), 128, 64, layout)
    assert torch.equal(unpacked.T.int(), q)


# ---------------------------------------------------------------------------- embeddings


@pytest.mark.parametrize("fmt", QUANTIZABLE)
def test_embedding_equals_dequantized_rows_exactly(fmt: str) -> None:
    parts = quantize(_weight(56, 64), fmt)
    ids = torch.tensor([[3, 0, 55, 3], [1, 2, 7, 7]])
    emb = make_embedding(fmt, parts)
    out = emb(ids)
    assert out.dtype == torch.float32 and out.shape == (2, 4, 64)
    assert torch.equal(out, dequantize(parts, fmt)[ids])
    assert torch.equal(embed_rows(ids[0], parts, fmt), dequantize(parts, fmt)[ids[0]])


# ---------------------------------------------------------------------------- dispatch errors, registry


def test_unsupported_device_names_format_device_and_torch() -> None:
    with pytest.raises(KernelUnavailableError, match=rf"'q4'.*'cuda:0'.*{re.escape(torch.__version__)}"):
        dispatch.select_kernel("q4", torch.device("cuda:0"))
    with pytest.raises(KernelUnavailableError, match="meta"):
        make_linear("f32", quantize(torch.randn(4, 32), "f32"), device="meta")


def test_unknown_format_is_unsupported_quantization() -> None:
    with pytest.raises(UnsupportedQuantizationError, match=r"'q3'.*f32, f16, q8, q4"):
        dispatch.select_kernel("q3", "cpu")


def test_missing_torch_op_makes_kernel_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "_weight_int4pack_mm_for_cpu")
    monkeypatch.setattr(dispatch.native, "load_library", lambda: None)  # the torch-only path needs the op
    with pytest.raises(
        KernelUnavailableError,
        match=rf"'q4'.*'cpu'.*{re.escape(torch.__version__)}.*needs torch._weight_int4pack_mm_for_cpu",
    ):
        dispatch.select_kernel("q4", "cpu")


def test_registry_prefers_higher_priority(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(dispatch, "_REGISTRY", {k: list(v) for k, v in dispatch._REGISTRY.items()})
    native = dispatch.Kernel("native-q8", "q8", "cpu", dispatch._prepare_q8, dispatch._matmul_q8)
    dispatch.register_kernel(native, priority=20)
    assert dispatch.select_kernel("q8", "cpu") is native
    off = dataclasses.replace(native, name="native-off", requires=("_no_such_op",))
    dispatch.register_kernel(off, priority=30)
    assert dispatch.select_kernel("q8", "cpu") is native


# ---------------------------------------------------------------------------- resident memory


def resident_weight_bytes(module: torch.nn.Module) -> int:
    """What resident_bytes estimates, measured: bytes of weights ``module`` keeps resident (quantized layers'
    tensors plus parameters and buffers, each shared storage counted once, so tied weights are not double-counted)."""
    seen: dict[tuple[str, int], int] = {}

    def add(t: torch.Tensor) -> None:
        s = t.untyped_storage()
        seen[(str(t.device), s.data_ptr())] = s.nbytes()

    for m in module.modules():
        if isinstance(m, (QuantLinear, QuantEmbedding)):
            for t in m.resident_tensors():
                add(t)
    for t in list(module.parameters()) + list(module.buffers()):
        add(t)
    return sum(seen.values())


def test_resident_bytes_count_what_is_held() -> None:
    w = torch.randn(128, 64)
    q4 = make_linear("q4", quantize(w, "q4"), torch.zeros(128))
    # with native kernels: the portable blocks (mapped) + f32 bias, nothing else; torch-only: the packed
    # 4-bit weight + bf16 (scale, zero) per group + f32 bias
    if q4.kernel.name.startswith("cpu-native"):
        assert resident_weight_bytes(q4) == 128 * 2 * 20 + 128 * 4
    else:
        assert resident_weight_bytes(q4) == 128 * 32 + 2 * 128 * 2 * 2 + 128 * 4
    f16 = make_linear("f16", quantize(w, "f16"))
    assert resident_weight_bytes(f16) == 128 * 64 * 4  # upcast once at load
    # tied q8 embedding + lm_head share the int8 weight: counted once
    parts = quantize(w, "q8")
    tied = nn.ModuleDict({"embed": make_embedding("q8", parts), "lm_head": make_linear("q8", parts)})
    copy = 128 * 64 * 2 if tied["lm_head"].kernel.name == "cpu-q8-bf16" else 0  # torch-only: a bf16 copy
    assert resident_weight_bytes(tied) == 128 * 2 * 34 + copy  # the blocks, held by both


@pytest.mark.parametrize("fmt", QUANTIZABLE)
@pytest.mark.parametrize("shape", [(96, 64), (128, 576)])
def test_resident_bytes_estimate_matches_loaded_modules(fmt: str, shape: tuple[int, int]) -> None:
    parts = quantize(torch.randn(*shape), fmt)
    lin, emb = make_linear(fmt, parts), make_embedding(fmt, parts)
    assert resident_bytes(fmt, shape) == resident_weight_bytes(lin)
    assert resident_bytes(fmt, shape, embedding=True) == resident_weight_bytes(emb) == _nbytes(parts)
    tied = nn.ModuleList([emb, lin])
    extra = resident_bytes(fmt, shape, matmul_only=True)
    assert resident_weight_bytes(tied) == resident_weight_bytes(emb) + extra


def test_q8_kernel_accepts_misaligned_mapped_weights() -> None:
    """Weights memory-mapped from a shard can sit at any offset; torch's int8 kernel crashed on them."""
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    parts = quantize(w, "q8")
    buffer = torch.zeros(96 * 68 + 8, dtype=torch.uint8)
    buffer[8:] = parts["qweight"].flatten()
    misaligned = {**parts, "qweight": buffer[8:].view(12, 8 * 68)}
    assert misaligned["qweight"].data_ptr() % 16
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(6))
    y = make_linear("q8", misaligned)(x)
    assert torch.equal(y, make_linear("q8", parts)(x))
    ref = x.double() @ dequantize(parts, "q8").double().T
    assert ((y.double() - ref).norm() / ref.norm()).item() < 1e-2
