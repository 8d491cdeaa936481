"""The Llama family (Llama, SmolLM) and Qwen2 (q/k/v bias): one decoder, built from artifact weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from edgellm.artifact.config import ArtifactConfig, ModelConfig
from edgellm.errors import ArtifactError
from edgellm.quant.formats import FORMAT_SUFFIXES
from edgellm.quant.layers import make_embedding, make_linear
from edgellm.runtime.kv_cache import DEFAULT_BLOCK, KVCache

Weights = dict[str, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float(), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class FusedLinear(nn.Module):
    """Several projections of the same input. Same-format weights are concatenated into one matmul."""

    def __init__(self, weights: Weights, prefixes: list[str], formats: dict[str, str]) -> None:
        super().__init__()
        fmts = {formats[p] for p in prefixes}
        biases = [weights.get(f"{p}.bias") for p in prefixes]
        parts = [_parts(weights, p, formats[p]) for p in prefixes]
        self.sizes = [next(iter(pp.values())).shape[0] for pp in parts]
        if len(fmts) == 1:
            fused = {k: torch.cat([pp[k] for pp in parts]) for k in parts[0]}
            bias = torch.cat(biases) if biases[0] is not None else None
            self.linears = nn.ModuleList([make_linear(fmts.pop(), fused, bias)])
        else:
            self.linears = nn.ModuleList(make_linear(formats[p], pp, b) for p, pp, b in zip(prefixes, parts, biases))

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if len(self.linears) == 1:
            return list(self.linears[0](x).split(self.sizes, dim=-1))
        return [linear(x) for linear in self.linears]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: Weights, prefix: str, formats: dict[str, str]) -> None:
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.qkv = FusedLinear(weights, [f"{prefix}.{n}_proj" for n in "qkv"], formats)
        o = f"{prefix}.o_proj"
        self.o_proj = make_linear(formats[o], _parts(weights, o, formats[o]), None)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                start: int) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x)
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        keys, values = cache.update(layer, start, k, v)  # (B, KV, start+T, hd)
        if t == 1:
            out = F.scaled_dot_product_attention(q, keys, values, enable_gqa=True)
        elif start == 0:
            out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, enable_gqa=True)
        else:
            pos = torch.arange(start, start + t).unsqueeze(1)
            mask = torch.arange(start + t).unsqueeze(0) <= pos  # (T, S): query i sees keys 0..start+i
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, weights: Weights, prefix: str, formats: dict[str, str]) -> None:
        super().__init__()
        self.gate_up = FusedLinear(weights, [f"{prefix}.gate_proj", f"{prefix}.up_proj"], formats)
        down = f"{prefix}.down_proj"
        self.down_proj = make_linear(formats[down], _parts(weights, down, formats[down]), None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, weights: Weights, i: int, formats: dict[str, str]) -> None:
        super().__init__()
        p = f"model.layers.{i}"
        self.index = i
        self.input_norm = RMSNorm(weights[f"{p}.input_layernorm.weight"], cfg.rms_norm_eps)
        self.attn = Attention(cfg, weights, f"{p}.self_attn", formats)
        self.post_norm = RMSNorm(weights[f"{p}.post_attention_layernorm.weight"], cfg.rms_norm_eps)
        self.mlp = MLP(weights, f"{p}.mlp", formats)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, start: int):
        h = x + self.attn(self.input_norm(x), cos, sin, cache, self.index, start)
        return h + self.mlp(self.post_norm(h))


class Transformer(nn.Module):
    """Decoder-only transformer; `forward` reads and extends the KV cache passed in."""

    def __init__(self, config: ArtifactConfig, weights: Weights) -> None:
        super().__init__()
        cfg = self.config = config.model
        formats = config.quantization.formats
        embed_fmt = formats["model.embed_tokens"]
        embed_parts = _parts(weights, "model.embed_tokens", embed_fmt)
        self.embed = make_embedding(embed_fmt, embed_parts)
        self.layers = nn.ModuleList(DecoderLayer(cfg, weights, i, formats) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(weights["model.norm.weight"], cfg.rms_norm_eps)
        if cfg.tie_word_embeddings:
            self.lm_head = make_linear(embed_fmt, embed_parts, None)
        else:
            self.lm_head = make_linear(formats["lm_head"], _parts(weights, "lm_head", formats["lm_head"]), None)
        cos, sin = rope_tables(cfg, config.context_window)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def new_cache(self, max_length: int, dtype: torch.dtype = torch.float32, batch: int = 1,
                  kind: str = "f32", block: int = DEFAULT_BLOCK) -> KVCache:
        cfg = self.config
        return KVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, max_length,
                       batch=batch, dtype=dtype, kind=kind, block=block)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """tokens (B, T) at positions start..start+T → logits (B, T, V) if all_logits else (B, 1, V)."""
        t = tokens.shape[1]
        if start + t > min(cache.max_length, self.rope_cos.shape[0]):
            raise ValueError(f"positions {start}..{start + t} exceed the context window {cache.max_length}")
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]  # (T, hd)
        x = self.embed(tokens)  # (B, T, D)
        for layer in self.layers:
            x = layer(x, cos, sin, cache, start)
        if not all_logits:
            x = x[:, -1:]
        return self.lm_head(self.norm(x))


def rope_tables(cfg: ModelConfig, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for rotate-half RoPE, (length, head_dim), float32."""
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    angles = torch.outer(torch.arange(length, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float(), angles.sin().float()


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _parts(weights: Weights, prefix: str, fmt: str) -> Weights:
    if fmt not in FORMAT_SUFFIXES:
        raise ArtifactError(f"unknown weight format {fmt!r} for {prefix}")
    try:
        return {suffix: weights[f"{prefix}.{suffix}"] for suffix in FORMAT_SUFFIXES[fmt]}
    except KeyError as exc:
        raise ArtifactError(f"artifact weights lack {exc.args[0]} (format {fmt})") from None
