"""Weight shards: written with safetensors, read back zero-copy through a copy-on-write mmap (as torch tensors,
or as numpy arrays where the process runs without torch)."""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from edgellm.errors import ArtifactError
from edgellm.families.tensor_specs import TensorSpec

if TYPE_CHECKING:  # reading needs no torch: an inference process on the native kernels never imports it
    import torch

SHARD_PATTERN = "weights-{index:05d}.safetensors"

NUMPY_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8, "U8": np.uint8,
                "I32": np.int32, "I64": np.int64}
DTYPE_SIZES = {name: np.dtype(t).itemsize for name, t in NUMPY_DTYPES.items()}
# safetensors' dtype names as numpy (and torch, less its "torch." prefix) name the element types
DTYPE_NAMES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "I8": "int8", "U8": "uint8", "I32": "int32",
               "I64": "int64"}


class ShardWriter:
    """Collects tensors and flushes a new shard file whenever the current one reaches `max_bytes` or the
    tensor's group changes.

    Groups (one per transformer layer, in the converter) keep an update that re-quantizes a few layers
    down to a few changed files: a delta update then fetches only those shards.
    """

    def __init__(self, folder: Path, max_bytes: int = 512 << 20) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.files: list[str] = []
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._group: str | None = None

    def add(self, name: str, tensor: torch.Tensor, group: str | None = None) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and (self._pending_bytes + nbytes > self.max_bytes or group != self._group):
            self.flush()
        self._group = group
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes

    def flush(self) -> None:
        if not self._pending:
            return
        from safetensors.torch import save_file

        name = SHARD_PATTERN.format(index=len(self.files) + 1)
        save_file(self._pending, str(self.folder / name), metadata={"format": "pt"})
        self.files.append(name)
        self._pending, self._pending_bytes = {}, 0


def map_shard(path: Path) -> mmap.mmap:
    """Map a safetensors file into memory, private: its tensors share the file's pages until written."""
    with path.open("rb") as fh:
        try:
            return mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        except ValueError:
            raise ArtifactError(f"weight shard {path.name} is empty") from None


@dataclass(frozen=True)
class ShardEntry:
    """One tensor of a safetensors file: its dtype name, where its bytes lie in the file, its shape, the file."""

    name: str
    dtype: str  # safetensors' name: "F32", "F16", "BF16", "I8", "U8", "I32", "I64"
    start: int
    count: int  # elements
    shape: tuple[int, ...]
    shard: str  # the file's name

    @property
    def spec(self) -> TensorSpec:
        """Its element type and shape, as families/tensor_specs.py describes what a model reads."""
        return TensorSpec(DTYPE_NAMES[self.dtype], self.shape)


def shard_entries(mm: mmap.mmap, name: str) -> list[ShardEntry]:
    """The tensors a safetensors file held in ``mm`` declares, checked to lie inside its data; ``name`` for errors."""
    try:
        (header_len,) = struct.unpack("<Q", mm[:8])
        header = json.loads(mm[8 : 8 + header_len])
    except (struct.error, json.JSONDecodeError, UnicodeDecodeError):
        raise ArtifactError(f"weight shard {name} has a malformed safetensors header") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"weight shard {name} has a malformed safetensors header")
    base = 8 + header_len
    entries = []
    for tensor, info in header.items():
        if tensor == "__metadata__":
            continue
        try:
            size = DTYPE_SIZES[info["dtype"]]
            start, end = (base + int(x) for x in info["data_offsets"])
            shape = tuple(int(d) for d in info["shape"])
        except (KeyError, TypeError, ValueError, OverflowError):
            raise ArtifactError(f"weight shard {name}: unsupported entry for tensor {tensor!r}") from None
        if end > len(mm) or start > end or start < base:
            raise ArtifactError(f"weight shard {name}: tensor {tensor!r} lies outside the file's data")
        count = (end - start) // size
        if (end - start) % size or any(d < 0 for d in shape) or math.prod(shape) != count:
            raise ArtifactError(f"weight shard {name}: tensor {tensor!r} has {end - start} bytes of {info['dtype']}"
                                f", which do not make shape {list(shape)}")
        entries.append(ShardEntry(tensor, info["dtype"], start, count, shape, name))
    return entries


def shard_tensors(mm: mmap.mmap, name: str, entries: list[ShardEntry] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``mm`` as torch tensors (views of it, nothing copied): those of
    `entries`, its shard_entries already read, else all it declares."""
    import torch

    dtypes = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I8": torch.int8,
              "U8": torch.uint8, "I32": torch.int32, "I64": torch.int64}
    return {e.name: (torch.frombuffer(mm, dtype=dtypes[e.dtype], count=e.count, offset=e.start) if e.count
                     else torch.empty(0, dtype=dtypes[e.dtype])).reshape(e.shape)
            for e in (shard_entries(mm, name) if entries is None else entries)}


def shard_arrays(mm: mmap.mmap, name: str, entries: list[ShardEntry] | None = None) -> dict[str, np.ndarray]:
    """The same tensors as numpy arrays (views of ``mm``), for a process that runs without torch; numpy has no
    bfloat16, so BF16 tensors come as uint16 bit patterns."""
    return {e.name: np.frombuffer(mm, dtype=NUMPY_DTYPES[e.dtype], count=e.count, offset=e.start).reshape(e.shape)
            for e in (shard_entries(mm, name) if entries is None else entries)}
