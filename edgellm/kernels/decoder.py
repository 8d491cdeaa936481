"""The native decoder: one call into the kernel library runs every layer for one token (a decode step) or for a
chunk of tokens (prefill).

:func:`attach_native_decoder` decides, once at load, whether single-token steps of a torch
:class:`~edgellm.models.transformer.Transformer` go native; the model then calls :meth:`NativeDecoder.step`
for every (1, 1) step whose KV cache the native code can use (float32, half, or the 8-bit "q8" kind, which
it reads and writes in place). models/native_model.py runs a model on this decoder alone, without torch.

The description handed to C (``el_model_desc`` of ``csrc/edgellm_decoder.h``, declared in kernels/abi.py) is built from
the artifact's config and its memory-mapped weights (numpy arrays or torch tensors, read as numpy views: nothing
is copied but the small norm vectors) and points into them; this object keeps them alive.
Supported: Llama, Qwen2, Qwen3, Gemma 2 and Gemma 3 with q4/q8 matmul weights (K a multiple of 32), attention in
float32. What a family does beyond Llama is a flag of the description (``abi.QK_NORM`` ..., ``EL_*`` in C); norm
weights are handed over in float32 with Gemma's 1 + w offset folded in. Sliding-window
layers read the same full-history cache torch's path writes, from the window's first position on.
f32/f16 weights (q0f32, q0f16) keep torch's path: their decode is bandwidth-bound on 4/2 bytes per
weight either way, and torch's GEMV already streams them at memory speed.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgellm.errors import ArtifactError
from edgellm.kernels import abi, native
from edgellm.quant.layout import EL_FORMAT_CODES, FORMAT_SUFFIXES, weight_shape

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.families.family import Family
    from edgellm.models.rope_tables import RopeTables
    from edgellm.models.transformer import Transformer

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


def as_array(t: Any) -> np.ndarray:
    """A numpy view of a weight or cache tensor: the array itself, or a CPU torch tensor's memory (not copied)."""
    return t if isinstance(t, np.ndarray) else t.detach().numpy()


def dtype_name(dtype: Any) -> str:
    """numpy's name of a numpy or torch dtype ("float32", "int8", ...); None counts as float32."""
    return "float32" if dtype is None else str(dtype).removeprefix("torch.")


class _Description:
    """The C description of a model and every array it points into (kept alive with it)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.streamed: list[np.ndarray] = []  # the matmul weights, read whole on every step

    def vector(self, t: Any, offset: float = 0.0) -> int | None:
        """A float32 copy of a norm weight (plus `offset`) or bias; None stays None."""
        if t is None:
            return None
        v = np.ascontiguousarray(as_array(t), dtype=np.float32)
        v = v + np.float32(offset) if offset else v
        self.arrays.append(v)
        return v.ctypes.data

    def table(self, t: np.ndarray) -> int:
        """A float32 RoPE table, as it is (kept alive here)."""
        self.arrays.append(t)
        return t.ctypes.data

    def matrix(self, weights: Mapping[str, Any], prefix: str, fmt: str, streamed: bool = True) -> abi.Matrix:
        """The weight at `prefix` as the kernels read it: the artifact's own rows, not a copy (`streamed`:
        read whole on every step, unlike the embedding's rows)."""
        parts = {s: as_array(weights[f"{prefix}.{s}"]) for s in FORMAT_SUFFIXES[fmt]}
        n, k = weight_shape(fmt, parts)
        rows = parts["weight" if fmt == "f32" else "qweight"]
        if not rows.flags.c_contiguous:
            raise ValueError(f"{prefix}: the native decoder reads contiguous weight rows")
        self.arrays.append(rows)
        if streamed:
            self.streamed.append(rows)
        return abi.Matrix(rows.ctypes.data, abi.FORMATS[fmt], n, k)


# What each KV cache kind hands the native step: its arrays' dtypes, and the step function that reads them.
_CACHE_DTYPES = {"f32": ("float32", "float32"), "f16": ("float16", "float16"),
                 "q8": ("int8", "int8", "float32", "float32")}
