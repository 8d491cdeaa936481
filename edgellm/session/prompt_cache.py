"""A prompt cache across requests: the KV of several earlier prompts, kept by recency within a memory budget.

The generation session (session/generation_session.py) holds one live KV cache. Before a prefill overwrites the live
prefix with another prompt's, the live prefix is copied in here (an entry: its token ids, how many of them came from a
fresh prefill, and its keys/values for exactly those positions); a prompt that shares a longer prefix with an entry
than with the live cache gets that entry's keys/values copied back. Only the true common prefix is ever reused
(compared token by token), so a prompt that differs from an entry in its middle reuses the part before the
difference and prefills the rest. An entry that is a prefix of a newer one (with no more exact tokens) is dropped:
the newer one covers it. With a folder (session/prompt_store.py) entries are also written to disk and read back at
the next start.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Protocol, Sequence

import numpy as np

from edgellm.errors import EdgeLLMError
from edgellm.models.kv_space import KVSpace
from edgellm.kernels.decoder import as_array

log = logging.getLogger("edgellm.prompt_cache")

MIN_TOKENS = 64  # shorter prefixes are cheaper to prefill again than to keep


def usable_prefix(cached: Sequence[int], prefilled: int, ids: Sequence[int], *, exact: bool, chunk: int,
                  invariant: bool = False) -> int:
    """How many leading tokens of `ids` a cache holding `cached` (its first `prefilled` from a fresh prefill) can
    give: the common prefix, leaving the last prompt token to run (its logits are needed). With `exact`, only what
    gives the same bits as a prefill from an empty cache: whole chunks of a fresh prefill, or, for a model whose
    prefill is the same bits however it is chunked (`invariant`: the native model), any prefilled prefix but the
    last prefilled token (a one-token last chunk goes through the decode step) that leaves the prompt's last token
    in a chunk of the same kind (one token or more) as a fresh prefill does."""
    limit = min(len(cached), len(ids) - 1, prefilled if exact else len(ids))
    if exact and invariant:
        limit = min(limit, prefilled - 1)
    reuse = 0
    while reuse < limit and cached[reuse] == ids[reuse]:
        reuse += 1
    if not exact:
        return reuse
    if not invariant:
        return reuse - reuse % chunk
    single_tail = len(ids) % chunk == 1
    while reuse > 0 and ((len(ids) - reuse) % chunk == 1) != single_tail:
        reuse -= 1
    return reuse


@dataclass
class CachedPrefix:
    """One entry: `ids` and the keys/values (and q8 scales) of exactly their positions, copied out of a KV cache."""

    ids: tuple[int, ...]
    prefilled: int  # the first tokens of ids whose KV came from a fresh prefill's chunks
    arrays: tuple[np.ndarray, ...]  # keys, values[, key_scales, value_scales]: (layers, 1, kv_heads, len(ids), ...)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays)


class PrefixStore(Protocol):
    """Where a PromptCache keeps its entries beyond the process (prompt_store.PromptStore: files on disk)."""

    def load(self, budget_bytes: int) -> Iterator[CachedPrefix]: ...

    def save(self, entry: CachedPrefix) -> None: ...

    def remove(self, entry: CachedPrefix) -> None: ...


def cache_arrays(cache: KVSpace) -> tuple[np.ndarray, ...]:
    """Numpy views of a KV cache's keys, values and (q8) scales; EdgeLLMError for storage numpy cannot view."""
    tensors = [cache.keys, cache.values] + ([cache.key_scales, cache.value_scales]
                                            if cache.key_scales is not None else [])
    try:
        return tuple(as_array(t) for t in tensors)
    except TypeError as exc:  # a torch bfloat16 cache
        raise EdgeLLMError(f"the prompt cache cannot hold this KV cache's storage ({exc})") from None


def layout_of(cache: KVSpace) -> dict[str, Any]:
    """What an entry must match to be copied into `cache`: the kind and each array's dtype and shape but positions."""
    return {"kind": cache.kind,
            "arrays": [[str(a.dtype), list(a.shape[:3]) + list(a.shape[4:])] for a in cache_arrays(cache)]}


