"""convert(): source model → quantized, self-describing, checksummed artifact folder (atomically)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch

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
from edgellm.convert.partial import PartialFolder, remove_stale
from edgellm.convert.source import SourceModel
from edgellm.convert.weight_formats import GROUP_SIZE, weight_formats
from edgellm.convert.defaults import DEFAULT_CONTEXT_WINDOW, DEFAULT_PREFILL_CHUNK
from edgellm.errors import EdgeLLMError, ModelNotFoundError
from edgellm.progress import bar
from edgellm.quant.formats import BLOCK_WEIGHTS, ROW_GROUP, dequantize, interleave, quantize
from edgellm.families.config import check_kv_kind
from edgellm.quant.schemes import DEFAULT_SCHEME, SOURCE_SCHEME, get_scheme


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

    source = read_gguf(pull(entry.name), name=entry.name, sha256=entry.sha256)
    return dataclasses.replace(source, sampling=dataclasses.replace(source.sampling, **entry.sampling))


def _quantize(source: SourceModel, name: str, tensor: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The parts of ``tensor`` in ``fmt``: the source's own blocks when they hold it exactly (verified
    value for value), else quantized."""
    blocks = source.load_blocks(name, fmt) if fmt in BLOCK_WEIGHTS and tensor.shape[0] % ROW_GROUP == 0 else None
    if blocks is not None:
        stored = interleave(blocks, fmt)
        if torch.equal(dequantize({"qweight": stored}, fmt), tensor):
            return {"qweight": stored}
    return quantize(tensor, fmt)


def convert(
    src: str | Path | SourceModel,
    output: str | Path,
    *,
    quantization: str | None = None,
    context_window: int | None = None,
    prefill_chunk_size: int = DEFAULT_PREFILL_CHUNK,
    overrides: dict[str, str] | None = None,
    force: bool = False,
    progress: bool = True,
    kv_cache: str | None = None,
) -> Path:
    """Compile a source model into an artifact folder at `output`; returns the folder.

    `quantization` is a scheme name; by default `source` (the GGUF's own blocks) for a GGUF, q4f16_1 otherwise.

    `kv_cache` is the KV cache kind the runtime defaults to: by default f16 (llama.cpp's default: half of
    f32's memory; logits move by ~1e-3 of their spread), f32 for q0f32, the all-float32 reference scheme."""
    out = Path(output).expanduser()
    if out.exists() and not force:
        raise EdgeLLMError(f"{out} already exists; pass force=True (--force) to replace it")
    if quantization is not None:
        get_scheme(quantization)
    source = src if isinstance(src, SourceModel) else open_source(src)
    quantization = quantization or (SOURCE_SCHEME if source.info.kind == "gguf" else DEFAULT_SCHEME)
    formats = weight_formats(source.config, quantization, overrides,
                             source.exact_formats if source.info.kind == "gguf" else None)
    window = context_window or min(source.config.max_position_embeddings, DEFAULT_CONTEXT_WINDOW)
    if not 0 < window <= source.config.max_position_embeddings:
        raise EdgeLLMError(
            f"context window {window} is outside 1..{source.config.max_position_embeddings} (the model's maximum)"
        )
    if prefill_chunk_size < 1:
        raise EdgeLLMError("prefill chunk size must be at least 1")
    kv_cache = check_kv_kind(kv_cache or ("f32" if quantization == "q0f32" else "f16"))
    config = ArtifactConfig(
        model=source.config,
        tokenizer=source.tokenizer,
        quantization=QuantizationConfig(scheme=quantization, group_size=GROUP_SIZE, formats=formats),
        context_window=window,
        prefill_chunk_size=min(prefill_chunk_size, window),
        sampling=source.sampling,
        source=source.info,
        edgellm_version=__version__,
        kv_cache=kv_cache,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(out)  # what interrupted conversions to `out` left behind
    with PartialFolder(out) as partial:
        try:
            _write(partial.path, source, config, progress)
            _replace_dir(partial.path, out)
        except BaseException:
            shutil.rmtree(partial.path, ignore_errors=True)
            raise
    return out


def shard_group(tensor_name: str) -> str:
    """One shard per transformer layer (`model.layers.7`), one for the rest (embeddings, final norm, lm_head)."""
    parts = tensor_name.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["model", "layers"] else "global"


def _write(folder: Path, source: SourceModel, config: ArtifactConfig, progress: bool) -> None:
    shards = ShardWriter(folder)
    params = weight_bytes = 0
    formats = config.quantization.formats
    for name in bar(source.tensor_names, desc=f"converting to {config.quantization.scheme}", unit="tensor",
                    enabled=progress):
        tensor = source.load_tensor(name)
        params += tensor.numel()
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix in formats:
            parts = {f"{prefix}.{k}": v for k, v in _quantize(source, name, tensor, formats[prefix]).items()}
        else:  # norms and biases stay float32
            parts = {name: tensor.float()}
        for key, value in parts.items():
            shards.add(key, value, group=shard_group(key))
            weight_bytes += value.numel() * value.element_size()
    shards.flush()
    (folder / TOKENIZER_FILE).write_text(source.tokenizer_json, encoding="utf-8")
    files = [*shards.files, TOKENIZER_FILE, CONFIG_FILE]
    if source.chat_template:
        (folder / CHAT_TEMPLATE_FILE).write_text(source.chat_template, encoding="utf-8")
        files.append(CHAT_TEMPLATE_FILE)
    (folder / CONFIG_FILE).write_text(config.to_json(), encoding="utf-8")
    Manifest.build(folder, files, params, weight_bytes, source.tuning).write(folder)


def _replace_dir(tmp: Path, out: Path) -> None:
    """Move the finished folder into place; an existing artifact is swapped out only after success, in one atomic
    exchange where the OS has one, so a kill at any moment leaves the old artifact or the new one at `out`."""
    if not out.exists():
        os.replace(tmp, out)
        return
    if _exchange(tmp, out):
        shutil.rmtree(tmp, ignore_errors=True)  # now holds the old artifact
        return
    backup = out.with_name(f".{out.name}.old-{os.getpid()}")
    os.replace(out, backup)
    os.replace(tmp, out)
    shutil.rmtree(backup, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths (Linux renameat2 RENAME_EXCHANGE); False where that is not available."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0

