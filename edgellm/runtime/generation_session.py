"""The generation session: a model's KV cache, the token ids it holds, and the token loop over them.

It knows tokens and logits only: no tokenizer, no text, no stop strings, no lock (runtime/engine.py, the
facade users call, holds one session behind its lock and turns its tokens into a text stream).
"""

from __future__ import annotations

import os
import time
from typing import Iterator, Sequence

import torch

from edgellm.artifact.config import SamplingDefaults
from edgellm.errors import ContextOverflowError
from edgellm.generation import GenerationParams, GenerationStats
from edgellm.models.kv_cache import KVCache
from edgellm.models.transformer import Transformer
from edgellm.runtime.context import rope_shift_exact, shift_cache, shifted_ids
from edgellm.runtime.power import Pacer, PowerMode
from edgellm.runtime.sampling import make_logits_processors, make_sampler


class GenerationSession:
    """One sequence at a time through `model`: prefill with prefix reuse, token steps, context shift."""

    def __init__(self, model: Transformer, cache: KVCache, *, context_window: int, prefill_chunk: int,
                 threads: int, sampling: SamplingDefaults, power: PowerMode | None = None) -> None:
        self.model = model
        self.cache = cache
        self.context_window = context_window
        self.prefill_chunk = prefill_chunk
        self.threads = threads
        self.sampling = sampling  # the artifact's defaults, for every parameter a request leaves unset
        self.power = power
        self.cached_ids: list[int] = []  # tokens whose keys/values the cache holds, from position 0
        self.prefilled = 0  # the first tokens of cached_ids that came from a prefill (the rest: decode steps)

    def prefill(self, ids: list[int], stats: GenerationStats, *, exact: bool = False) -> torch.Tensor:
        """Run the prompt through the model (reusing the cached prefix); return the last logits (V,).

        With `exact` (greedy or seeded requests) the result has the same bits as a prefill from an empty cache:
        only whole chunks that a fresh prefill computed, on the same boundaries, are reused (never KV written by
        decode steps or by a chunk of another shape). Otherwise any matching cached prefix is reused."""
        torch.set_num_threads(self.threads)  # prefill's torch GEMMs use every thread (see _decode_threads)
        chunk_len = self.prefill_chunk
        limit = min(len(self.cached_ids), len(ids) - 1, self.prefilled if exact else len(ids))
        reuse = 0
        while reuse < limit and self.cached_ids[reuse] == ids[reuse]:
            reuse += 1
        if exact:
            reuse -= reuse % chunk_len
        stats.cached_tokens = reuse
        self.cached_ids = ids[:reuse]
        if reuse <= self.prefilled and reuse % chunk_len == 0:  # new chunks fall on a fresh prefill's boundaries
            self.prefilled = len(ids)
        else:
            exact_part = min(self.prefilled, reuse)
            self.prefilled = exact_part - exact_part % chunk_len
        logits = None
        for start in range(reuse, len(ids), chunk_len):
            chunk = ids[start : start + chunk_len]
            logits = self.model(torch.tensor([chunk]), start, self.cache)
            self.cached_ids.extend(chunk)
        assert logits is not None
        return logits[0, -1]

    def token_steps(self, ids: list[int], params: GenerationParams,
                    stats: GenerationStats) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (token, processed logits) until the context is full; the caller decides when to stop."""
        defaults = self.sampling
        pick = lambda value, default: default if value is None else value  # noqa: E731
        sampler = make_sampler(
            temperature=pick(params.temperature, defaults.temperature),
            top_p=pick(params.top_p, defaults.top_p),
            top_k=pick(params.top_k, defaults.top_k),
            min_p=pick(params.min_p, defaults.min_p),
        )
        processors = make_logits_processors(
            repetition_penalty=pick(params.repetition_penalty, defaults.repetition_penalty),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias,
        )
        generator = torch.Generator()
        generator.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        t0 = time.perf_counter()
        greedy_or_seeded = pick(params.temperature, defaults.temperature) == 0 or params.seed is not None
        exact = params.prefix_reuse == "exact" or (params.prefix_reuse == "auto" and greedy_or_seeded)
        logits = self.prefill(ids, stats, exact=exact)
        stats.prefill_s = time.perf_counter() - t0
        generated: list[int] = []
        pacer = Pacer(self.power, stats) if self.power is not None else None
        self._decode_threads()
        while True:
            logits = logits.float()
            for process in processors:
                logits = process(ids, generated, logits)
            for process in params.logits_processors:
                logits = process(generated, logits)
            token = sampler(logits, generator)
            generated.append(token)
            yield token, logits
            if pacer is not None:
                pacer.after_token()
            pos = len(self.cached_ids)
            if pos + 1 >= self.context_window:  # prompt + output may not exceed the window
                if params.context_shift is None:
                    return
                logits = self._shift_context(token, params, stats)
                self._decode_threads()
                continue
            logits = self.model(torch.tensor([[token]]), pos, self.cache)[0, -1]
            self.cached_ids.append(token)

    def _decode_threads(self) -> None:
        """With the native decode step, torch only samples between steps: give it one thread. Its OpenMP
        workers, woken by a parallel argmax over the vocabulary, otherwise spin next to the decode step's own
        threads (Qwen2.5-0.5B at 2 threads on 2 cores: 67 instead of 101 tok/s)."""
        if self.model.native is not None:
            torch.set_num_threads(1)

    def _shift_context(self, token: int, params: GenerationParams, stats: GenerationStats) -> torch.Tensor:
        """The window is full: keep the head and the newest half (runtime/context.py); feed `token`; its logits."""
        t0 = time.perf_counter()
        kept, keep, drop = shifted_ids(self.cached_ids, self.context_window, params.context_keep)
        if params.context_shift == "rope" and rope_shift_exact(self.model):  # else re-encode, which is exact
            shift_cache(self.cache, self.model, len(self.cached_ids), keep, drop)
            self.cached_ids = kept
            head = min(self.prefilled, keep)  # only the untouched head still has a fresh prefill's bits
            self.prefilled = head - head % self.prefill_chunk
            logits = self.model(torch.tensor([[token]]), len(kept), self.cache)[0, -1]
            self.cached_ids.append(token)
        else:
            logits = self.prefill(kept + [token], GenerationStats())
        stats.context_shifts += 1
        stats.shift_s += time.perf_counter() - t0
        return logits

    def logits(self, ids: Sequence[int], *, step_from: int | None = None) -> torch.Tensor:
        """Next-token logits (T, V) for every position of `ids`, from an empty cache (for evaluation).

        Positions before `step_from` (all by default) go through the prefill chunks; from `step_from` on,
        tokens are fed one at a time, as generation computes them (the native decode step where it runs).
        """
        if len(ids) > self.context_window:
            raise ContextOverflowError(len(ids), self.context_window)
        split = len(ids) if step_from is None else max(1, min(step_from, len(ids)))
        torch.set_num_threads(self.threads)
        self.cached_ids = []
        self.cache.reserve(len(ids))
        out = [self.model(torch.tensor([list(ids[s : min(s + self.prefill_chunk, split)])]), s, self.cache,
                          all_logits=True)[0]
               for s in range(0, split, self.prefill_chunk)]
        out += [self.model(torch.tensor([[ids[pos]]]), pos, self.cache)[0] for pos in range(split, len(ids))]
        self.cached_ids = list(ids)
        self.prefilled = split  # the rest came from single-token steps
        return torch.cat(out)

    def reset(self) -> None:
        """Forget the cached prefix (the cache's memory stays allocated)."""
        self.cached_ids = []

    def close(self) -> None:
        """Release the KV cache and the model now."""
        self.cache.release()
        self.cached_ids = []
        del self.model
