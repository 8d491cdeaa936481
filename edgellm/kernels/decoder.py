"""The native decode step: one call into the kernel library runs every layer for one token.

:func:`attach_native_decoder` decides, once at load, whether single-token steps of a
:class:`~edgellm.models.llama.Transformer` go native; the model then calls :meth:`NativeDecoder.step`
for every (1, 1) step whose KV cache the native code can use (float32, or the 8-bit "q8" kind, which
it reads and writes in place). Prefill keeps torch's paths.

The description handed to C (``el_model_desc`` in ``csrc/decode.c``, mirrored here with ctypes)
points into the artifact's memory-mapped weight tensors; this object keeps them alive.
Supported: Llama, Qwen2, Qwen3, Gemma 2 and Gemma 3 with q4/q8 matmul weights (K a multiple of 32), attention in
float32. What a family does beyond Llama is a flag of the description (``FLAG_*``, ``EL_*`` in C); the
norm weights handed over are the torch modules' own, Gemma's 1 + w offset folded in. Sliding-window
layers read the same full-history cache torch's path writes, from the window's first position on.
f32/f16 weights (q0f32, q0f16) keep torch's path: their decode is bandwidth-bound on 4/2 bytes per
weight either way, and torch's GEMV already streams them at memory speed.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, Structure, c_float, c_int, c_int32, c_uint32, c_void_p
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from edgellm.kernels import native
from edgellm.quant.formats import FORMAT_SUFFIXES, weight_shape

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.models.kv_cache import KVCache
    from edgellm.models.transformer import DecoderLayer, Transformer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")
# el_model_desc.flags (csrc/decode.c)
FLAG_QK_NORM, FLAG_SANDWICH_NORMS, FLAG_GELU_TANH, FLAG_EMBED_SCALE, FLAG_LOGIT_SOFTCAP, FLAG_ATTN_SOFTCAP = (
    1 << i for i in range(6))
EL_FORMATS = {"f32": 0, "q4": 4, "q8": 8}  # EL_F32, EL_Q4, EL_Q8: embedding rows; matmuls take q4/q8
_ERRORS = {1: "position outside the KV cache / RoPE table", 2: "token id outside the vocabulary",
           3: "out of memory growing the attention scores"}


class _Matrix(Structure):
    _fields_ = [("data", c_void_p), ("fmt", c_int32), ("n", c_int32), ("k", c_int32)]


class _Layer(Structure):
    _fields_ = [*[(name, c_void_p) for name in ("attn_norm", "ffn_norm", "attn_out_norm", "ffn_out_norm")],
                *[(name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")],
                *[(name, c_void_p) for name in ("q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "rope_cos",
                                                "rope_sin")],
                ("sliding_window", c_int32)]


class _Model(Structure):
    _fields_ = [*[(name, c_int32) for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim",
                                               "ffn_dim", "vocab")],
                ("flags", c_uint32), *[(name, c_float) for name in ("eps", "attn_scale", "embed_scale",
                                                                      "logit_softcap", "attn_softcap")],
                ("embed", _Matrix), ("lm_head", _Matrix), ("final_norm", c_void_p), ("rope_len", c_int32),
                ("layers", POINTER(_Layer))]


def _declare(lib: ctypes.CDLL) -> None:
    lib.el_decoder_check.argtypes = [POINTER(_Model)]
    lib.el_decoder_check.restype = c_int
    lib.el_decoder_create.argtypes = [POINTER(_Model), c_void_p]
    lib.el_decoder_create.restype = c_void_p
    lib.el_decoder_step.argtypes = [c_void_p, c_int, c_int, c_void_p, c_void_p, c_int, c_void_p]
    lib.el_decoder_step.restype = c_int
    lib.el_decoder_step_f16.argtypes = [c_void_p, c_int, c_int, c_void_p, c_void_p, c_int, c_void_p]
    lib.el_decoder_step_f16.restype = c_int
    lib.el_decoder_step_q8.argtypes = [c_void_p, c_int, c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_void_p]
    lib.el_decoder_step_q8.restype = c_int
    lib.el_kv_quantize.argtypes = [c_void_p, c_int, c_void_p, c_void_p]
    lib.el_kv_quantize.restype = None
    lib.el_decoder_threads.argtypes = [c_void_p]
    lib.el_decoder_threads.restype = c_int
    lib.el_decoder_destroy.argtypes = [c_void_p]
    lib.el_decoder_destroy.restype = None


class _Description:
    """The C description of a model and every tensor it points into (kept alive with it)."""

    def __init__(self) -> None:
        self.tensors: list[Tensor] = []
        self.streamed: list[Tensor] = []  # the matmul weights, read whole on every step

    def ptr(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach()
        if t.dtype != torch.float32 or not t.is_contiguous():
            t = t.float().contiguous()
        self.tensors.append(t)
        return t.data_ptr()

    def matrix(self, weights: dict[str, Tensor], prefix: str, fmt: str, streamed: bool = True) -> _Matrix:
        """The weight at `prefix` as the kernels read it: the artifact's own rows, not a copy (`streamed`:
        read whole on every step, unlike the embedding's rows)."""
        parts = {s: weights[f"{prefix}.{s}"] for s in FORMAT_SUFFIXES[fmt]}
        n, k = weight_shape(fmt, parts)
        rows = parts["weight" if fmt == "f32" else "qweight"].contiguous()
        self.tensors.append(rows)
        if streamed:
            self.streamed.append(rows)
        return _Matrix(rows.data_ptr(), EL_FORMATS[fmt], n, k)


