"""A GGUF file's header alone: metadata scalars and short arrays, and each tensor's name and block type.

The memory planner needs the hyper-parameters of catalog models it may switch to, not their
vocabularies: ``gguf.GGUFReader`` parses every metadata array into objects (for a 150k-token
vocabulary with its merges, about 15 s), while this reader steps over long arrays by their lengths
and reads no tensor data (tens of milliseconds). Layout (GGUF v2/v3, little-endian): magic, version,
tensor count, metadata count; metadata as (key, type, value); tensor infos as (name, dims, type, offset).
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgellm.errors import UnsupportedModelError

LONG_ARRAY = 4096  # arrays longer than this (vocabularies, merges, scores) are counted, not read
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFHeader:
    fields: dict[str, Any]  # metadata values; arrays longer than LONG_ARRAY are absent (see array_lengths)
    array_lengths: dict[str, int]  # the item count of every array field
    tensor_types: dict[str, int]  # tensor name -> GGML block type (gguf.GGMLQuantizationType's value)
    tensor_elements: dict[str, int]  # tensor name -> number of weights (the product of its dims)


class _Cursor:
    def __init__(self, buf: mmap.mmap) -> None:
        self.buf, self.at = buf, 0

    def unpack(self, fmt: str) -> Any:
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.at)
        self.at += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        self.at += n
        if self.at > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        return self.buf[self.at - n : self.at].decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("Q")  # first: `self.at += self.unpack(...)` would add to the offset before the length
        self.at += n

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        return self.unpack(_SCALARS[kind])


def read_gguf_header(path: Path) -> GGUFHeader:
    """The header of the GGUF file at `path`; UnsupportedModelError when it is not one."""
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _parse(_Cursor(buf))
    except (OSError, ValueError, KeyError, struct.error) as exc:
        raise UnsupportedModelError(f"{path} is not a readable GGUF file: {type(exc).__name__}: {exc}") from None


def _parse(cur: _Cursor) -> GGUFHeader:
    if cur.buf[:4] != b"GGUF":
        raise ValueError("no GGUF magic")
    cur.at = 4
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"GGUF version {version}")
    n_tensors, n_fields = cur.unpack("Q"), cur.unpack("Q")
    fields: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for _ in range(n_fields):
        key, kind = cur.string(), cur.unpack("I")
        if kind != _ARRAY:
            fields[key] = cur.value(kind)
            continue
        item, count = cur.unpack("I"), cur.unpack("Q")
        lengths[key] = count
        if count <= LONG_ARRAY:
            fields[key] = [cur.value(item) for _ in range(count)]
        elif item == _STRING:
            for _ in range(count):
                cur.skip_string()
        else:
            cur.at += count * struct.calcsize(_SCALARS[item])
    types, elements = {}, {}
    for _ in range(n_tensors):
        name, dims = cur.string(), cur.unpack("I")
        elements[name] = math.prod(cur.unpack("Q") for _ in range(dims))
        types[name] = cur.unpack("I")
        cur.at += 8  # data offset
    return GGUFHeader(fields, lengths, types, elements)
