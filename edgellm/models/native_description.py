"""The C description of a model (``el_model_desc``, declared in kernels/abi.py): which of the
artifact's tensors feeds which ``el_matrix`` and vector, built from the family and the memory-mapped weights.

Naming tensors is the models layer's job; the kernel layer (kernels/decoder.py) only calls C with the finished
description. The weights are numpy arrays or torch tensors, read as numpy views: nothing is copied but the small
norm vectors (float32, Gemma's 1 + w offset folded in). What a family does beyond Llama is a flag of the
description. :func:`native_unsupported` says, from the config alone, when C cannot run a model: Llama, Qwen2,
Qwen3, Gemma 2 and Gemma 3 with block-format matmul weights (K a multiple of 32), attention in float32.
f32/f16 weights (q0f32, q0f16) keep torch's path: their decode is bandwidth-bound on 4/2 bytes per weight either
way, and torch's GEMV already streams them at memory speed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.kernels import native
from edgellm.kernels import abi
from edgellm.kernels.decoder import DEFAULT_MAX_BATCH, NativeDecoder, as_array, dtype_name
from edgellm.quant.layout import EL_FORMAT_CODES, FORMAT_SUFFIXES, weight_shape

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.families.family import Family
    from edgellm.models.rope_tables import RopeTables

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma2", "gemma3")


def native_unsupported(config: ArtifactConfig, kv_dtype: object = None) -> str | None:
    """Why the native decoder cannot describe this model (None when it can), from its config alone; `kv_dtype`:
    the float type torch's path would store f32 KV in (None: float32)."""
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


def native_decoder(description: NativeDescription, threads: int, *, max_batch: int = DEFAULT_MAX_BATCH) -> NativeDecoder:
    """The native decoder over `description` on the loaded library, with a pool of `threads` (`max_batch`: the most
    rows one batched step takes)."""
    lib = native.load_library()
    if lib is None:  # choose() only picks a native decoder where a library loaded
        raise EdgeLLMError(f"no native kernel library: {native.active_kernel()[1]}")
    return NativeDecoder(lib, description.struct, description, native.pool(threads), max_batch=max_batch)


class NativeDescription:
    """A model's C description (`struct`) and every array it points into, which this object keeps alive."""

    def __init__(self, config: ArtifactConfig, family: Family, weights: Mapping[str, Any], rope: RopeTables,
                 local_rope: RopeTables | None = None) -> None:
        """`weights`: the artifact's tensors by name (numpy arrays or torch tensors), each exactly as
        families/tensor_specs.py describes it for `config` (the caller checks: C reads each vector for the config's
        length); `rope`: the RoPE tables (the sliding layers' own in `local_rope`, where the model has them)."""
        self.arrays: list[np.ndarray] = []
        self.streamed: list[np.ndarray] = []  # the matmul weights, read whole on every step
        cfg = config.model
        formats = config.quantization.formats
        layers = (abi.LayerDesc * cfg.num_hidden_layers)()
        for i in range(cfg.num_hidden_layers):
            sliding = cfg.is_sliding(i)
            layer_rope = local_rope if sliding and local_rope is not None else rope
            layers[i] = self._layer(config, family, i, weights, layer_rope, (cfg.sliding_window or 0) if sliding else 0)
        flags = (abi.QK_NORM * family.qk_norm
                 | abi.SANDWICH_NORMS * family.sandwich_norms
                 | abi.GELU_TANH * (cfg.hidden_act == "gelu_tanh")
                 | abi.EMBED_SCALE * family.embed_scale
                 | abi.LOGIT_SOFTCAP * (cfg.final_logit_softcapping is not None)
                 | abi.ATTN_SOFTCAP * (cfg.attn_logit_softcapping is not None))
        embed_fmt = formats["model.embed_tokens"]
        head = ("model.embed_tokens", embed_fmt) if cfg.tie_word_embeddings else ("lm_head", formats["lm_head"])
        self.struct = abi.ModelDesc(
            n_layers=cfg.num_hidden_layers, dim=cfg.hidden_size, n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, ffn_dim=cfg.intermediate_size,
            vocab=cfg.vocab_size, flags=flags, eps=cfg.rms_norm_eps,
            attn_scale=(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
            embed_scale=cfg.hidden_size**0.5 if family.embed_scale else 1.0,
            logit_softcap=cfg.final_logit_softcapping or 0.0, attn_softcap=cfg.attn_logit_softcapping or 0.0,
            embed=self._matrix(weights, "model.embed_tokens", embed_fmt, streamed=False),
            lm_head=self._matrix(weights, *head),
            final_norm=self._vector(weights["model.norm.weight"], family.norm_offset), rope_len=rope.cos.shape[0],
            layers=layers)

    @property
    def streamed_spans(self) -> list[tuple[int, int]]:
        """(address, bytes) of the weights every step reads whole (matmuls and the LM head): worth huge pages
        (artifact/huge_pages.py)."""
        return [(a.ctypes.data, a.nbytes) for a in self.streamed]

    def _vector(self, t: Any, offset: float = 0.0) -> int | None:
        """A float32 copy of a norm weight (plus `offset`) or bias; None stays None."""
        if t is None:
            return None
        v = np.ascontiguousarray(as_array(t), dtype=np.float32)
        v = v + np.float32(offset) if offset else v
        self.arrays.append(v)
        return int(v.ctypes.data)

    def _table(self, t: np.ndarray) -> int:
        """A float32 RoPE table, as it is (kept alive here)."""
        self.arrays.append(t)
        return int(t.ctypes.data)

    def _matrix(self, weights: Mapping[str, Any], prefix: str, fmt: str, streamed: bool = True) -> abi.Matrix:
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

    def _layer(self, config: ArtifactConfig, family: Family, i: int, weights: Mapping[str, Any],
               rope: RopeTables, window: int) -> abi.LayerDesc:
        """Layer i's description: its matmul weights, its norm weights (the family's offset folded in), its
        biases, its RoPE tables and its window (0: attends to every earlier position)."""
        formats = config.quantization.formats
        p = f"model.layers.{i}"
        mats = {n: self._matrix(weights, f"{p}.self_attn.{n}_proj", formats[f"{p}.self_attn.{n}_proj"])
                for n in "qkvo"}
        mats |= {n: self._matrix(weights, f"{p}.mlp.{n}_proj", formats[f"{p}.mlp.{n}_proj"])
                 for n in ("gate", "up", "down")}
        vectors = {f"{n}_bias": self._vector(weights.get(f"{p}.self_attn.{n}_proj.bias")) for n in "qkv"}
        norms = ({"attn_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                  "ffn_norm": "pre_feedforward_layernorm", "ffn_out_norm": "post_feedforward_layernorm"}
                 if family.sandwich_norms else {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"})
        if family.qk_norm:
            norms |= {"q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
        vectors |= {field: self._vector(weights[f"{p}.{name}.weight"], family.norm_offset)
                    for field, name in norms.items()}
        return abi.LayerDesc(**mats, **vectors, rope_cos=self._table(rope.cos), rope_sin=self._table(rope.sin),
                      sliding_window=window)
