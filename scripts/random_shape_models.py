"""Random-weight models in real architectures' shapes, written as F16 GGUF files for benchmarks past 0.5B.

    python scripts/random_shape_models.py llama3.2-1b /tmp/shapes        # -> /tmp/shapes/llama3.2-1b-f16.gguf
    python scripts/random_shape_models.py --list

The shape comes from a `transformers` config (Llama-3.2-1B / -3B, Qwen2.5-1.5B as published); the model is built
on the meta device, so transformers names every parameter and its shape without allocating it, and each tensor
is then drawn as transformers' own `_init_weights` draws it -- linears and the embedding normal(0, 0.02)
(`initializer_range`), biases 0, RMSNorm weights 1 -- in float32 row blocks and stored as float16, one tensor at a
time (a 3B model never exists in memory whole). The tokenizer is a catalog model's real one, copied from its GGUF
(`tokenizer.*` metadata); where the shape's vocabulary is larger (Llama 3's 128256 rows against SmolLM2's 49152
tokens) the table is padded with unused `[PAD<id>]` entries, as llama.cpp's converter pads a short vocabulary, so
the embedding and output matrices keep the published shape and every byte a real model streams per token.

Not the published models: Llama 3.2's rope scaling (`rope_freqs`) is left out (it changes no byte streamed per
token), and Q/K rows are not permuted (there is no Hugging Face checkpoint these weights must match). The files are
for speed and size: quantize them with llama.cpp's `llama-quantize F16.gguf OUT.gguf Q4_K_M`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

ROW_BLOCK = 4096  # rows drawn at a time: a float32 block of at most 4096 x 8960 values (147 MB)
STD = 0.02  # initializer_range of all three published configs


@dataclass(frozen=True)
class Shape:
    """One architecture's published shape and the catalog model whose tokenizer it borrows."""

    arch: str  # "llama" or "qwen2" (transformers' model type and GGUF architecture name alike)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tokenizer_from: str  # catalog name whose GGUF lends its tokenizer


SHAPES: dict[str, Shape] = {
    # meta-llama/Llama-3.2-1B config.json (tied embeddings): 1,235,814,400 parameters
    "llama3.2-1b": Shape("llama", 128256, 2048, 8192, 16, 32, 8, 64, 500000.0, 1e-5, 131072, "smollm2-135m"),
    # meta-llama/Llama-3.2-3B config.json (tied embeddings): 3,212,749,824 parameters
    "llama3.2-3b": Shape("llama", 128256, 3072, 8192, 28, 24, 8, 128, 500000.0, 1e-5, 131072, "smollm2-135m"),
    # Qwen/Qwen2.5-1.5B config.json (tied embeddings, q/k/v biases): 1,543,714,304 parameters
    "qwen2.5-1.5b": Shape("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, 1000000.0, 1e-6, 32768,
                          "qwen2.5-coder-0.5b"),
}


def transformers_config(shape: Shape):  # -> transformers.PretrainedConfig
    """The shape as a transformers config (tied embeddings, as all three published models)."""
    import transformers

    common = dict(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                  intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_hidden_layers,
                  num_attention_heads=shape.num_attention_heads, num_key_value_heads=shape.num_key_value_heads,
                  rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps,
                  max_position_embeddings=shape.max_position_embeddings, tie_word_embeddings=True,
                  initializer_range=STD)
    if shape.arch == "llama":
        return transformers.LlamaConfig(head_dim=shape.head_dim, **common)
    return transformers.Qwen2Config(**common)


def parameter_shapes(shape: Shape) -> list[tuple[str, tuple[int, ...]]]:
    """transformers' own parameter names and shapes for the config, from a model built on the meta device."""
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers_config(shape))
    return [(name, tuple(p.shape)) for name, p in model.named_parameters()]  # tied lm_head listed once


