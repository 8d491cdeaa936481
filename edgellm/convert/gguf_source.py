"""Read a GGUF file (llama.cpp's format) as a SourceModel: hyper-parameters, tokenizer, dequantized tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

from edgellm.artifact.config import SamplingDefaults, SourceInfo, TokenizerConfig
from edgellm.artifact.manifest import sha256_file
from edgellm.convert.gguf_tokenizer import read_gguf_tokenizer
from edgellm.convert.source import SourceModel, tensor_loader
from edgellm.errors import UnsupportedModelError
from edgellm.models.family import GGUFMeta
from edgellm.models.registry import family_for_gguf


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _expected_shapes(family: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """The shape every artifact tensor must have, as the metadata implies it."""
    shapes: dict[str, tuple[int, ...]] = {f"{p}.weight": tuple(s) for p, s in family.matmul_shapes(config).items()}
    shapes |= {name: (n,) for name, n in family.vector_shapes(config).items()}
    return shapes


def read_gguf(path: Path, *, name: str | None = None, sha256: str | None = None) -> SourceModel:
    """Open a GGUF file; tensors are dequantized to float32 only when asked for."""
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, KeyError, IndexError, TypeError, OverflowError) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None
    tensors = {t.name: t for t in reader.tensors}
    try:  # metadata of the wrong type or out of range (None, 0 heads, a string count) is the file's fault
        family = family_for_gguf(_field(reader, "general.architecture"))
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        meta = GGUFMeta(family.gguf_architecture, lambda key: _field(reader, key), set(tensors),
                        len(tokens.data) if tokens is not None else 0)
        config = family.config_from_gguf(meta)
        expected = _expected_shapes(family, config)
        tok = read_gguf_tokenizer(reader)
    except (KeyError, TypeError, ValueError, ArithmeticError, IndexError, AttributeError) as exc:
        raise UnsupportedModelError(f"{path.name} has malformed GGUF metadata: {type(exc).__name__}: {exc}") from None

    def read(name: str) -> torch.Tensor:
        tensor = tensors[name]
        array = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy data is already (rows, cols) = (out, in).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a private, writable copy

    read_source = tensor_loader(path.name, family.gguf_sources(config), set(tensors), read)

    def load(name: str) -> torch.Tensor:
        tensor = family.from_gguf(name, read_source(name), config)
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise UnsupportedModelError(f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, the metadata "
                                        f"implies {want}")
        return tensor

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
        tensor_names=tuple(family.tensor_names(config)),
        load_tensor=load,
    )
