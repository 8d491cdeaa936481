"""Read a GGUF file (llama.cpp's format) as a SourceModel: hyper-parameters, tokenizer, dequantized tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from edgellm.artifact.config import SamplingDefaults, SourceInfo, TokenizerConfig
from edgellm.artifact.manifest import sha256_file
from edgellm.convert.gguf_exact import EXACT_FORMATS
from edgellm.convert.gguf_tokenizer import read_gguf_tokenizer
from edgellm.convert.source import SourceModel, tensor_loader
from edgellm.convert.tuning import gguf_tuning
from edgellm.errors import UnsupportedModelError
from edgellm.families.family import GGUFMeta
from edgellm.families.registry import family_for_gguf
from edgellm.quant.layout import SOURCE_ONLY


def _field(reader: GGUFReader, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _expected_shapes(family: Any, config: Any) -> dict[str, tuple[int, ...]]:
    """The shape every artifact tensor must have, as the metadata implies it."""
    shapes: dict[str, tuple[int, ...]] = {f"{p}.weight": tuple(s) for p, s in family.matmul_shapes(config).items()}
    shapes |= {name: (n,) for name, n in family.vector_shapes(config).items()}
    return shapes


_OWN_BLOCKS = {(GGMLQuantizationType.Q4_1, "q4"), (GGMLQuantizationType.Q8_0, "q8")} | {
    (qtype, formats[0]) for qtype, formats in EXACT_FORMATS.items() if formats[0] in SOURCE_ONLY}  # row blocks = the GGUF's


def _blocks(raw: torch.Tensor, qtype: GGMLQuantizationType, fmt: str, values: torch.Tensor) -> torch.Tensor:
    """Block rows in ``fmt`` from a GGUF tensor's raw bytes [rows, row bytes] and its float values."""
    rows, cols = values.shape
    if (qtype, fmt) in _OWN_BLOCKS:
        return raw
    nb = cols // 32
    blk = raw.view(rows, nb, -1)
    d_bytes = blk[..., :2]
    if fmt == "q4":  # Q4_0: d, 16 nibble bytes (same nibble order as el_block_q4)
        m = -8.0 * d_bytes.contiguous().view(torch.float16).float()
        m_bytes = m.half().view(torch.uint8).view(rows, nb, 2)
        return torch.cat((d_bytes, m_bytes, blk[..., 2:]), dim=-1).view(rows, -1)
    d = d_bytes.contiguous().view(torch.float16).float()  # Q4_0 / Q5_0 / IQ4_NL as q8: q = w / d, small integers
    q = torch.where(d != 0, values.view(rows, nb, 32) / torch.where(d != 0, d, 1.0), 0.0).round_()
    return torch.cat((d_bytes, q.clamp_(-127, 127).to(torch.int8).view(torch.uint8)), dim=-1).view(rows, -1)


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

    def read(gguf_name: str) -> torch.Tensor:
        tensor = tensors[gguf_name]
        array = dequantize(tensor.data, tensor.tensor_type)
        # GGUF lists dims fastest-first; numpy data is already (rows, cols) = (out, in).
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        return torch.from_numpy(np.array(array, dtype=np.float32).reshape(shape))  # a private, writable copy

    sources = family.gguf_sources(config)
    read_source = tensor_loader(path.name, sources, set(tensors), read)

    def load(name: str) -> torch.Tensor:
        tensor = family.from_gguf(name, read_source(name), config)
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != want:
            raise UnsupportedModelError(f"{path.name}: tensor {name} has shape {tuple(tensor.shape)}, the metadata "
                                        f"implies {want}")
        return tensor

    def exact_formats(name: str) -> tuple[str, ...]:
        """Block formats that hold this tensor's GGUF values exactly (none for rows of a fused tensor)."""
        src = sources.get(name)
        if src is None or src.rows is not None:
            return ()
        return EXACT_FORMATS.get(tensors[src.name].tensor_type, ())

    def load_blocks(name: str, fmt: str) -> torch.Tensor | None:
        if fmt not in exact_formats(name) or fmt in ("f16", "f32"):
            return None
        tensor = tensors[sources[name].name]
        values = read(tensor.name)
        raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).view(values.shape[0], -1)
        return family.from_gguf(name, _blocks(raw, tensor.tensor_type, fmt, values), config)  # rows as the values

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
        exact_formats=exact_formats,
        load_blocks=load_blocks,
        tuning=gguf_tuning(lambda key: _field(reader, key), path.name),
    )
