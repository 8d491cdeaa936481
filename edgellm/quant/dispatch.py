"""The one kernel-dispatch seam for quantized matmuls.

``select_kernel(fmt, device)`` returns the :class:`Kernel` registered for that weight format and
device type (first available one in priority order), or raises KernelUnavailableError naming the
format, device and torch version. A kernel has ``prepare(parts) -> state`` (one-time repack at load)
and ``matmul(x, state, bias=None)`` (float32 [..., K] -> new float32 [..., N]). Native kernels
register themselves with :func:`register_kernel` at a higher priority; nothing else changes.

CPU kernels (the measurements behind each choice are in docs/kernels.md, "Matmul dispatch"; rerun them with
``python -m edgellm.bench.matmul --alternatives`` or ``--variants``):

* ``f32``: ``F.linear``.
* ``f16``: upcast to float32 once at prepare (faster than upcasting per call at every M, and half GEMM is slow
  at M >= 64 and overflows past 65504). The price is a float32 resident copy (2x the f16 file size).
* ``q8`` (format 2: a scale per 32 weights, which ``_weight_int8pack_mm`` cannot apply): without
  native kernels the blocks are dequantized once to a resident bf16 copy (bf16 GEMM); under the
  native kernel, inputs above ``NATIVE_MAX_M`` rows dequantize slab by slab per call instead.
* ``q4``: ``torch._weight_int4pack_mm_for_cpu`` with bf16 activations and bf16 scales_and_zeros
  (``zero = min + 8 * scale``); N padded to a multiple of 64 at prepare. For M >=
  ``Q4_DENSE_MIN_M`` the packed weight (layout probed once per process) is unpacked to bf16, slab
  by slab, for a bf16 GEMM: int4pack re-dequantizes the weight for every 4 rows.
* Dense-path slabs hold <= 2M weights (4 MB bf16), which is faster than one large temporary.

Native kernels (``edgellm.kernels``, registered at priority 10 when a library loads) use the mapped
format-3 blocks as they are: ``prepare`` holds nothing else. Inputs of at most ``NATIVE_MAX_M`` rows
(decode steps) take the int8 GEMM (``el_linear``: activations quantized per block of 32, integer dot
products); longer ones (prefill) keep float activations, rounded to bf16 (int8 ones cost accuracy on
models with activation outliers, docs/kernels.md): where the CPU has AVX512-BF16, the library's
``el_gemm_bf16`` (weights dequantized 32 rows at a time in cache, float32 sums, and no bf16 rounding of the
output, which torch's GEMM does) — on more than one thread only while torch's OpenMP threads wait passively
(edgellm/openmp.py); otherwise bf16 slabs written by ``el_dequant_bf16`` and torch's bf16 GEMM (int4pack is the
torch-only path, used without a native library).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from edgellm import openmp
from edgellm.errors import KernelUnavailableError
from edgellm.kernels import native
from edgellm.quant.formats import (BLOCK_BYTES, BLOCK_WEIGHTS, EL_FORMAT_CODES, Q4_GROUP, ROW_GROUP, SOURCE_ONLY, Parts,
                                   check_format, dequant_rows, q4_fields, q8_fields, row_blocks,
                                   weight_shape)

# At and above this row count the dequantize-to-bf16 + GEMM path wins over the packed kernel (docs/kernels.md,
# "Matmul dispatch").
Q4_DENSE_MIN_M = 96

_BF16 = torch.bfloat16
_PACK_ROWS = 4096  # rows packed per call: bounds the int32 temporary int4pack needs
_SLAB_WEIGHTS = 1 << 21  # dense path dequantizes <= 2M weights (4 MB bf16) at a time: stays in cache


@dataclass(frozen=True)
class Kernel:
    """A matmul implementation for one weight format on one device type."""

    name: str
    fmt: str
    device_type: str
    prepare: Callable[[Parts], Any]
    matmul: Callable[..., Tensor]  # (x, state, bias=None) -> float32 [..., N], a fresh tensor
    requires: tuple[str, ...] = ()  # torch attributes (private ops) the kernel calls
    available: Callable[[], bool] = lambda: True  # any further runtime check (e.g. a native lib)
    description: str = ""
    # (N, K) -> (bytes the prepared state holds, bytes of it shared with the portable parts);
    # lets the engine estimate memory before loading anything.
    state_bytes: Callable[[int, int], tuple[int, int]] | None = None

    def missing(self) -> list[str]:
        """Why this kernel cannot run here (empty when it can)."""
        out = [f"torch.{r}" for r in self.requires if not hasattr(torch, r)]
        return out if out or self.available() else ["its availability check failed"]


_REGISTRY: dict[tuple[str, str], list[tuple[int, Kernel]]] = {}


def register_kernel(kernel: Kernel, priority: int = 0) -> None:
    """Add ``kernel``; among available kernels for a (format, device type) the highest priority wins."""
    check_format(kernel.fmt)
    entries = _REGISTRY.setdefault((kernel.fmt, kernel.device_type), [])
    entries[:] = [e for e in entries if e[1].name != kernel.name]
    entries.append((priority, kernel))
    entries.sort(key=lambda e: -e[0])


def registered_kernels() -> list[Kernel]:
    """Every registered kernel, available or not."""
    return [k for entries in _REGISTRY.values() for _, k in entries]


def select_kernel(fmt: str, device: torch.device | str = "cpu") -> Kernel:
    """The kernel for weights in ``fmt`` on ``device``.

    Raises UnsupportedQuantizationError for an unknown format and KernelUnavailableError when no
    registered kernel supports this (format, device, torch version).
    """
    check_format(fmt)
    device = torch.device(device)
    why = []
    for _, kernel in _REGISTRY.get((fmt, device.type), []):
        if not (missing := kernel.missing()):
            return kernel
        why.append(f"{kernel.name} needs {', '.join(missing)}")
    have = sorted({f"{k.fmt}/{k.device_type}" for k in registered_kernels() if not k.missing()})
    raise KernelUnavailableError(
        f"no matmul kernel for format {fmt!r} on device {str(device)!r} with torch {torch.__version__}"
        + (f" ({'; '.join(why)})" if why else "")
        + f"; available: {', '.join(have) or 'none'}"
    )


def state_tensors(state: Any) -> list[Tensor]:
    """The tensors a prepared state holds, including those of nested states (for memory accounting)."""
    out: list[Tensor] = []
    for f in dataclasses.fields(state):
        v = getattr(state, f.name)
        if isinstance(v, Tensor):
            out.append(v)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out += state_tensors(v)
    return out


def _bf16_rows(x: Tensor, k: int) -> Tensor:
    """x [..., K] as a contiguous bf16 [M, K] (the packed kernels need contiguous rows)."""
    if x.shape[-1] != k:
        raise ValueError(f"matmul input has last dim {x.shape[-1]}, weight expects K={k}")
    return x.reshape(-1, k).to(_BF16, memory_format=torch.contiguous_format)


# ---------------------------------------------------------------------------- dense f32 / f16


@dataclass(frozen=True, slots=True)
class DenseState:
    weight: Tensor  # float32 [N, K]


def _prepare_dense(parts: Parts) -> DenseState:
    w = parts["weight"]
    weight_shape("f32" if w.dtype == torch.float32 else "f16", parts)
    return DenseState(w.to(torch.float32).contiguous())


def _matmul_dense(x: Tensor, state: DenseState, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, state.weight, bias)


# ---------------------------------------------------------------------------- q8 / q4


def _slabs(n: int, k: int, align: int) -> tuple[tuple[int, int], ...]:
    """Row ranges of <= _SLAB_WEIGHTS weights (multiples of ``align`` rows) for the dense path."""
    rows = max(align, _SLAB_WEIGHTS // max(k, 1) // align * align)
    return tuple((a, min(a + rows, n)) for a in range(0, n, rows))


def _dense_mm(x2: Tensor, st: Int8State | Int4State | NativeState, dense_t: Callable[[Any, int, int], Tensor]
              ) -> Tensor:
    """bf16 x2 @ W.T, with W dequantized to bf16 one slab of rows at a time."""
    if len(st.slabs) == 1:
        return torch.mm(x2, dense_t(st, *st.slabs[0]))
    return torch.cat([torch.mm(x2, dense_t(st, a, b)) for a, b in st.slabs], dim=1)


@dataclass(frozen=True, slots=True)
class Int8State:
    qweight: Tensor  # uint8 el_block_q8x8 groups [N/8, K/32 * 272], the portable (mapped) tensor itself
    n: int
    k: int
    slabs: tuple[tuple[int, int], ...]
    dense: Tensor | None = None  # bf16 [N, K], when held resident (the torch-only path)


def _prepare_q8(parts: Parts) -> Int8State:
    """Dequantize per call (prefill under the native kernel: the cost is shared by many rows)."""
    n, k = weight_shape("q8", parts)
    return Int8State(parts["qweight"].contiguous(), n, k, _slabs(n, k, ROW_GROUP))


def _prepare_q8_resident(parts: Parts) -> Int8State:
    """Dequantize once to a resident bf16 copy (torch has no kernel for int8 with group scales)."""
    st = _prepare_q8(parts)
    dense = torch.cat([_dense_q8_t(st, a, b).t() for a, b in st.slabs]) if st.n else torch.empty(0, st.k, dtype=_BF16)
    return dataclasses.replace(st, dense=dense)


def _dense_q8_t(st: Int8State, a: int, b: int) -> Tensor:
    scales, q = q8_fields(row_blocks(st.qweight, "q8", a, b))
    # bf16 * bf16 in place: 25x faster than a mixed-dtype multiply into a bf16 output
    return q.to(_BF16).mul_(scales.to(_BF16).unsqueeze(-1)).view(b - a, st.k).t()


def _matmul_q8(x: Tensor, st: Int8State, bias: Tensor | None = None) -> Tensor:
    x2 = _bf16_rows(x, st.k)
    y = (torch.mm(x2, st.dense.t()) if st.dense is not None else _dense_mm(x2, st, _dense_q8_t)).float()
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], st.n)


@functools.cache
def int4pack_layout() -> tuple[int, bool] | None:
    """How this torch/CPU lays out ``_convert_weight_to_int4pack_for_cpu``, found by a probe.

    Returns ``(block_rows, split)``: rows are packed in blocks of ``block_rows``, as
    [K, block_rows/2] bytes per block, where byte j holds rows (j, j + block_rows/2) if ``split``
    else rows (2j, 2j + 1), low nibble first. ``None`` if no known layout matches.
    """
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (128, 64), generator=gen, dtype=torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 2)
    for layout in ((64, True), (32, True), (32, False)):
        if torch.equal(_unpack_int4pack_t(packed, 128, 64, layout).T.int(), q):
            return layout
    return None


def _unpack_int4pack_t(
    packed: Tensor, n: int, k: int, layout: tuple[int, bool], dtype: torch.dtype = torch.uint8
) -> Tensor:
    """The 0..15 values of a packed [n, k] weight, transposed: contiguous [k, n] of ``dtype``."""
    rows, split = layout
    blk = packed.view(n // rows, k, rows // 2).permute(1, 0, 2)  # [k, blocks, rows/2]
    out = torch.empty(k, n // rows, 2, rows // 2, dtype=dtype)  # split: [.., lo/hi, j]
    dst = out if split else out.view(k, n // rows, rows // 2, 2).transpose(2, 3)  # pairs: [.., j, lo/hi]
    dst[:, :, 0].copy_(blk & 15)
    dst[:, :, 1].copy_(blk >> 4)
    return out.view(k, n)


@dataclass(frozen=True, slots=True)
class Int4State:
    packed: Tensor  # uint8 int4pack layout of the [n_pad, K] weight
    scales_and_zeros: Tensor  # bf16 [K/32, n_pad, 2]: scale, min + 8 * scale
    n: int
    k: int
    dense_min_m: int  # sys.maxsize when the pack layout is unknown
    layout: tuple[int, bool] | None
    slabs: tuple[tuple[int, int], ...]  # over n_pad, multiples of 64 rows


def _prepare_q4(parts: Parts) -> Int4State:
    n, k = weight_shape("q4", parts)
    n_pad = -(-n // 64) * 64
    qweight = parts["qweight"]
    packed = torch.empty(n_pad, k // 2, dtype=torch.uint8)
    sz = torch.zeros(k // Q4_GROUP, n_pad, 2, dtype=_BF16)
    for a in range(0, n_pad, _PACK_ROWS):  # 64-row blocks pack independently: chunking is exact
        b = min(a + _PACK_ROWS, n_pad)
        scales, mins, q = q4_fields(row_blocks(qweight, "q4", a, b))
        rows = q.view(q.shape[0], k).to(torch.int32)
        rows = F.pad(rows, (0, 0, 0, b - a - rows.shape[0]), value=8)  # pad rows: q=8, scale=zero=0
        packed[a:b] = torch._convert_weight_to_int4pack_for_cpu(rows, 2)
        sz[:, a : a + q.shape[0], 0] = scales.t()
        sz[:, a : a + q.shape[0], 1] = (mins.float() + 8.0 * scales.float()).t()
    layout = int4pack_layout()
    dense_min_m = Q4_DENSE_MIN_M if layout is not None else sys.maxsize
    return Int4State(packed, sz, n, k, dense_min_m, layout, _slabs(n_pad, k, 64))


def _dense_q4_t(st: Int4State, a: int, b: int) -> Tensor:
    """Rows a:b of the weight as bf16 [K, b - a] (transposed), dequantized from the packed layout."""
    assert st.layout is not None
    w = _unpack_int4pack_t(st.packed[a:b], b - a, st.k, st.layout, _BF16)
    w = w.view(st.k // Q4_GROUP, Q4_GROUP, b - a)
    sz = st.scales_and_zeros[:, a:b].unsqueeze(1).float()
    scale, mins = sz[..., 0], (sz[..., 1] - 8.0 * sz[..., 0]).to(_BF16)
    # In place, w = q * scale + min; operands must be contiguous (a strided one is 8x slower).
    return torch.addcmul(mins, w, scale.to(_BF16), out=w).view(st.k, b - a)


def _matmul_q4(x: Tensor, st: Int4State, bias: Tensor | None = None) -> Tensor:
    x2 = _bf16_rows(x, st.k)
    if x2.shape[0] >= st.dense_min_m:
        y = _dense_mm(x2, st, _dense_q4_t)
    else:
        y = torch._weight_int4pack_mm_for_cpu(x2, st.packed, Q4_GROUP, st.scales_and_zeros)
    y = y[:, : st.n].float()
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], st.n)


def _q4_state_bytes(n: int, k: int) -> tuple[int, int]:
    n_pad = -(-n // 64) * 64
    return n_pad * k // 2 + (k // Q4_GROUP) * n_pad * 2 * 2, 0


register_kernel(
    Kernel("cpu-f32", "f32", "cpu", _prepare_dense, _matmul_dense, description="F.linear",
           state_bytes=lambda n, k: (4 * n * k, 4 * n * k))
)
register_kernel(
    Kernel("cpu-f16-upcast", "f16", "cpu", _prepare_dense, _matmul_dense,
           description="f16 weight upcast to f32 at load, F.linear", state_bytes=lambda n, k: (4 * n * k, 0))
)
_Q8_PER_CALL = Kernel(
    "cpu-q8-dense-bf16", "q8", "cpu", _prepare_q8, _matmul_q8,
    description="q8 blocks dequantized to bf16 per call, slab by slab, bf16 GEMM",
    state_bytes=lambda n, k: (n * k // Q4_GROUP * BLOCK_BYTES["q8"],) * 2,
)
register_kernel(
    Kernel("cpu-q8-bf16", "q8", "cpu", _prepare_q8_resident, _matmul_q8,
           description="q8 blocks dequantized once to a resident bf16 copy, bf16 GEMM",
           state_bytes=lambda n, k: (n * k // Q4_GROUP * BLOCK_BYTES["q8"] + 2 * n * k, n * k // Q4_GROUP * BLOCK_BYTES["q8"]))
)
register_kernel(
    Kernel("cpu-int4pack-bf16", "q4", "cpu", _prepare_q4, _matmul_q4,
           ("_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu"),
           description=f"int4pack_mm on bf16 activations; bf16 GEMM for M >= {Q4_DENSE_MIN_M}",
           state_bytes=_q4_state_bytes)
)


# ---------------------------------------------------------------------------- native q4 / q8


@dataclass(frozen=True, slots=True)
class NativeState:
    qweight: Tensor  # 8-row groups of a block format: the portable (mapped) tensor, never copied
    fmt: str  # "q4", "q8" or a GGUF block format (layout.SOURCE_ONLY)
    n: int
    k: int
    max_m: int  # larger inputs (prefill) dequantize slab by slab to bf16 for a bf16 GEMM
    slabs: tuple[tuple[int, int], ...]  # multiples of 8 rows


def _native_kernel(fmt: str, max_m: int) -> Kernel:
    """The native GEMM for ``fmt`` for inputs of up to ``max_m`` rows; longer inputs dequantize the
    mapped blocks slab by slab to bf16 for torch's bf16 GEMM. Nothing is repacked or held at load."""

    def prepare(parts: Parts) -> NativeState:
        n, k = weight_shape(fmt, parts)
        return NativeState(parts["qweight"].contiguous(), fmt, n, k, max_m, _slabs(n, k, ROW_GROUP))

    def state_bytes(n: int, k: int) -> tuple[int, int]:
        blocks = n * k // BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt]
        return blocks, blocks

    return Kernel(
        f"cpu-native-{fmt}", fmt, "cpu", prepare, _matmul_native,
        available=lambda: native.load_library() is not None,
        description=f"native {fmt} GEMM (edgellm.kernels) for M <= {max_m}; else bf16 slabs dequantized per call",
        state_bytes=state_bytes,
    )