# What each KV cache kind hands the native step: its tensors' dtypes, and the step function that reads them.
_CACHE_DTYPES = {"f32": (torch.float32, torch.float32), "f16": (torch.float16, torch.float16),
                 "q8": (torch.int8, torch.int8, torch.float32, torch.float32)}
_STEP_FUNCTIONS = {"f32": "el_decoder_step", "f16": "el_decoder_step_f16", "q8": "el_decoder_step_q8"}


def _cache_tensors(cache: KVCache) -> list[Tensor | None]:
    """Keys and values, and for q8 their scales, in the order the step function takes them."""
    return [cache.keys, cache.values, *((cache.key_scales, cache.value_scales) if cache.kind == "q8" else ())]


def unsupported_reason(config: ArtifactConfig, kv_dtype: torch.dtype) -> str | None:
    """Why this model cannot decode natively (None when it can), from its config alone."""
    m = config.model
    formats = config.quantization.formats
    if m.architecture not in SUPPORTED_ARCHITECTURES:
        return f"architecture {m.architecture} has no native decode yet"
    if m.rope_scaling and (m.rope_scaling.get("rope_type") or m.rope_scaling.get("type")) == "longrope":
        return "LongRoPE switches tables by position; the native step reads one table"
    if kv_dtype != torch.float32:
        return f"the native decode step attends in float32, not {kv_dtype}"
    bad = sorted({f for name, f in formats.items() if f not in ("q4", "q8") and name != "model.embed_tokens"})
    if bad:
        return f"weight format {', '.join(bad)}: native decode takes q4/q8"
    if formats["model.embed_tokens"] not in EL_FORMATS:
        return f"embedding format {formats['model.embed_tokens']} has no native row lookup"
    dims = {"hidden size": m.hidden_size, "intermediate size": m.intermediate_size,
            "attention width": m.num_attention_heads * m.head_dim}
    odd = [f"{k} {v}" for k, v in dims.items() if v % 32]
    if odd:
        return f"{', '.join(odd)} not a multiple of 32"
    if m.head_dim % 8 or m.head_dim > 512:
        return f"head dim {m.head_dim} not a multiple of 8 up to 512"
    if m.num_attention_heads > 64 * m.num_key_value_heads:
        return "more than 64 query heads per KV head"
    return None