def _matrix(dims: tuple[int, ...], rng: np.random.Generator, std: float) -> np.ndarray:
    """A float16 matrix drawn normal(0, std) as transformers' `_init_weights` draws linears and embeddings,
    in float32 blocks of `ROW_BLOCK` rows."""
    matrix = np.empty(dims, dtype=np.float16)
    for start in range(0, dims[0], ROW_BLOCK):
        block = rng.standard_normal((min(ROW_BLOCK, dims[0] - start), *dims[1:]), dtype=np.float32)
        block *= std
        matrix[start:start + block.shape[0]] = block
    return matrix


def _vector(hf_name: str, dims: tuple[int, ...]) -> np.ndarray:
    """A 1-D parameter as transformers initializes it: biases 0, RMSNorm weights 1 (float32, as GGUF keeps them)."""
    return np.zeros(dims, dtype=np.float32) if hf_name.endswith(".bias") else np.ones(dims, dtype=np.float32)


def _copy_tokenizer(writer: gguf.GGUFWriter, source: Path, vocab_size: int) -> None:
    """The source GGUF's `tokenizer.*` metadata, its token table padded with unused entries to `vocab_size`."""
    reader = gguf.GGUFReader(source)
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        value = field.contents()
        if key == "tokenizer.ggml.tokens":
            if len(value) > vocab_size:
                raise SystemExit(f"{source.name} has {len(value)} tokens, more than the shape's {vocab_size} rows")
            value = value + [f"[PAD{i}]" for i in range(len(value), vocab_size)]
        elif key == "tokenizer.ggml.token_type":
            value = value + [int(gguf.TokenType.UNUSED)] * (vocab_size - len(value))
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub_type=sub)


def write_f16_gguf(shape: Shape, name: str, tokenizer_gguf: Path, out: Path, *, seed: int = 0) -> Path:
    """Write `out` (F16 matrices, F32 norms and biases) tensor by tensor; returns `out`."""
    arch = gguf.MODEL_ARCH.LLAMA if shape.arch == "llama" else gguf.MODEL_ARCH.QWEN2
    names = gguf.get_tensor_name_map(arch, shape.num_hidden_layers)
    params = parameter_shapes(shape)
    writer = gguf.GGUFWriter(out, shape.arch)
    writer.add_name(f"{name} (random weights, std 0.02)")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(shape.num_hidden_layers)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    _copy_tokenizer(writer, tokenizer_gguf, shape.vocab_size)
    planned = []
    for hf_name, dims in params:
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if gguf_name is None:
            raise SystemExit(f"gguf-py has no GGUF name for {hf_name}")
        dtype = np.float32 if len(dims) == 1 else np.float16
        writer.add_tensor_info(gguf_name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
        planned.append((hf_name, dims))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for hf_name, dims in planned:  # one tensor in memory at a time
        writer.write_tensor_data(_vector(hf_name, dims) if len(dims) == 1 else _matrix(dims, rng, STD))
    writer.close()
    return out


def catalog_gguf(catalog_name: str) -> Path:
    """The pulled catalog model's source GGUF (`edgellm pull NAME` first)."""
    from edgellm.paths import sources_dir

    folder = sources_dir() / catalog_name
    files = sorted(folder.glob("*.gguf")) if folder.is_dir() else []
    if not files:
        raise SystemExit(f"no GGUF under {folder}: run edgellm pull {catalog_name} first")
    return files[0]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    p.add_argument("out_dir", nargs="?", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--list", action="store_true", help="print the shapes and their parameter counts")
    args = p.parse_args(argv)
    if args.list:
        for name, shape in SHAPES.items():
            total = sum(int(np.prod(d)) for _, d in parameter_shapes(shape))
            print(f"{name:14s} {shape.arch:6s} {total:>14,d} parameters, tokenizer of {shape.tokenizer_from}")
        return 0
    if args.shape is None or args.out_dir is None:
        p.error("give SHAPE and OUT_DIR (or --list)")
    shape = SHAPES[args.shape]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    out = write_f16_gguf(shape, args.shape, catalog_gguf(shape.tokenizer_from), args.out_dir / f"{args.shape}-f16.gguf",
                         seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