def _library() -> ctypes.CDLL:
    """The loaded kernel library (these kernels are registered only where it loads)."""
    lib = native.load_library()
    if lib is None:
        raise KernelUnavailableError(f"no native kernel library: {native.active_kernel()[1]}")
    return lib


def _dense_native_t(st: NativeState, a: int, b: int) -> Tensor:
    """Rows a:b of the weight as bf16 [K, b - a] (a transposed view), dequantized by the native library."""
    w = torch.empty(b - a, st.k, dtype=_BF16)
    lib = _library()
    # on the calling thread: the pool's workers spinning next to torch's GEMM threads cost more (prefill
    # at 2 threads 1020 vs 1490 tok/s, SmolLM2) than this serial ~4% of prefill
    if lib.el_dequant_bf16(None, EL_FORMAT_CODES[st.fmt], st.qweight.data_ptr(), st.k, a, b, w.data_ptr()):
        raise ValueError(f"native {st.fmt} dequantization refused rows {a}:{b} of a [{st.n}, {st.k}] weight")
    return w.t()


def _takes_gemm_bf16(threads: int) -> bool:
    """Whether prefill on `threads` threads multiplies with the library's bf16 GEMM: where the CPU has AVX512-BF16,
    and on more than one thread only while torch's OpenMP threads wait passively (edgellm/openmp.py) — spinning,
    they fight the GEMM's pool for the cores (SmolLM2 prefill, 2 threads: 1347 vs 1505 tok/s through torch's)."""
    return native.has_gemm_bf16() and (threads == 1 or openmp.PASSIVE)


