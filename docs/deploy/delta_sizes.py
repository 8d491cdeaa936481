"""How many bytes an update that keeps one more layer at 8 bits must download, three ways.

    python docs/deploy/delta_sizes.py V1_ARTIFACT V2_ARTIFACT

* one shard    the old layout: every tensor in one safetensors file (the file changes, so all of it moves)
* per layer    edgellm's layout: one shard per transformer layer; changed files are fetched whole
* CDC          content-defined chunks (gear hash, 16-64-256 KiB) over the one-shard file: changed chunks only

The config and manifest are counted in every case (they change with any recipe).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
from safetensors.torch import save_file

from edgellm.artifact.reader import open_artifact
from edgellm.store.local import release_files

_GEAR = np.random.default_rng(12345).integers(0, 2**32, 256, dtype=np.uint64).astype(np.uint32)
MIN, MASK_BITS, MAX = 16 << 10, 16, 256 << 10  # average chunk about 64 KiB


def one_shard(folder: Path, out: Path) -> Path:
    """Re-write an artifact's tensors as the old single shard would have held them."""
    save_file(open_artifact(folder, verify=False).weights(), str(out), metadata={"format": "pt"})
    return out


def cdc_chunks(data: bytes) -> list[bytes]:
    """Gear-hash chunking: h_i = sum_j G[b_(i-j)] << j (mod 2^32); cut where the top bits are zero."""
    b = np.frombuffer(data, dtype=np.uint8)
    g = _GEAR[b]
    h = np.zeros(len(b), dtype=np.uint32)
    for j in range(32):  # the top 16 bits depend on the last 32 bytes only
        h[j:] += g[: len(b) - j] << np.uint32(j)
    candidates = np.flatnonzero((h >> np.uint32(32 - MASK_BITS)) == 0) + 1
    cuts, start = [], 0
    for c in candidates.tolist():
        while c - start > MAX:
            start += MAX
            cuts.append(start)
        if c - start >= MIN:
            cuts.append(c)
            start = c
    while len(b) - start > MAX:
        start += MAX
        cuts.append(start)
    edges = [0, *cuts, len(b)] if not cuts or cuts[-1] != len(b) else [0, *cuts]
    return [data[a:z] for a, z in zip(edges, edges[1:]) if z > a]


def main(v1: Path, v2: Path) -> None:
    f1, f2 = release_files(v1), release_files(v2)
    meta = sum(e.size for n, e in f2.items() if not n.startswith("weights-") and f1.get(n) != e)
    per_layer = sum(e.size for n, e in f2.items() if f1.get(n) != e)
    with tempfile.TemporaryDirectory() as tmp:
        s1, s2 = one_shard(v1, Path(tmp) / "a"), one_shard(v2, Path(tmp) / "b")
        d1, d2 = s1.read_bytes(), s2.read_bytes()
    have = {hash(c) for c in cdc_chunks(d1)}
    c2 = cdc_chunks(d2)
    cdc = sum(len(c) for c in c2 if hash(c) not in have)
    total = sum(e.size for e in f2.values())
    print(f"v2 total {total / 2**20:.2f} MiB; {len(f2)} files, {len(c2)} CDC chunks of the one-shard file")
    for label, n in (("one shard", len(d2) + meta), ("per-layer shards", per_layer), ("CDC chunks", cdc + meta)):
        print(f"{label:<17} {n / 2**20:8.2f} MiB  ({100 * n / total:5.1f}% of the release)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