_STEP_FUNCTIONS = {"f32": "el_decoder_step", "f16": "el_decoder_step_f16", "q8": "el_decoder_step_q8"}
_PREFILL_FUNCTIONS = {"f32": "el_decoder_prefill", "f16": "el_decoder_prefill_f16", "q8": "el_decoder_prefill_q8"}


def _cache_tensors(cache: Any) -> list[Any]:
    """Keys and values, and for q8 their scales, in the order the step function takes them (torch tensors of
    models/kv_cache.py or numpy arrays of models/kv_arrays.py)."""
    return [cache.keys, cache.values, *((cache.key_scales, cache.value_scales) if cache.kind == "q8" else ())]


def _address(t: Any) -> int:
    return t.ctypes.data if isinstance(t, np.ndarray) else t.data_ptr()


def _contiguous(t: Any) -> bool:
    return t.flags.c_contiguous if isinstance(t, np.ndarray) else t.is_contiguous()


def unsupported_reason(config: ArtifactConfig, kv_dtype: Any = None) -> str | None:
    """Why this model cannot decode natively (None when it can), from its config alone."""
    m = config.model
    formats = config.quantization.formats
    if m.architecture not in SUPPORTED_ARCHITECTURES:
        return f"architecture {m.architecture} has no native decode yet"
    if m.rope_scaling and (m.rope_scaling.get("rope_type") or m.rope_scaling.get("type")) == "longrope":
        return "LongRoPE switches tables by position; the native step reads one table"
    if dtype_name(kv_dtype) != "float32":
        return f"the native decode step attends in float32, not {kv_dtype}"
    bad = sorted({f for name, f in formats.items() if f not in EL_FORMAT_CODES and name != "model.embed_tokens"})
    if bad:
        return f"weight format {', '.join(bad)}: native decode takes {'/'.join(EL_FORMAT_CODES)}"
    if formats["model.embed_tokens"] not in abi.FORMATS:
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

    def __init__(self, lib: ctypes.CDLL, config: ArtifactConfig, family: Family, weights: Mapping[str, Any],
                 pool: int | None, rope: RopeTables, local_rope: RopeTables | None = None) -> None:
        """`lib`: a kernel library whose signatures abi.declare set (native.load_library()); `family`: the
        architecture's (models/registry.py); `weights`: the artifact's tensors by name (numpy
        arrays or torch tensors), each exactly as models/tensor_specs.py describes it for `config` (the caller
        checks: C reads each vector for the config's length); `rope`: the RoPE tables (the sliding layers' own in
        `local_rope`, where the model has them)."""
        self._handle: int | None = None  # set once the description passed its checks
        cfg = config.model
        formats = config.quantization.formats
        desc = _Description()
        layers = (abi.LayerDesc * cfg.num_hidden_layers)()
        for i in range(cfg.num_hidden_layers):
            sliding = cfg.is_sliding(i)
            layer_rope = local_rope if sliding and local_rope is not None else rope
            layers[i] = self._layer(desc, config, family, i, weights, layer_rope,
                                    cfg.sliding_window if sliding else 0)
        flags = (abi.QK_NORM * family.qk_norm
                 | abi.SANDWICH_NORMS * family.sandwich_norms
                 | abi.GELU_TANH * (cfg.hidden_act == "gelu_tanh")
                 | abi.EMBED_SCALE * family.embed_scale
                 | abi.LOGIT_SOFTCAP * (cfg.final_logit_softcapping is not None)
                 | abi.ATTN_SOFTCAP * (cfg.attn_logit_softcapping is not None))
        embed_fmt = formats["model.embed_tokens"]
        head = ("model.embed_tokens", embed_fmt) if cfg.tie_word_embeddings else ("lm_head", formats["lm_head"])
        self._model = abi.ModelDesc(
            n_layers=cfg.num_hidden_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, ffn_dim=cfg.intermediate_size,
            vocab=cfg.vocab_size, flags=flags, eps=cfg.rms_norm_eps,
            attn_scale=(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
            embed_scale=cfg.hidden_size**0.5 if family.embed_scale else 1.0,
            logit_softcap=cfg.final_logit_softcapping or 0.0, attn_softcap=cfg.attn_logit_softcapping or 0.0,
            embed=desc.matrix(weights, "model.embed_tokens", embed_fmt, streamed=False),
            lm_head=desc.matrix(weights, *head),
            final_norm=desc.vector(weights["model.norm.weight"], family.norm_offset), rope_len=rope.cos.shape[0],
            layers=layers)
        self._desc = desc  # the arrays the description points into
        if code := lib.el_decoder_check(ctypes.byref(self._model)):
            raise ArtifactError(f"the native decoder refused this model description: {abi.strerror(lib, code)}")
        handle = lib.el_decoder_create(ctypes.byref(self._model), pool)
        if not handle:
            raise MemoryError("could not allocate the native decoder's scratch buffers")
        self._lib, self._handle = lib, handle
        self.vocab = cfg.vocab_size
        self.threads = lib.el_decoder_threads(handle)

    @staticmethod
    def _layer(desc: _Description, config: ArtifactConfig, family: Family, i: int, weights: Mapping[str, Any],
               rope: RopeTables, window: int) -> abi.LayerDesc:
        """Layer i's description: its matmul weights, its norm weights (the family's offset folded in), its
        biases, its RoPE tables and its window (0: attends to every earlier position)."""
        formats = config.quantization.formats
        p = f"model.layers.{i}"
        mats = {n: desc.matrix(weights, f"{p}.self_attn.{n}_proj", formats[f"{p}.self_attn.{n}_proj"]) for n in "qkvo"}
        mats |= {n: desc.matrix(weights, f"{p}.mlp.{n}_proj", formats[f"{p}.mlp.{n}_proj"])
                 for n in ("gate", "up", "down")}
        vectors = {f"{n}_bias": desc.vector(weights.get(f"{p}.self_attn.{n}_proj.bias")) for n in "qkv"}
        norms = ({"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}
                 if family.sandwich_norms else {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"})
        if family.qk_norm:
            norms |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        vectors |= {field: desc.vector(weights[f"{p}.{name}.weight"], family.norm_offset)
                    for field, name in norms.items()}
        return abi.LayerDesc(**mats, **vectors, rope_cos=desc.table(rope.cos), rope_sin=desc.table(rope.sin),
                      sliding_window=window)

    @property
    def streamed_spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of the weights every step reads whole (matmuls and the LM head): worth huge pages
        (artifact/huge_pages.py)."""
        return [(a.ctypes.data, a.nbytes) for a in self._desc.streamed]

    def accepts(self, cache: KVCache) -> bool:
        """Whether `cache` is one the native step reads and writes: batch 1, contiguous, float32 keys/values,
        the f16 kind (half keys/values) or the q8 kind (int8 keys/values, float32 scales), attending in float32."""
        if cache.kind != "f32" and dtype_name(cache.dtype) != "float32":
            return False
        tensors = _cache_tensors(cache)
        return (len(cache.keys.shape) == 5 and cache.keys.shape[1] == 1
                and all(t is not None and dtype_name(t.dtype) == d and _contiguous(t)
                        for t, d in zip(tensors, _CACHE_DTYPES[cache.kind], strict=True)))

    def step(self, token: int, pos: int, cache: Any) -> np.ndarray:
        """Logits (V,) after `token` at `pos`; its keys/values are written into `cache` (for f16: rounded
        as torch's .half(), for q8: quantized as kv_cache.quantize_q8 does, bit for bit)."""
        logits = np.empty(self.vocab, dtype=np.float32)
        step = getattr(self._lib, _STEP_FUNCTIONS[cache.kind])
        code = step(self._handle, token, pos, *(_address(t) for t in _cache_tensors(cache)), cache.keys.shape[3],
                    logits.ctypes.data)
        if code:
            raise ValueError(f"native decode step at position {pos} (token {token}): {abi.strerror(self._lib, code)}")
        return logits

    def prefill(self, tokens: Sequence[int], start: int, cache: Any, *, all_logits: bool = False) -> np.ndarray | None:
        """Float32 logits after `tokens` at positions start..start+n-1, run through every layer in one native call
        (csrc/decoder/prefill.c): (n, V) with `all_logits`, else the last position's (V,). Positions before `start` are read
        from `cache`, the new keys/values written into it: the caller reserves room for start + n first, as for
        step. Any kind `accepts` takes: "f32", "f16" (new keys/values rounded as torch's .half()) or "q8" (quantized
        as kv_cache.quantize_q8), bit for bit as step stores them; attention reads every position, the chunk's own
        included, as stored (as KVCache.update/read). None (nothing written) where the native prefill cannot run: a
        library without a native prefill (the scalar variant: native.prefill_matmul() is None), or a cache `accepts`
        refuses. ValueError (nothing written) for no tokens, positions beyond the cache's capacity or the RoPE table,
        a token id outside the vocabulary."""
        if not self.accepts(cache):
            return None
        prefill = getattr(self._lib, _PREFILL_FUNCTIONS[cache.kind])
        n = len(tokens)
        where = f"native prefill at positions {start}..{start + n - 1}"
        if n == 0:
            raise ValueError(f"native prefill at position {start}: no tokens")
        ids = np.asarray(tokens, dtype=np.int64).reshape(n)
        outside = ids[(ids < 0) | (ids >= self.vocab)]  # C checks them too; here before int32 could wrap one
        if outside.size:
            raise ValueError(f"{where}: token id {int(outside[0])} outside the vocabulary")
        ids = ids.astype(np.int32)  # int32 tokens[n]
        logits = np.empty((n if all_logits else 1, self.vocab), dtype=np.float32)  # float32 [n or 1][V], row-major
        # keys, values [layers][1][kv_heads][capacity][head_dim] (float32, half or int8), q8's scales [...][capacity][1]
        arrays = [_address(t) for t in _cache_tensors(cache)]
        capacity = cache.keys.shape[3]
        code = prefill(self._handle, ids.ctypes.data, n, start, *arrays, capacity, logits.ctypes.data, int(all_logits))
        if code == abi.ERR_UNAVAILABLE:  # no native prefill in this library: checked before anything is written
            return None
        if code:
            limit = f" (cache capacity {capacity}, RoPE table {self._model.rope_len})" * (code == abi.ERR_POSITION)
            raise ValueError(f"{where}: {abi.strerror(self._lib, code)}{limit}")
        return logits if all_logits else logits[0]

    def describe(self) -> str:
        """The decode path in words: "native <variant>, N threads"."""
        return f"native {native.active_kernel()[0]}, {self.threads} thread{'s' * (self.threads > 1)}"

    def close(self) -> None:
        """Free the scratch buffers (the weights belong to the artifact, the pool to edgellm.kernels.native)."""
        if self._handle:
            self._lib.el_decoder_destroy(self._handle)
            self._handle = None

    def __del__(self) -> None:
        self.close()


def decode_path(config: ArtifactConfig, kv_dtype: Any = None) -> str:
    """How single-token steps of this artifact will run: "native <variant>" or "torch (why)"."""
    if reason := unsupported_reason(config, kv_dtype):
        return f"torch ({reason})"
    variant, why = native.active_kernel()
    return f"native {variant}" if variant != native.TORCH else f"torch ({why})"


def attach_native_decoder(model: Transformer, config: ArtifactConfig, weights: Mapping[str, Any], threads: int,
                          kv_dtype: Any = None) -> str:
    """Give `model` a native decode step when the kernels and this artifact allow; return its decode_path
    (with the thread count when native)."""
    model.native = None
    path = decode_path(config, kv_dtype)
    if not path.startswith("native"):
        return path
    local = model.local_rope.arrays if model.local_rope is not None else None
    model.native = NativeDecoder(native.load_library(), config, model.family, weights, native.pool(threads),
                                 model.rope.arrays, local)
    return model.native.describe()