def prefill_matmul() -> str:
    """In words, the GEMM prefill's quantized matmuls take (for `edgellm info`)."""
    if native.load_library() is None:
        return "torch's kernels (torch path)"
    slabs = "torch's bf16 GEMM on slabs the library dequantizes"
    if not _takes_gemm_bf16(1):
        return slabs
    if _takes_gemm_bf16(2):
        return "native bf16 GEMM (AVX512-BF16)"
    return f"native bf16 GEMM (AVX512-BF16) on 1 thread; {slabs} on more (torch's OpenMP threads spin)"


def _gemm_bf16(x2: Tensor, st: NativeState) -> Tensor:
    """x2 @ W.T by the library's bf16 GEMM: weights dequantized tile by tile in cache, bf16 products summed in
    float32 (torch's bf16 GEMM rounds its output to bf16)."""
    threads = torch.get_num_threads()
    x2 = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], st.n, dtype=torch.float32)
    if _library().el_gemm_bf16(native.pool(threads, spin_us=0), EL_FORMAT_CODES[st.fmt], st.qweight.data_ptr(),
                                          st.n, st.k, x2.data_ptr(), x2.shape[0], y.data_ptr()):
        raise MemoryError(f"native {st.fmt} bf16 GEMM could not allocate its buffers")
    return y


