"""Loading a draft model for speculative decoding (`speculative="draft:MODEL"`, session/speculative_draft.py): MODEL
as Engine.load takes it (a catalog name, name:scheme, an artifact folder), its memory counted by the planner, and a
draft whose tokenizer differs from the target's refused (the sha256 of the id → token table)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from edgellm.artifact.config import ArtifactConfig
from edgellm.artifact.reader import open_artifact
from edgellm.errors import EdgeLLMError
from edgellm.models.load import load_model
from edgellm.models.protocol import NATIVE, choose
from edgellm.runtime.memory import estimate_memory
from edgellm.session.speculative_draft import DraftModel
from edgellm.tokenizer import Tokenizer


@dataclass(frozen=True)
class DraftPlan:
    """A resolved draft: its folder, config, and the bytes it adds at a window (weights, working buffers and
    `sequences` KV caches)."""

    name: str
    folder: Path
    config: ArtifactConfig
    bytes: int


def vocabulary_sha256(tokenizer: Tokenizer) -> str:
    """sha256 of the id → token table (each entry's UTF-8 bytes, length-prefixed, in id order)."""
    digest = hashlib.sha256()
    for i in range(tokenizer.vocab_size):
        data = tokenizer.id_to_token(i).encode("utf-8")
        digest.update(len(data).to_bytes(4, "little") + data)
    return digest.hexdigest()


def plan_draft(name: str, *, window: int, kv_cache: str | None, sequences: int = 1,
               progress: bool = False) -> DraftPlan:
    """Resolve the draft MODEL (compiled on first use) and count what it adds: its weights once, its working
    buffers, a KV cache of `window` positions (at most its own) of kind `kv_cache` (None: its own default) for
    each of `sequences` sessions."""
    from edgellm.resolve import resolve_model

    folder = resolve_model(name, progress=progress)
    config = ArtifactConfig.read(folder)
    window = min(window, config.context_window)
    estimate = estimate_memory(config, window, kv_cache=kv_cache or config.kv_cache, sequences=sequences)
    return DraftPlan(name, folder, config, estimate.total_bytes - estimate.tokenizer_bytes)


def load_draft(plan: DraftPlan, target: Tokenizer, *, window: int, kv_cache: str, threads: int,
               prefill_chunk: int) -> DraftModel:
    """The draft model of `plan`, checked (its files hashed) and its tokenizer compared with the target's: EdgeLLMError
    in one line when they differ, or when the draft's window is shorter than the target's."""
    artifact = open_artifact(plan.folder, verify=True)
    tok = artifact.config.tokenizer
    tokenizer = Tokenizer.from_file(artifact.tokenizer_path, bos_token_id=tok.bos_token_id,
                                    eos_token_id=tok.eos_token_id, add_bos_token=tok.add_bos_token,
                                    stop_token_ids=tok.stop_token_ids)
    if tokenizer.file_sha256 != target.file_sha256 and vocabulary_sha256(tokenizer) != vocabulary_sha256(target):
        raise EdgeLLMError(f"draft model {plan.name!r} has another tokenizer than the target (their id → token "
                           "tables differ): a draft must share the target's vocabulary")
    if artifact.config.context_window < window:
        raise EdgeLLMError(f"draft model {plan.name!r} has a context window of {artifact.config.context_window}, "
                           f"shorter than the target's {window}: choose a shorter --context-window")
    choice = choose(artifact.config, None, None)
    weights = artifact.weights(arrays=choice.implementation == NATIVE)
    model = load_model(choice, artifact.config, weights, threads=threads, window=window)
    return DraftModel(plan.name, model, kv_cache=kv_cache, window=window, prefill_chunk=prefill_chunk)