class PromptCache:
    """Entries by recency (the most recent last), their bytes at most `budget_bytes`. Safe to share between the
    sessions of a server's batch (runtime/batching.py): each method holds the cache's lock."""

    def __init__(self, budget_bytes: int, *, store: PrefixStore | None = None, min_tokens: int = MIN_TOKENS) -> None:
        if budget_bytes < 0:
            raise EdgeLLMError("the prompt cache's budget must not be negative")
        self.budget_bytes = budget_bytes
        self.min_tokens = min_tokens
        self.store = store
        self.entries: OrderedDict[tuple[int, ...], CachedPrefix] = OrderedDict()
        self.hits = 0  # prefills that reused an entry
        self._lock = threading.RLock()
        if store is not None:
            for entry in store.load(budget_bytes):  # the most recent first, within the budget
                self.entries[entry.ids] = entry
                self.entries.move_to_end(entry.ids, last=False)

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries.values())

    def best(self, ids: Sequence[int], *, exact: bool, chunk: int,
             invariant: bool = False) -> tuple[CachedPrefix | None, int]:
        """The entry giving `ids` the longest usable prefix (usable_prefix), and that length (None, 0 without one)."""
        with self._lock:
            best, reuse = None, 0
            for entry in self.entries.values():
                n = usable_prefix(entry.ids, entry.prefilled, ids, exact=exact, chunk=chunk, invariant=invariant)
                if n > reuse:
                    best, reuse = entry, n
            return best, reuse

    def add(self, ids: Sequence[int], prefilled: int, cache: KVSpace) -> None:
        """Keep a copy of `cache`'s first len(ids) positions as the most recent entry (evicting the least recent
        beyond the budget); nothing when it is too short, too big, or already covered by an entry."""
        with self._lock:
            key = tuple(ids)
            if len(key) < self.min_tokens:
                return
            for old in list(self.entries.values()):
                if old.ids[: len(key)] == key and old.prefilled >= min(prefilled, len(key)):
                    self.entries.move_to_end(old.ids)  # covered: an entry already holds these positions
                    return
                if key[: len(old.ids)] == old.ids and prefilled >= old.prefilled:
                    self._drop(old)  # the new entry covers it
            n = len(key)
            views = tuple(a[..., :n, :] for a in cache_arrays(cache))
            nbytes = sum(v.nbytes for v in views)
            if nbytes > self.budget_bytes:
                return
            while self.entries and self.nbytes + nbytes > self.budget_bytes:  # before the copy: never over budget
                self._drop(next(iter(self.entries.values())))
            entry = CachedPrefix(key, min(prefilled, n), tuple(np.array(v) for v in views))
            self.entries[key] = entry
            if self.store is not None:
                self.store.save(entry)

    def restore(self, entry: CachedPrefix, length: int, cache: KVSpace) -> None:
        """Copy the entry's first `length` positions into `cache` (which has room for them) and mark it recent."""
        with self._lock:
            for dst, src in zip(cache_arrays(cache), entry.arrays):
                dst[..., :length, :] = src[..., :length, :]
            if entry.ids in self.entries:  # another sequence of the batch may have evicted it since `best`
                self.entries.move_to_end(entry.ids)
            self.hits += 1

    def _drop(self, entry: CachedPrefix) -> None:
        del self.entries[entry.ids]
        if self.store is not None:
            self.store.remove(entry)


DEFAULT_BUDGET = 256 * 2**20  # a persisted cache's budget when none is given


def prompt_cache_budget(budget_bytes: int | None, folder: str | Path | None) -> int:
    """The bytes an engine's prompt cache may hold: `budget_bytes`, else DEFAULT_BUDGET with a folder, else 0 (off)."""
    if budget_bytes is not None and budget_bytes < 0:
        raise EdgeLLMError("the prompt cache's budget must not be negative")
    if budget_bytes is None:
        return DEFAULT_BUDGET if folder is not None else 0
    return budget_bytes