def _matmul_native(x: Tensor, st: NativeState, bias: Tensor | None = None) -> Tensor:
    if x.shape[-1] != st.k:
        raise ValueError(f"matmul input has last dim {x.shape[-1]}, weight expects K={st.k}")
    x2 = x.reshape(-1, st.k)
    m = x2.shape[0]
    if m > st.max_m:
        if _takes_gemm_bf16(torch.get_num_threads()):
            y = _gemm_bf16(x2, st)
        else:
            y = _dense_mm(_bf16_rows(x, st.k), st, _dense_native_t).float()
    else:
        x2 = x2.to(torch.float32).contiguous()
        y = torch.empty(m, st.n, dtype=torch.float32)
        lib = _library()
        pool = native.pool(torch.get_num_threads())
        if m and lib.el_linear(pool, EL_FORMAT_CODES[st.fmt], st.qweight.data_ptr(), st.n, st.k, x2.data_ptr(), m,
                               y.data_ptr()):
            raise MemoryError(f"native {st.fmt} matmul could not allocate its activation buffer")
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], st.n)


# Largest input row count the native GEMM takes; above it, bf16 slabs and torch's GEMM are faster (docs/kernels.md,
# "Matmul dispatch": ``python -m edgellm.bench.matmul --variants --shape M,K,N``).
NATIVE_MAX_M = dict.fromkeys(EL_FORMAT_CODES, 2)
for _fmt in NATIVE_MAX_M:
    register_kernel(_native_kernel(_fmt, NATIVE_MAX_M[_fmt]), priority=10)


