"""The memory-bandwidth roofline of decode: each decoded token reads every weight once.

decode tok/s can be at most  bandwidth / bytes-of-weights-read-per-token; the report shows the
measured decode speed as a percentage of that limit. The bandwidth is the highest that a copy probe
and a read-only probe showed over the whole run (they are repeated before every group): on a shared
host one probe can land in a busy moment, and a copy, writes included, can run below what a
read-only stream reaches — a ceiling taken from one such probe let decode exceed "100%".
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path


def memory_bandwidth(threads: int, *, size_mib: int = 256, repeats: int = 5) -> dict[str, float]:
    """Bytes/s of two streaming probes over `size_mib` MiB with `threads` torch threads, best of `repeats` each:
    "copy" (a tensor copy, read + write counted) and "read" (a sum: reads only, as decode reads its weights)."""
    import torch  # here only: the module's GGUF and artifact readers stay light

    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = size_mib * 2**20 // 4
        src = torch.ones(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)  # touch every page first
        best = {"copy": float("inf"), "read": float("inf")}
        for _ in range(repeats):
            for kind, probe in (("copy", lambda: dst.copy_(src)), ("read", src.sum)):
                t0 = time.perf_counter()
                probe()
                best[kind] = min(best[kind], time.perf_counter() - t0)
        return {"copy": 2 * n * 4 / best["copy"], "read": n * 4 / best["read"]}
    finally:
        torch.set_num_threads(previous)


def bandwidth_ceiling(probes: list[dict[str, float]]) -> float:
    """The highest bandwidth any probe showed: a measured decode speed can only sit below it."""
    return max(value for probe in probes for value in probe.values())


def _safetensors_sizes(path: Path) -> dict[str, int]:
    """Tensor name → bytes, from a safetensors header (no tensor data is read)."""
    with path.open("rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


def artifact_weight_bytes_per_token(folder: Path) -> int:
    """Bytes of an edgellm artifact's weights read per decoded token.

    Every tensor counts once, except an untied input embedding, of which decode reads one row only.
    """
    sizes: dict[str, int] = {}
    for shard in sorted(Path(folder).glob("weights-*.safetensors")):
        sizes.update(_safetensors_sizes(shard))
    untied = any(name.startswith("lm_head.") for name in sizes)
    return sum(size for name, size in sizes.items() if not (untied and name.startswith("model.embed_tokens.")))


def _gguf_tensor_sizes(path: Path) -> dict[str, tuple[int, int]]:
    """Tensor name -> (bytes, weights) of a GGUF file, from its header alone (runtime/gguf_header.py: tens of
    milliseconds, where gguf-py's reader parses the whole vocabulary, 3-16 s for the catalog's files)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from edgellm.errors import UnsupportedModelError
    from edgellm.runtime.gguf_header import read_gguf_header

    header = read_gguf_header(path)
    known = {int(t) for t in GGML_QUANT_SIZES}
    sizes: dict[str, tuple[int, int]] = {}
    for name, n in header.tensor_elements.items():
        code = header.tensor_types[name]
        if code not in known:
            raise UnsupportedModelError(f"{path}: tensor {name} has GGML block type {code}, unknown to gguf-py")
        block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(code)]
        sizes[name] = (n // block * block_bytes, n)
    return sizes


def gguf_weight_bytes_per_token(path: Path) -> int:
    """The same count for a GGUF file (what llama.cpp reads): `token_embd` is skipped when `output` exists."""
    tensors = _gguf_tensor_sizes(path)
    untied = "output.weight" in tensors
    return sum(size for name, (size, _) in tensors.items() if not (untied and name == "token_embd.weight"))


def gguf_bits_per_parameter(path: Path) -> float:
    """Storage bits per parameter of a GGUF file's tensors."""
    tensors = _gguf_tensor_sizes(path).values()
    return 8 * sum(size for size, _ in tensors) / sum(n for _, n in tensors)


def roofline(decode_tok_s: float, bytes_per_token: int, bandwidth: float) -> dict[str, float]:
    """The decode limit the bandwidth sets, and how much of it the measured speed reaches."""
    limit = bandwidth / bytes_per_token if bytes_per_token > 0 else float("inf")
    return {
        "bandwidth_gb_s": bandwidth / 1e9,
        "weight_bytes_per_token": bytes_per_token,
        "limit_tok_s": limit,
        "decode_tok_s": decode_tok_s,
        "percent_of_limit": 100.0 * decode_tok_s / limit if limit > 0 else 0.0,
    }
