"""convert(): source model → quantized, self-describing, checksummed artifact folder (atomically)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tqdm import tqdm

from edgellm import __version__
from edgellm.artifact.config import (
    CHAT_TEMPLATE_FILE,
    CONFIG_FILE,
    TOKENIZER_FILE,
    ArtifactConfig,
    QuantizationConfig,
)
from edgellm.artifact.manifest import Manifest
from edgellm.artifact.tensors import ShardWriter
from edgellm.convert.source import SourceModel
from edgellm.errors import EdgeLLMError, ModelNotFoundError, UnsupportedQuantizationError
from edgellm.quant.formats import check_format, quantize
from edgellm.quant.schemes import get_scheme
from edgellm.runtime.kv_cache import KV_KINDS

DEFAULT_CONTEXT_WINDOW = 4096
DEFAULT_PREFILL_CHUNK = 512
_GROUP_SIZE = 32
_PRECISION = ("q4", "q8", "f16", "f32")  # low → high


def open_source(src: str | Path) -> SourceModel:
    """A GGUF file, a Hugging Face folder, or a catalog name (pulled on demand)."""
    path = Path(src).expanduser()
    if path.is_file():
        from edgellm.convert.gguf_source import read_gguf

        return read_gguf(path)
    if path.is_dir():
        from edgellm.convert.hf_source import read_hf

        return read_hf(path)
    from edgellm.catalog import CATALOG, get_entry
    from edgellm.pull import pull

    if str(src) not in CATALOG and ("/" in str(src) or path.suffix):
        raise ModelNotFoundError(f"no such file or folder: {src}")
    entry = get_entry(str(src))
    from edgellm.convert.gguf_source import read_gguf

    return read_gguf(pull(entry.name), name=entry.name, sha256=entry.sha256)


def weight_formats(source: SourceModel, scheme_name: str, overrides: dict[str, str] | None = None) -> dict[str, str]:
    """Storage format of every matmul/embedding weight, by Hugging Face prefix."""
    scheme = get_scheme(scheme_name)
    cfg = source.config
    shapes = cfg.matmul_weight_shapes()
    formats = dict.fromkeys(shapes, scheme.linear)
    if cfg.tie_word_embeddings:  # one tensor serves both roles: keep the more precise of the two formats
        formats["model.embed_tokens"] = max(scheme.embedding, scheme.lm_head, key=_PRECISION.index)
    else:
        formats["model.embed_tokens"] = scheme.embedding
        formats["lm_head"] = scheme.lm_head
    for prefix, fmt in (overrides or {}).items():
        if prefix not in formats:
            raise UnsupportedQuantizationError(f"override names {prefix!r}, which is not a weight of this model")
        check_format(fmt)
        formats[prefix] = fmt
    for prefix, fmt in formats.items():  # 4-bit groups need the input dim to be a multiple of 32
        if fmt == "q4" and shapes[prefix][1] % _GROUP_SIZE:
            formats[prefix] = "f16"
    return formats


def convert(
    src: str | Path | SourceModel,
    output: str | Path,
    *,
    quantization: str = "q4f16_1",
    context_window: int | None = None,
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK,
    overrides: dict[str, str] | None = None,
    force: bool = False,
    progress: bool = True,
    kv_cache: str = "f32",
) -> Path:
    """Compile a source model into an artifact folder at `output`; returns the folder."""
    out = Path(output).expanduser()
    if out.exists() and not force:
        raise EdgeLLMError(f"{out} already exists; pass force=True (--force) to replace it")
    get_scheme(quantization)
    source = src if isinstance(src, SourceModel) else open_source(src)
    formats = weight_formats(source, quantization, overrides)
    window = context_window or min(source.config.max_position_embeddings, DEFAULT_CONTEXT_WINDOW)
    if not 0 < window <= source.config.max_position_embeddings:
        raise EdgeLLMError(
            f"context window {window} is outside 1..{source.config.max_position_embeddings} (the model's maximum)"
        )
    if prefill_chunk_size < 1:
        raise EdgeLLMError("prefill chunk size must be at least 1")
    if kv_cache not in KV_KINDS:
        raise EdgeLLMError(f"unknown KV cache kind {kv_cache!r}; known kinds: {', '.join(KV_KINDS)}")
    config = ArtifactConfig(
        model=source.config,
        tokenizer=source.tokenizer,
        quantization=QuantizationConfig(scheme=quantization, group_size=_GROUP_SIZE, formats=formats),
        context_window=window,
        prefill_chunk_size=min(prefill_chunk_size, window),
        sampling=source.sampling,
        source=source.info,
        edgellm_version=__version__,
        kv_cache=kv_cache,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        _write(tmp, source, config, progress)
        _replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write(folder: Path, source: SourceModel, config: ArtifactConfig, progress: bool) -> None:
    shards = ShardWriter(folder)
    params = weight_bytes = 0
    formats = config.quantization.formats
    bar = tqdm(source.tensor_names, desc=f"converting to {config.quantization.scheme}", unit="tensor",
               disable=not progress, leave=False)
    for name in bar:
        tensor = source.load_tensor(name)
        params += tensor.numel()
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in formats:
            parts = {f"{prefix}.{k}": v for k, v in quantize(tensor, formats[prefix]).items()}
        else:  # norms and biases stay float32
            parts = {name: tensor.float()}
        for key, value in parts.items():
            shards.add(key, value)
            weight_bytes += value.numel() * value.element_size()
    shards.flush()
    (folder / TOKENIZER_FILE).write_text(source.tokenizer_json, encoding="utf-8")
    files = [*shards.files, TOKENIZER_FILE, CONFIG_FILE]
    if source.chat_template:
        (folder / CHAT_TEMPLATE_FILE).write_text(source.chat_template, encoding="utf-8")
        files.append(CHAT_TEMPLATE_FILE)
    (folder / CONFIG_FILE).write_text(config.to_json(), encoding="utf-8")
    Manifest.build(folder, files, params, weight_bytes).write(folder)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an existing artifact is swapped out only after success."""
    if not out.exists():
        os.replace(tmp, out)
        return
    backup = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, backup)
    os.replace(tmp, out)
    shutil.rmtree(backup, ignore_errors=True)

