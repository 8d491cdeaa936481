"""The native library's C interface, declared once for ctypes: its constants, structs, functions and error strings.

Everything here mirrors ``csrc/edgellm_kernels.h`` (the matmuls, the thread pool, the CPU checks) and
``csrc/edgellm_decoder.h`` (the model description and the decoder); ``tests/kernels/test_abi.py`` compiles each declaration
against those headers and fails on any difference (a field's name, type or place, a constant's value, a parameter,
a function exported but not declared here). Fields and parameters are written as their C types, and ctypes' are
derived from them, so that the test can hand the compiler the very text declared here.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_char_p, c_float, c_int, c_int32, c_long, c_uint16, c_uint32, c_uint64, c_void_p
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, TypeVar

# ---------------------------------------------------------------------------- constants

QK = 32  # EL_QK: weights and activations are quantized in blocks of 32 along K
ROWS = 8  # EL_ROWS: rows per interleaved weight group
QK_K = 256  # EL_QK_K: weights per K-quant super-block

# Weight formats (EL_F32, EL_Q4, ...): el_matrix.fmt and the fmt argument of every matmul.
FORMATS: dict[str, int] = {"f32": 0, "q4": 4, "q8": 8, "q4_0": 40, "q5_0": 50, "q5_1": 51, "q2_k": 102, "q3_k": 103,
                           "q4_k": 104, "q5_k": 105, "q6_k": 106, "iq4_nl": 204}

# el_model_desc.flags: what a family does beyond Llama.
QK_NORM = 1 << 0  # EL_QK_NORM
SANDWICH_NORMS = 1 << 1  # EL_SANDWICH_NORMS
GELU_TANH = 1 << 2  # EL_GELU_TANH
EMBED_SCALE = 1 << 3  # EL_EMBED_SCALE
LOGIT_SOFTCAP = 1 << 4  # EL_LOGIT_SOFTCAP
ATTN_SOFTCAP = 1 << 5  # EL_ATTN_SOFTCAP
SUPPORTED_FLAGS = QK_NORM | SANDWICH_NORMS | GELU_TANH | EMBED_SCALE | LOGIT_SOFTCAP | ATTN_SOFTCAP

# What the decoder's functions return (el_strerror says each in words).
OK = 0  # EL_OK
ERR_POSITION = 1  # EL_ERR_POSITION
ERR_TOKEN = 2  # EL_ERR_TOKEN
ERR_MEMORY = 3  # EL_ERR_MEMORY
ERR_ROWS = 4  # EL_ERR_ROWS
ERR_CACHE = 5  # EL_ERR_CACHE
ERR_ORDER = 6  # EL_ERR_ORDER
ERR_UNAVAILABLE = -2  # EL_ERR_UNAVAILABLE
DESC_FLAGS = 11  # EL_DESC_FLAGS
DESC_SHAPE = 12  # EL_DESC_SHAPE
DESC_EMBED = 13  # EL_DESC_EMBED
DESC_LAYER = 14  # EL_DESC_LAYER
DESC_OPTION = 15  # EL_DESC_OPTION

# The batched step: rows per call at most, and el_kv_cache.kind.
BATCH_MAX_ROWS = 64  # EL_BATCH_MAX_ROWS
KV_F32, KV_F16, KV_Q8 = 0, 1, 2  # EL_KV_F32, EL_KV_F16, EL_KV_Q8

# Every constant above by its C name (what the test checks against the headers).
CONSTANTS: dict[str, int] = {
    "EL_QK": QK, "EL_ROWS": ROWS, "EL_QK_K": QK_K,
    **{f"EL_{name.upper()}": code for name, code in FORMATS.items()},
    "EL_QK_NORM": QK_NORM, "EL_SANDWICH_NORMS": SANDWICH_NORMS, "EL_GELU_TANH": GELU_TANH,
    "EL_EMBED_SCALE": EMBED_SCALE, "EL_LOGIT_SOFTCAP": LOGIT_SOFTCAP, "EL_ATTN_SOFTCAP": ATTN_SOFTCAP,
    "EL_SUPPORTED_FLAGS": SUPPORTED_FLAGS,
    "EL_OK": OK, "EL_ERR_POSITION": ERR_POSITION, "EL_ERR_TOKEN": ERR_TOKEN, "EL_ERR_MEMORY": ERR_MEMORY,
    "EL_ERR_UNAVAILABLE": ERR_UNAVAILABLE, "EL_DESC_FLAGS": DESC_FLAGS, "EL_DESC_SHAPE": DESC_SHAPE,
    "EL_DESC_EMBED": DESC_EMBED, "EL_DESC_LAYER": DESC_LAYER, "EL_DESC_OPTION": DESC_OPTION,
    "EL_ERR_ROWS": ERR_ROWS, "EL_ERR_CACHE": ERR_CACHE, "EL_ERR_ORDER": ERR_ORDER,
    "EL_BATCH_MAX_ROWS": BATCH_MAX_ROWS, "EL_KV_F32": KV_F32, "EL_KV_F16": KV_F16, "EL_KV_Q8": KV_Q8,
}

# ---------------------------------------------------------------------------- C types

_SCALARS: dict[str, type] = {
    "int": c_int, "long": c_long, "float": c_float, "int32_t": c_int32, "uint16_t": c_uint16,
    "uint32_t": c_uint32, "uint64_t": c_uint64, "const char *": c_char_p,
}


def _ctype(c: str) -> type:
    """The ctypes type of a C type as written here: a scalar, a struct declared below (or a pointer to one), or
    any other pointer as c_void_p."""
    if c in _SCALARS:
        return _SCALARS[c]
    base = c.removeprefix("const ").removesuffix("*").strip()
    if base in STRUCTS:
        return POINTER(STRUCTS[base]) if c.endswith("*") else STRUCTS[base]
    if c.endswith("*") or c == "el_task_fn":
        return c_void_p
    raise TypeError(f"no ctypes type for the C type {c!r}")


STRUCTS: dict[str, type[Structure]] = {}  # by C name


def _c_struct(c_name: str) -> Callable[[type[_S]], type[_S]]:
    """Class decorator: the ctypes Structure of the C struct ``c_name``, its ``_fields_`` from ``c_fields``
    ((field, C type) in order)."""

    def make(cls: type[_S]) -> type[_S]:
        cls._fields_ = [(name, _ctype(c)) for name, c in cls.c_fields]
        cls.c_name = c_name
        STRUCTS[c_name] = cls
        return cls

    return make


def _each(names: str, c: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, c) for name in names.split())


class CStruct(Structure):
    """A struct of the C interface: ``c_name`` and ``c_fields`` say it as C does."""

    c_name: ClassVar[str]
    c_fields: ClassVar[tuple[tuple[str, str], ...]]


_S = TypeVar("_S", bound=CStruct)


@_c_struct("el_matrix")
class Matrix(CStruct):
    """A weight: ``data`` in format ``fmt`` (FORMATS), ``n`` rows of ``k``."""

    c_fields = (("data", "const void *"), ("fmt", "int32_t"), ("n", "int32_t"), ("k", "int32_t"))


@_c_struct("el_layer_desc")
class LayerDesc(CStruct):
    """One layer of the model description."""

    c_fields = (*_each("attn_norm ffn_norm attn_out_norm ffn_out_norm", "const float *"),
                *_each("q k v o gate up down", "el_matrix"),
                *_each("q_bias k_bias v_bias q_norm k_norm rope_cos rope_sin", "const float *"),
                ("sliding_window", "int32_t"))


@_c_struct("el_model_desc")
class ModelDesc(CStruct):
    """The model description el_decoder_check and el_decoder_create read."""

    c_fields = (*_each("n_layers dim n_heads n_kv_heads head_dim ffn_dim vocab", "int32_t"),
                ("flags", "uint32_t"),
                *_each("eps attn_scale embed_scale logit_softcap attn_softcap", "float"),
                ("embed", "el_matrix"), ("lm_head", "el_matrix"), ("final_norm", "const float *"),
                ("rope_len", "int32_t"), ("layers", "const el_layer_desc *"))


@_c_struct("el_kv_cache")
class KVCacheDesc(CStruct):
    """One KV cache as el_batch_step reads it: its arrays, kind (KV_F32 ...) and capacity."""

    c_fields = (("keys", "void *"), ("values", "void *"), ("key_scales", "float *"), ("value_scales", "float *"),
                ("kind", "int32_t"), ("capacity", "int32_t"))


# ---------------------------------------------------------------------------- functions


@dataclass(frozen=True)
class Function:
    """One exported C function: its name, return type and parameter types, as C writes them."""

    name: str
    restype: str
    argtypes: tuple[str, ...]

    def c_declaration(self) -> str:
        return f"{self.restype} {self.name}({', '.join(self.argtypes) or 'void'});"


def _fn(name: str, restype: str, *argtypes: str) -> Function:
    return Function(name, restype, argtypes)


_GEMV = ("int", "const el_block_q8a *", "float *", "int", "int")
_GEMM = ("int", "const el_block_q8a *", "int", "float *", "int", "int", "int")
_MATMUL = ("el_pool *", "int", "const void *", "int", "int", "const float *", "int", "float *")
_STEP = ("el_decoder *", "int", "int")
_PREFILL = ("el_decoder *", "const int32_t *", "int", "int")

FUNCTIONS: tuple[Function, ...] = (
    # edgellm_kernels.h
    _fn("el_variant", "const char *"),
    _fn("el_quantize_act", "void", "const float *", "int", "el_block_q8a *"),
    _fn("el_gemv_q4", "void", "const el_block_q4x8 *", *_GEMV),
    _fn("el_gemv_q8", "void", "const el_block_q8x8 *", *_GEMV),
    _fn("el_gemm_fmt", "void", "int", "const void *", *_GEMM),
    _fn("el_gemm_q4", "void", "const el_block_q4x8 *", *_GEMM),
    _fn("el_gemm_q8", "void", "const el_block_q8x8 *", *_GEMM),
    _fn("el_linear", "int", *_MATMUL),
    _fn("el_half_to_float", "float", "uint16_t"),
    _fn("el_float_to_half", "uint16_t", "float"),
    _fn("el_block_row_f32", "void", "int", "const void *", "int", "float *"),
    _fn("el_dequant_bf16", "int", "el_pool *", "int", "const void *", "int", "int", "int", "uint16_t *"),
    _fn("el_gemm_bf16", "int", *_MATMUL),
    _fn("el_gemm_f32", "int", *_MATMUL),
    _fn("el_gemm_i8", "int", *_MATMUL),
    _fn("el_prefill_matmul", "const char *"),
    _fn("el_cpu_allows", "int", "const char *"),
    _fn("el_cpu_xcr0", "uint64_t"),
    _fn("el_cpu_splits_zmm", "int"),
    _fn("el_pool_create", "el_pool *", "int"),
    _fn("el_pool_create_spin", "el_pool *", "int", "long"),
    _fn("el_pool_run", "void", "el_pool *", "el_task_fn", "void *"),
    _fn("el_pool_threads", "int", "const el_pool *"),
    _fn("el_pool_destroy", "void", "el_pool *"),
    # edgellm_decoder.h
    _fn("el_strerror", "const char *", "int"),
    _fn("el_decoder_check", "int", "const el_model_desc *"),
    _fn("el_decoder_create", "el_decoder *", "const el_model_desc *", "el_pool *"),
    _fn("el_decoder_destroy", "void", "el_decoder *"),
    _fn("el_decoder_threads", "int", "const el_decoder *"),
    _fn("el_decoder_step", "int", *_STEP, "float *", "float *", "int", "float *"),
    _fn("el_decoder_step_f16", "int", *_STEP, "uint16_t *", "uint16_t *", "int", "float *"),
    _fn("el_decoder_step_q8", "int", *_STEP, "int8_t *", "int8_t *", "float *", "float *", "int", "float *"),
    _fn("el_decoder_prefill", "int", *_PREFILL, "float *", "float *", "int", "float *", "int"),
    _fn("el_decoder_prefill_f16", "int", *_PREFILL, "uint16_t *", "uint16_t *", "int", "float *", "int"),
    _fn("el_decoder_prefill_q8", "int", *_PREFILL, "int8_t *", "int8_t *", "float *", "float *", "int", "float *",
        "int"),
    _fn("el_kv_quantize", "void", "const float *", "int", "int8_t *", "float *"),
    _fn("el_batch_create", "el_batch *", "el_decoder *", "int"),
    _fn("el_batch_destroy", "void", "el_batch *"),
    _fn("el_batch_max_rows", "int", "const el_batch *"),
    _fn("el_batch_step", "int", "el_batch *", "int", "const int32_t *", "const int32_t *", "const int32_t *",
        "const el_kv_cache *", "int", "float *"),
)


def declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Set every function's ctypes signature on ``lib`` (a library of csrc/ as built by build.py); returns it."""
    for f in FUNCTIONS:
        fn = getattr(lib, f.name)
        fn.restype = None if f.restype == "void" else _ctype(f.restype)  # None: ctypes' void
        fn.argtypes = [_ctype(a) for a in f.argtypes]
    return lib


def strerror(lib: ctypes.CDLL, code: int) -> str:
    """The library's words for a return code of its decoder (el_strerror)."""
    return str(lib.el_strerror(code).decode())