class NativeDecoder:
    """A native decoder bound to one model's weights and its own thread pool."""

    def __init__(self, lib: ctypes.CDLL, model: Transformer, weights: dict[str, Tensor], formats: dict[str, str],
                 pool: int | None) -> None:
        _declare(lib)
        cfg = model.config
        desc = _Description()
        layers = (_Layer * cfg.num_hidden_layers)()
        for i, layer in enumerate(model.layers):
            layers[i] = self._layer(desc, model, layer, weights, formats)
        first = model.layers[0]
        flags = (FLAG_QK_NORM * (first.attn.q_norm is not None)
                 | FLAG_SANDWICH_NORMS * (first.attn_out_norm is not None)
                 | FLAG_GELU_TANH * (cfg.hidden_act == "gelu_tanh")
                 | FLAG_EMBED_SCALE * (model.embed_scale is not None)
                 | FLAG_LOGIT_SOFTCAP * (cfg.final_logit_softcapping is not None)
                 | FLAG_ATTN_SOFTCAP * (cfg.attn_logit_softcapping is not None))
        embed_fmt = formats["model.embed_tokens"]
        head = ("model.embed_tokens", embed_fmt) if cfg.tie_word_embeddings else ("lm_head", formats["lm_head"])
        self._model = _Model(
            n_layers=cfg.num_hidden_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, ffn_dim=cfg.intermediate_size,
            vocab=cfg.vocab_size, flags=flags, eps=cfg.rms_norm_eps, attn_scale=first.attn.scale,
            embed_scale=model.embed_scale or 1.0, logit_softcap=cfg.final_logit_softcapping or 0.0,
            attn_softcap=cfg.attn_logit_softcapping or 0.0,
            embed=desc.matrix(weights, "model.embed_tokens", embed_fmt, streamed=False),
            lm_head=desc.matrix(weights, *head),
            final_norm=desc.ptr(model.norm.weight), rope_len=model.rope.length, layers=layers)
        self._desc = desc  # the tensors the description points into
        if code := lib.el_decoder_check(ctypes.byref(self._model)):
            raise ValueError(f"the native decoder refused this model description (code {code})")
        handle = lib.el_decoder_create(ctypes.byref(self._model), pool)
        if not handle:
            raise MemoryError("could not allocate the native decoder's scratch buffers")
        self._lib, self._handle = lib, handle
        self.vocab = cfg.vocab_size
        self.threads = lib.el_decoder_threads(handle)

    @staticmethod
    def _layer(desc: _Description, model: Transformer, layer: DecoderLayer, weights: dict[str, Tensor],
               formats: dict[str, str]) -> _Layer:
        """One layer's description: its matmul weights, the norm weights of its torch modules, its RoPE
        tables (the sliding layers' own where the model has them) and its window."""
        p = f"model.layers.{layer.index}"
        mats = {n: desc.matrix(weights, f"{p}.self_attn.{n}_proj", formats[f"{p}.self_attn.{n}_proj"]) for n in "qkvo"}
        mats |= {n: desc.matrix(weights, f"{p}.mlp.{n}_proj", formats[f"{p}.mlp.{n}_proj"])
                 for n in ("gate", "up", "down")}
        vectors = {f"{n}_bias": weights.get(f"{p}.self_attn.{n}_proj.bias") for n in "qkv"}
        norms = {"attn_norm": layer.input_norm, "ffn_norm": layer.post_norm, "attn_out_norm": layer.attn_out_norm,
                 "ffn_out_norm": layer.mlp_out_norm, "q_norm": layer.attn.q_norm, "k_norm": layer.attn.k_norm}
        vectors |= {name: None if norm is None else norm.weight for name, norm in norms.items()}
        rope = model.local_rope if layer.sliding and model.local_rope is not None else model.rope
        return _Layer(**mats, **{name: desc.ptr(t) for name, t in vectors.items()}, rope_cos=desc.ptr(rope.short_cos),
                      rope_sin=desc.ptr(rope.short_sin), sliding_window=layer.attn.window or 0)

    @property
    def streamed_weights(self) -> list[Tensor]:
        """The weights every step reads whole (matmuls and the LM head): worth huge pages (artifact/huge_pages.py)."""
        return self._desc.streamed

    def accepts(self, cache: KVCache) -> bool:
        """Whether `cache` is one the native step reads and writes: batch 1, contiguous, float32 keys/values,
        the f16 kind (half keys/values) or the q8 kind (int8 keys/values, float32 scales), attending in float32."""
        if cache.kind != "f32" and cache.dtype != torch.float32:
            return False
        tensors = _cache_tensors(cache)
        return (cache.keys.dim() == 5 and cache.keys.shape[1] == 1
                and all(t is not None and t.dtype == d and t.is_contiguous()
                        for t, d in zip(tensors, _CACHE_DTYPES[cache.kind], strict=True)))

    def step(self, token: int, pos: int, cache: KVCache) -> Tensor:
        """Logits (1, 1, V) after `token` at `pos`; its keys/values are written into `cache` (for f16: rounded
        as torch's .half(), for q8: quantized as kv_cache.quantize_q8 does, bit for bit)."""
        logits = torch.empty(1, 1, self.vocab)
        step = getattr(self._lib, _STEP_FUNCTIONS[cache.kind])
        code = step(self._handle, token, pos, *(t.data_ptr() for t in _cache_tensors(cache)), cache.keys.shape[3],
                    logits.data_ptr())
        if code:
            raise ValueError(f"native decode step at position {pos} (token {token}): {_ERRORS.get(code, code)}")
        return logits

    def close(self) -> None:
        """Free the scratch buffers (the weights belong to the artifact, the pool to edgellm.kernels.native)."""
        if self._handle:
            self._lib.el_decoder_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


def decode_path(config: ArtifactConfig, kv_dtype: torch.dtype = torch.float32) -> str:
    """How single-token steps of this artifact will run: "native <variant>" or "torch (why)"."""
    if reason := unsupported_reason(config, kv_dtype):
        return f"torch ({reason})"
    variant, why = native.active_kernel()
    return f"native {variant}" if variant != native.TORCH else f"torch ({why})"


def attach_native_decoder(model: Transformer, config: ArtifactConfig, weights: dict[str, Tensor], threads: int,
                          kv_dtype: torch.dtype = torch.float32) -> str:
    """Give `model` a native decode step when the kernels and this artifact allow; return its decode_path
    (with the thread count when native)."""
    model.native = None
    path = decode_path(config, kv_dtype)
    if not path.startswith("native"):
        return path
    model.native = NativeDecoder(native.load_library(), model, weights, config.quantization.formats,
                                 native.pool(threads))
    return f"{path}, {model.native.threads} thread{'s' * (model.native.threads > 1)}"
