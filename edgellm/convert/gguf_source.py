"""Read a GGUF file (llama.cpp's format) as a SourceModel: hyper-parameters, tokenizer, dequantized tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from edgellm.artifact.config import SUPPORTED_ARCHITECTURES, ModelConfig, SamplingDefaults, SourceInfo, TokenizerConfig
from edgellm.artifact.manifest import sha256_file
from edgellm.convert.gguf_tokenizer import read_gguf_tokenizer
from edgellm.convert.source import SourceModel, expected_tensor_names
from edgellm.errors import UnsupportedModelError

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_name(gguf_name: str) -> str | None:
    """Map a GGUF tensor name to its Hugging Face name (None for tensors the runtime does not use)."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"
    return None


def _field(reader: GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _model_config(reader: GGUFReader, tensor_names: set[str]) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(f"RoPE scaling {scaling!r} is not supported yet")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(_field(reader, f"{arch}.feed_forward_length")),
        num_hidden_layers=int(_field(reader, f"{arch}.block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(_field(reader, f"{arch}.context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
    )


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs → Hugging Face's rotate-half layout)."""
    rows, *rest = w.shape
    return w.reshape(heads, rows // heads // 2, 2, *rest).transpose(1, 2).reshape(w.shape)


# GGUF block types whose values edgellm's block formats hold exactly: Q4_1 is el_block_q4 byte for
# byte and Q8_0 is el_block_q8; Q4_0 (d * (q - 8)) is q4 with m = -8 d, and Q4_0 / Q5_0 are q8 with
# the same d and q - 8 / q - 16.
_EXACT = {
    GGMLQuantizationType.Q4_1: ("q4",),
    GGMLQuantizationType.Q8_0: ("q8",),
    GGMLQuantizationType.Q4_0: ("q4", "q8"),
    GGMLQuantizationType.Q5_0: ("q8",),
}


def _blocks(raw: torch.Tensor, qtype: GGMLQuantizationType, fmt: str, values: torch.Tensor) -> torch.Tensor:
    """Block rows in ``fmt`` from a GGUF tensor's raw bytes [rows, row bytes] and its float values."""
    rows, cols = values.shape
    if (qtype, fmt) in ((GGMLQuantizationType.Q4_1, "q4"), (GGMLQuantizationType.Q8_0, "q8")):
        return raw
    nb = cols // 32
    blk = raw.view(rows, nb, -1)
    d_bytes = blk[..., :2]
    if fmt == "q4":  # Q4_0: d, 16 nibble bytes (same nibble order as el_block_q4)
        m = -8.0 * d_bytes.contiguous().view(torch.float16).float()
        m_bytes = m.half().view(torch.uint8).view(rows, nb, 2)
        return torch.cat((d_bytes, m_bytes, blk[..., 2:]), dim=-1).view(rows, -1)
    d = d_bytes.contiguous().view(torch.float16).float()  # Q4_0 / Q5_0 as q8: q = w / d, small integers
    q = torch.where(d != 0, values.view(rows, nb, 32) / torch.where(d != 0, d, 1.0), 0.0).round_()
    return torch.cat((d_bytes, q.clamp_(-127, 127).to(torch.int8).view(torch.uint8)), dim=-1).view(rows, -1)


def read_gguf(path: Path, *, name: str | None = None, sha256: str | None = None) -> SourceModel:
    """Open a GGUF file; tensors are dequantized to float32 only when asked for."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {exc}") from None
    by_hf_name = {}
    for tensor in reader.tensors:
        mapped = hf_name(tensor.name)
        if mapped is not None:
            by_hf_name[mapped] = tensor
    config = _model_config(reader, {t.name for t in reader.tensors})
    missing = [n for n in expected_tensor_names(config) if n not in by_hf_name]
    if missing:
        raise UnsupportedModelError(f"{path.name} lacks {len(missing)} expected tensors, e.g. {missing[0]}")
    tok = read_gguf_tokenizer(reader)

    def in_hf_order(hf: str, rows: torch.Tensor) -> torch.Tensor:
        if config.architecture == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            return _unpermute(rows, config.num_attention_heads if "q_proj" in hf else config.num_key_value_heads)
        return rows

    def gguf_values(hf: str) -> torch.Tensor:
        tensor = by_hf_name[hf]
        array = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy data is already (rows, cols) = (out, in).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a private, writable copy

    def load(hf: str) -> torch.Tensor:
        return in_hf_order(hf, gguf_values(hf))

    def exact_formats(hf: str) -> tuple[str, ...]:
        return _EXACT.get(by_hf_name[hf].tensor_type, ())

    def load_blocks(hf: str, fmt: str) -> torch.Tensor | None:
        if fmt not in exact_formats(hf):
            return None
        tensor, values = by_hf_name[hf], gguf_values(hf)
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).view(values.shape[0], -1)
        return in_hf_order(hf, _blocks(raw, tensor.tensor_type, fmt, values))

    return SourceModel(
        info=SourceInfo(kind="gguf", name=name or path.name, sha256=sha256 or sha256_file(path)),
        config=config,
        tokenizer_json=tok.tokenizer_json,
        tokenizer=TokenizerConfig(
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            add_bos_token=tok.add_bos_token,
            stop_token_ids=tuple(tok.stop_token_ids),
        ),
        chat_template=tok.chat_template,
        sampling=SamplingDefaults(),
        tensor_names=tuple(expected_tensor_names(config)),
        load_tensor=load,
        exact_formats=exact_formats,
        load_blocks=load_blocks,
    )