# ---------------------------------------------------------------------------- the GGUF blocks without the library


def _prepare_source_blocks(fmt: str) -> Callable[[Parts], NativeState]:
    def prepare(parts: Parts) -> NativeState:
        n, k = weight_shape(fmt, parts)
        return NativeState(parts["qweight"].contiguous(), fmt, n, k, 0, _slabs(n, k, ROW_GROUP))
    return prepare


def _dense_source_t(st: NativeState, a: int, b: int) -> Tensor:
    """Rows a:b as bf16 [K, b - a] (a transposed view), dequantized exactly by quant.formats, then rounded."""
    return dequant_rows(row_blocks(st.qweight, st.fmt, a, b), st.fmt).to(_BF16).t()


def _matmul_source_blocks(x: Tensor, st: NativeState, bias: Tensor | None = None) -> Tensor:
    y = _dense_mm(_bf16_rows(x, st.k), st, _dense_source_t).float()
    if bias is not None:
        y.add_(bias)
    return y.view(*x.shape[:-1], st.n)


def _source_state_bytes(fmt: str) -> Callable[[int, int], tuple[int, int]]:
    """The blocks as stored, shared with the portable parts."""
    return lambda n, k: (n * k // BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt],) * 2


for _fmt in SOURCE_ONLY:  # torch's path where no native library is built: the blocks dequantized slab by slab
    register_kernel(Kernel(
        f"cpu-{_fmt}-dense-bf16", _fmt, "cpu", _prepare_source_blocks(_fmt), _matmul_source_blocks,
        description=f"{_fmt} blocks dequantized to bf16 per call, slab by slab, bf16 GEMM",
        state_bytes=_source_state_bytes(_fmt)))
