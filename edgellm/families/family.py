"""What an architecture family declares: how to read its config, which tensors it has, where they come from.

The base class is the Llama layout; a family file overrides what differs. Tensor names are Hugging Face's
(the artifact keeps them); `hf_sources` / `gguf_sources` say which source tensor (or row range of a
fused one) each of them is read from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar

from edgellm.errors import UnsupportedModelError
from edgellm.families.config import FULL, SLIDING, ModelConfig

if TYPE_CHECKING:  # converting reads torch tensors; describing a model needs no torch
    import torch

ATTN, MLP = "self_attn", "mlp"
# GGUF (llama.cpp) block tensor → Hugging Face name, for the tensors every family shares.
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": f"{ATTN}.q_proj",
    "attn_k": f"{ATTN}.k_proj",
    "attn_v": f"{ATTN}.v_proj",
    "attn_output": f"{ATTN}.o_proj",
    "attn_q_norm": f"{ATTN}.q_norm",
    "attn_k_norm": f"{ATTN}.k_norm",
    "ffn_gate": f"{MLP}.gate_proj",
    "ffn_up": f"{MLP}.up_proj",
    "ffn_down": f"{MLP}.down_proj",
}
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass(frozen=True)
class SourceTensor:
    """Where one artifact tensor comes from: a source tensor, or rows [start, stop) of a fused one."""

    name: str
    rows: tuple[int, int] | None = None


class GGUFMeta:
    """A GGUF file's metadata as the families read it: keys under the architecture's prefix, tensor names."""

    def __init__(self, arch: str, fields: Callable[[str], Any], tensor_names: set[str], vocab_size: int) -> None:
        self.arch, self._fields, self.tensor_names, self.vocab_size = arch, fields, tensor_names, vocab_size

    def get(self, key: str, default: Any = None) -> Any:
        value = self._fields(f"{self.arch}.{key}")
        return default if value is None else value

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {self.arch}.{key}")
        return value


class Family:
    """The Llama layout: pre-norm attention (optional q/k/v bias) and SiLU-gated MLP, plain RMSNorm."""

    name: ClassVar[str]
    hf_architectures: ClassVar[tuple[str, ...]]
    gguf_architecture: ClassVar[str]
    norm_offset: ClassVar[float] = 0.0  # RMSNorm scales by (offset + w): Gemma stores w around 0
    qk_norm: ClassVar[bool] = False  # RMSNorm of each query/key head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: ClassVar[bool] = False  # norms after attention and MLP too (Gemma 2/3)
    embed_scale: ClassVar[bool] = False  # embeddings times √hidden_size (Gemma)
    gguf_permuted_qk: ClassVar[bool] = False  # llama.cpp interleaves Q/K rows for RoPE (Llama only)

    # ---- config ------------------------------------------------------------------------------------------
    def config_from_hf(self, raw: dict[str, Any]) -> ModelConfig:
        """ModelConfig from a Hugging Face config.json."""
        heads = raw["num_attention_heads"]
        theta, scaling = hf_rope(raw)
        fields: dict[str, Any] = dict(
            architecture=self.name,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            rms_norm_eps=float(raw["rms_norm_eps"]),
            rope_theta=theta,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            rope_scaling=scaling,
        )
        return ModelConfig(**fields | self.extra_hf(raw))

    def extra_hf(self, raw: dict[str, Any]) -> dict[str, Any]:
        """Family-specific ModelConfig fields from config.json."""
        return {}

    def config_from_gguf(self, meta: GGUFMeta) -> ModelConfig:
        """ModelConfig from GGUF metadata (llama.cpp's keys)."""
        kind, scaling = meta.get("rope.scaling.type"), None
        if kind == "linear":
            scaling = {"rope_type": "linear", "factor": float(meta.require("rope.scaling.factor"))}
        elif kind not in (None, "none"):
            raise UnsupportedModelError(f"RoPE scaling {kind!r} in GGUF is not supported yet")
        heads = int(meta.require("attention.head_count"))
        hidden = int(meta.require("embedding_length"))
        fields: dict[str, Any] = dict(
            architecture=self.name,
            vocab_size=int(meta.get("vocab_size") or meta.vocab_size),
            hidden_size=hidden,
            intermediate_size=int(meta.require("feed_forward_length")),
            num_hidden_layers=int(meta.require("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(meta.get("attention.head_count_kv", heads)),
            head_dim=int(meta.get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(meta.require("attention.layer_norm_rms_epsilon")),
            rope_theta=float(meta.get("rope.freq_base", 10000.0)),
            max_position_embeddings=int(meta.require("context_length")),
            tie_word_embeddings="output.weight" not in meta.tensor_names,
            attention_bias="blk.0.attn_q.bias" in meta.tensor_names,
            rope_scaling=scaling,
        )
        return ModelConfig(**fields | self.extra_gguf(meta))

    def extra_gguf(self, meta: GGUFMeta) -> dict[str, Any]:
        """Family-specific ModelConfig fields from GGUF metadata."""
        return {}

    # ---- tensors -------------------------------------------------------------------------------------------
    def layer_norms(self) -> tuple[str, ...]:
        if self.sandwich_norms:
            return ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                    "post_feedforward_layernorm")
        return ("input_layernorm", "post_attention_layernorm")

    def layer_modules(self, cfg: ModelConfig, i: int) -> dict[str, dict[str, tuple[int, int]]]:
        """Layer i's matmul modules (attribute path in the Transformer) → (out, in) of each weight they fuse."""
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        d, f, p = cfg.hidden_size, cfg.intermediate_size, f"model.layers.{i}"
        return {
            f"layers.{i}.attn.qkv": {f"{p}.{ATTN}.q_proj": (q, d), f"{p}.{ATTN}.k_proj": (kv, d),
                                     f"{p}.{ATTN}.v_proj": (kv, d)},
            f"layers.{i}.attn.o_proj": {f"{p}.{ATTN}.o_proj": (d, q)},
            f"layers.{i}.mlp.gate_up": {f"{p}.{MLP}.gate_proj": (f, d), f"{p}.{MLP}.up_proj": (f, d)},
            f"layers.{i}.mlp.down_proj": {f"{p}.{MLP}.down_proj": (d, f)},
        }

    def matmul_shapes(self, cfg: ModelConfig) -> dict[str, tuple[int, int]]:
        """(out, in) shape of every embedding/projection weight, by Hugging Face prefix."""
        shapes = {"model.embed_tokens": (cfg.vocab_size, cfg.hidden_size)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head"] = (cfg.vocab_size, cfg.hidden_size)
        for i in range(cfg.num_hidden_layers):
            for weights in self.layer_modules(cfg, i).values():
                shapes |= weights
        return shapes

    def vector_shapes(self, cfg: ModelConfig) -> dict[str, int]:
        """Length of every norm weight and bias (kept float32), by tensor name."""
        shapes = {"model.norm.weight": cfg.hidden_size}
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}"
            shapes |= {f"{p}.{n}.weight": cfg.hidden_size for n in self.layer_norms()}
            if self.qk_norm:
                shapes |= {f"{p}.{ATTN}.q_norm.weight": cfg.head_dim, f"{p}.{ATTN}.k_norm.weight": cfg.head_dim}
            if cfg.attention_bias:
                shapes |= {f"{p}.{ATTN}.q_proj.bias": q, f"{p}.{ATTN}.k_proj.bias": kv, f"{p}.{ATTN}.v_proj.bias": kv}
        return shapes

    def tensor_names(self, cfg: ModelConfig) -> list[str]:
        """Every tensor an artifact of this config holds, in Hugging Face naming, layer by layer."""
        names = ["model.embed_tokens.weight", "model.norm.weight"] + ([] if cfg.tie_word_embeddings else
                                                                      ["lm_head.weight"])
        vectors, matmuls = self.vector_shapes(cfg), self.matmul_shapes(cfg)
        for i in range(cfg.num_hidden_layers):
            p = f"model.layers.{i}."
            names += [n for n in vectors if n.startswith(p) and n.endswith("norm.weight")]
            names += [f"{n}.weight" for n in matmuls if n.startswith(p)]
            names += [n for n in vectors if n.startswith(p) and n.endswith(".bias")]
        return names

    def hf_sources(self, cfg: ModelConfig) -> dict[str, SourceTensor]:
        """Where each tensor is found in a Hugging Face checkpoint (by default: under its own name)."""
        return {name: SourceTensor(name) for name in self.tensor_names(cfg)}

    def gguf_sources(self, cfg: ModelConfig) -> dict[str, SourceTensor]:
        """Where each tensor is found in a GGUF file."""
        blocks = {hf: gguf for gguf, hf in (GGUF_BLOCK_NAMES | self.gguf_block_names()).items()}
        globals_ = {hf: gguf for gguf, hf in GGUF_GLOBAL_NAMES.items()}
        out = {}
        for name in self.tensor_names(cfg):
            stem, _, kind = name.rpartition(".")
            if stem.startswith("model.layers."):
                _, _, i, role = stem.split(".", 3)
                out[name] = SourceTensor(f"blk.{i}.{blocks[role]}.{kind}")
            else:
                out[name] = SourceTensor(f"{globals_[stem]}.{kind}")
        return out

    def gguf_block_names(self) -> dict[str, str]:
        """The family's GGUF block names beyond GGUF_BLOCK_NAMES (norm names differ between layouts)."""
        return {"ffn_norm": "post_attention_layernorm"}

    def from_gguf(self, name: str, tensor: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
        """Undo what llama.cpp's converter did to a tensor (row permutation, norm offset)."""
        if self.gguf_permuted_qk and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            rows, *rest = tensor.shape
            return tensor.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)
        if self.norm_offset and name.endswith("norm.weight"):
            return tensor - self.norm_offset  # llama.cpp stores Gemma's norms as 1 + w
        return tensor


def hf_rope(raw: dict[str, Any], layer_type: str = FULL) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either config.json style: `rope_theta` + `rope_scaling`
    (most Hub models) or transformers 5's `rope_parameters` (per layer type for Gemma 3)."""
    params = dict(raw.get("rope_parameters") or {})
    if layer_type in params or SLIDING in params:
        params = dict(params.get(layer_type) or {})
    scaling = dict(raw.get("rope_scaling") or params)
    theta = raw.get("rope_theta") or params.get("rope_theta") or 10000.0
    if float(scaling.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0) != 1.0:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    scaling.pop("rope_theta", None)
    kind = scaling.pop("type", None) or scaling.get("rope_type") or "default"
    kind = "longrope" if kind in ("su", "longrope") else kind
    if kind == "default":
        return float(theta), None
    scaling["rope_type"] = kind
    if kind == "longrope":
        scaling.setdefault("original_max_position_embeddings",
                           raw.get("original_max_position_embeddings") or raw.get("max_position_embeddings"))
    return float(theta), scaling


def layer_pattern(n_layers: int, every: int) -> tuple[str, ...]:
    """Every `every`-th layer attends to all keys, the others slide (Gemma 2: 2, Gemma 3: 6)."""
    return tuple(FULL if (i + 1) % every == 0 else SLIDING for i in range(n_layers))
