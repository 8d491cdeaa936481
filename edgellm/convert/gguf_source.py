"""Read a GGUF file (llama.cpp's format) as a SourceModel: hyper-parameters, tokenizer, dequantized tensors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
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


def _check_shapes(path: Path, config: ModelConfig, tensors: dict[str, Any]) -> None:
    """Every tensor the model needs has the shape its hyper-parameters imply (before any byte is dequantized)."""
    want = {f"{prefix}.weight": shape for prefix, shape in config.matmul_weight_shapes().items()}
    for name in expected_tensor_names(config):
        if name.endswith("norm.weight"):
            want[name] = (config.hidden_size,)
        elif name.endswith(".bias"):
            want[name] = (want[name.removesuffix(".bias") + ".weight"][0],)
    for name, shape in want.items():
        if name in tensors:
            actual = tuple(int(d) for d in reversed(tensors[name].shape.tolist()))
            if actual != shape:
                raise UnsupportedModelError(f"{path.name}: tensor {name} has shape {actual}, the metadata implies "
                                            f"{shape}")


def read_gguf(path: Path, *, name: str | None = None, sha256: str | None = None) -> SourceModel:
    """Open a GGUF file; tensors are dequantized to float32 only when asked for."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, TypeError, OverflowError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None
    by_hf_name = {}
    for tensor in reader.tensors:
        mapped = hf_name(tensor.name)
        if mapped is not None:
            by_hf_name[mapped] = tensor
    try:  # metadata of the wrong type or out of range (None, 0 heads, a string count) is the file's fault
        config = _model_config(reader, {t.name for t in reader.tensors})
        missing = [n for n in expected_tensor_names(config) if n not in by_hf_name]
        if missing:
            raise UnsupportedModelError(f"{path.name} lacks {len(missing)} expected tensors, e.g. {missing[0]}")
        _check_shapes(path, config, by_hf_name)
        tok = read_gguf_tokenizer(reader)
    except (KeyError, TypeError, ValueError, ArithmeticError, IndexError, AttributeError) as exc:
        raise UnsupportedModelError(f"{path.name} has malformed GGUF metadata: {type(exc).__name__}: {exc}") from None

    def load(hf: str) -> torch.Tensor:
        tensor = by_hf_name[hf]
        array = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy data is already (rows, cols) = (out, in).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        out = torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a private, writable copy
        if config.architecture == "llama" and hf.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in hf else config.num_key_value_heads
            out = _unpermute(out, heads)
        return out

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
    )
