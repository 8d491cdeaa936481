"""The teacher's top-k next-token log-probabilities over the training windows, computed once and kept on disk.

Plain arrays (.npy) and a JSON header, no pickle; the header records sha256 digests of both arrays, of the window
token ids and of the teacher's weights, and a cache that does not match what is asked is refused, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedModel

from edgellm.compress.source import CompressError
from edgellm.progress import bar

HEADER = "header.json"


@dataclass
class TeacherTargets:
    """Top-k log-probabilities [N, T, k] and their token ids, for windows [N, T]."""

    log_probs: torch.Tensor
    token_ids: torch.Tensor


def weights_digest(model: PreTrainedModel) -> str:
    """sha256 over the model's tensors (names, shapes and float32 bytes), in name order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(f"{name}:{tuple(t.shape)}".encode())
        h.update(t.detach().float().contiguous().numpy().tobytes())
    return h.hexdigest()


def _digest(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def compute(teacher: PreTrainedModel, windows: torch.Tensor, k: int, *, progress: bool = False) -> TeacherTargets:
    """The teacher's top-k log-probabilities at every position of every window."""
    n, length = windows.shape
    # written in place: small per-window tensors kept between the ~25 MB logits let freed heap pile up (measured
    # 24 MB of resident memory per window with a list of them: 10 GB for 400 windows of 128)
    values, ids = torch.empty((n, length, k)), torch.empty((n, length, k), dtype=torch.int32)
    with torch.no_grad():
        for i, w in enumerate(bar(windows, enabled=progress, desc="teacher logits", unit="window")):
            lp = torch.log_softmax(teacher(w[None], use_cache=False).logits[0].float(), -1)
            top = lp.topk(k, dim=-1)
            values[i], ids[i] = top.values, top.indices
    return TeacherTargets(values, ids)


def save(folder: Path, targets: TeacherTargets, windows: torch.Tensor, teacher_digest: str) -> None:
    """Write the cache to ``folder`` (beside it first, then renamed into place)."""
    tmp = folder.with_name(f".{folder.name}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lp, ids = targets.log_probs.numpy(), targets.token_ids.numpy()
    np.save(tmp / "log_probs.npy", lp, allow_pickle=False)
    np.save(tmp / "token_ids.npy", ids, allow_pickle=False)
    header = {"format": 1, "k": lp.shape[-1], "shape": list(lp.shape), "teacher_sha256": teacher_digest,
              "windows_sha256": _digest(windows.numpy()), "log_probs_sha256": _digest(lp),
              "token_ids_sha256": _digest(ids)}
    (tmp / HEADER).write_text(json.dumps(header, indent=1) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    os.replace(tmp, folder)


def load(folder: Path, windows: torch.Tensor, teacher_digest: str, k: int) -> TeacherTargets | None:
    """The cached targets if ``folder`` holds them for these windows, this teacher and this k; None if there is no
    cache; CompressError if there is one that is damaged or made for something else."""
    if not (folder / HEADER).is_file():
        return None
    try:
        header = json.loads((folder / HEADER).read_text())
        lp = np.load(folder / "log_probs.npy", allow_pickle=False)
        ids = np.load(folder / "token_ids.npy", allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CompressError(f"teacher cache {folder} cannot be read ({exc}); delete it to recompute") from None
    if _digest(lp) != header.get("log_probs_sha256") or _digest(ids) != header.get("token_ids_sha256"):
        raise CompressError(f"teacher cache {folder} fails its checksum: the files were modified or are "
                            "incomplete; delete it to recompute")
    if header.get("windows_sha256") != _digest(windows.numpy()) or header.get("k") != k:
        raise CompressError(f"teacher cache {folder} was computed for other windows or another --top-k; "
                            "delete it to recompute")
    if header.get("teacher_sha256") != teacher_digest:
        raise CompressError(f"teacher cache {folder} was computed with another teacher; delete it to recompute")
    return TeacherTargets(torch.from_numpy(lp), torch.from_numpy(ids).long())
