"""Crafted artifacts for the tests of families/tensor_specs.py: a good tiny artifact with one tensor replaced, one
shard cut short or one header offset moved, and the manifest rewritten to match (so every checksum passes, as it
would for an artifact made that way on purpose); and a child process that loads one."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np

from edgellm.artifact.manifest import Manifest

# The child: load FOLDER on RUNTIME, generate two tokens. Exit 0 when it ran, 3 (message on stderr) for a typed
# edgellm error; anything else (a traceback's 1, a signal's negative status) is a failure of the checks.
LOAD_SCRIPT = """
import sys
from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.runtime.engine import Engine
try:
    engine = Engine.load(sys.argv[1], runtime=sys.argv[2], progress=False, threads=1, huge_pages="off")
    list(engine.stream([1, 2, 3], GenerationParams(max_tokens=2, temperature=0.0)))
except EdgeLLMError as exc:
    print(exc, file=sys.stderr)
    sys.exit(3)
"""


def load_in_child(folder: Path, runtime: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run LOAD_SCRIPT on `folder` in a fresh interpreter (a crash there cannot take the test run with it)."""
    return subprocess.run([sys.executable, "-c", LOAD_SCRIPT, str(folder), runtime], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"PYTHONPATH": str(Path(__file__).parents[2])})


def reseal(folder: Path) -> None:
    """Rewrite manifest.json to match the files as they are now."""
    m = Manifest.read(folder)
    weight_bytes = round(m.bits_per_parameter * m.parameter_count / 8)
    Manifest.build(folder, list(m.files), m.parameter_count, weight_bytes).write(folder)


def read_header(shard: Path) -> tuple[dict, bytes]:
    """A safetensors file's header and its data."""
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + length]), data[8 + length:]


def write_header(shard: Path, header: dict, body: bytes) -> None:
    encoded = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(encoded)) + encoded + body)


def shard_of(folder: Path, tensor: str) -> Path:
    """The shard that holds `tensor`."""
    for shard in sorted(folder.glob("weights-*.safetensors")):
        if tensor in read_header(shard)[0]:
            return shard
    raise KeyError(tensor)


def replace_tensor(folder: Path, tensor: str, array: np.ndarray) -> None:
    """Put `array` in place of `tensor` (its shard rewritten whole), then reseal."""
    from safetensors.numpy import load_file, save_file

    shard = shard_of(folder, tensor)
    tensors = load_file(str(shard))
    tensors[tensor] = np.ascontiguousarray(array)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    reseal(folder)


def truncate_shard(folder: Path, tensor: str, cut: int) -> None:
    """Drop the last `cut` bytes of the shard holding `tensor`, then reseal (its header now overshoots the data)."""
    shard = shard_of(folder, tensor)
    data = shard.read_bytes()
    shard.write_bytes(data[:-cut])
    reseal(folder)


def move_offset(folder: Path, tensor: str, extra: int) -> None:
    """Move the end of `tensor`'s data `extra` bytes further in its shard header, then reseal."""
    shard = shard_of(folder, tensor)
    header, body = read_header(shard)
    start, end = header[tensor]["data_offsets"]
    header[tensor]["data_offsets"] = [start, end + extra]
    write_header(shard, header, body)
    reseal(folder)
