"""The generation session: a model's KV cache, the token ids it holds, and the token loop over them.

It knows tokens and logits only: no tokenizer, no text, no stop strings, no lock (runtime/engine.py, the
facade users call, holds one session behind its lock and turns its tokens into a text stream). Its model is any
SessionModel (models/protocol.py): token ids in, float32 numpy logits out, and sampling is numpy's, so a session on the
native model never imports torch. Logits processors
of a request (``GenerationParams.logits_processors``) take torch tensors: they see the same memory through
``torch.from_numpy``, which imports torch only for such a request; an output constraint's take the numpy array.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, Generator, Iterator, Sequence

import numpy as np

from edgellm.artifact.config import SamplingDefaults
from edgellm.errors import ContextOverflowError
from edgellm.generation import ArrayLogitsProcessor, ConstraintFork, GenerationParams, GenerationStats
from edgellm.models.kv_space import KVSpace
from edgellm.models.protocol import SessionModel
from edgellm.session.context import shifted_ids
from edgellm.session.power import Pacer, PowerMode
from edgellm.session.prompt_cache import PromptCache, usable_prefix
from edgellm.session.sampling import Sampler, make_logits_processors, make_sampler
from edgellm.session.speculative import Drafter, LookupDrafter, ReplyMemory, draft_model_name, step_rows
from edgellm.session.speculative import check_method as check_speculative
from edgellm.session.speculative_draft import DraftRunner


class GenerationSession:
    """One sequence at a time through `model`: prefill with prefix reuse, token steps, context shift."""

    def __init__(self, model: SessionModel, cache: KVSpace, *, context_window: int, prefill_chunk: int,
                 sampling: SamplingDefaults, power: PowerMode | None = None) -> None:
        """`cache`: a KV cache `model` made (its `new_cache`)."""
        self.model = model
        self.cache = cache
        self.context_window = context_window
        self.prefill_chunk = prefill_chunk
        self.sampling = sampling  # the artifact's defaults, for every parameter a request leaves unset
        self.power = power
        self.cached_ids: list[int] = []  # tokens whose keys/values the cache holds, from position 0
        self.prefilled = 0  # the first tokens of cached_ids that came from a prefill (the rest: decode steps)
        self.prompt_cache: PromptCache | None = None  # earlier prefixes beside the live one (session/prompt_cache.py)
        self.draft: DraftRunner | None = None  # a draft model's runner, for speculative="draft:MODEL"
        self.reply_memory = ReplyMemory()  # earlier replies' n-grams, for prompt lookup (shared by a batch's slots)

    def prefill(self, ids: list[int], stats: GenerationStats, *, exact: bool = False) -> np.ndarray:
        """Run the prompt through the model (reusing the cached prefix); return the last logits (V,).

        With `exact` (greedy or seeded requests) the result has the same bits as a prefill from an empty cache:
        only whole chunks that a fresh prefill computed, on the same boundaries, are reused (never KV written by
        decode steps or by a chunk of another shape). Otherwise any matching cached prefix is reused."""
        chunk_len = self.prefill_chunk
        invariant = self.model.chunk_invariant
        reuse = usable_prefix(self.cached_ids, self.prefilled, ids, exact=exact, chunk=chunk_len, invariant=invariant)
        if self.prompt_cache is not None:
            reuse = self._switch_prefix(ids, reuse, exact, invariant)
        stats.cached_tokens = reuse
        self.cached_ids = ids[:reuse]
        if invariant:  # every reused token from a prefill chunk of several tokens: the new ones are a fresh prefill's
            self.prefilled = len(ids) if reuse < self.prefilled or reuse == 0 else max(0, self.prefilled - 1)
        elif reuse <= self.prefilled and reuse % chunk_len == 0:  # new chunks fall on a fresh prefill's boundaries
            self.prefilled = len(ids)
        else:
            exact_part = min(self.prefilled, reuse)
            self.prefilled = exact_part - exact_part % chunk_len
        logits = None
        for start in range(reuse, len(ids), chunk_len):
            chunk = ids[start : start + chunk_len]
            logits = self.model.run(chunk, start, self.cache)
            self.cached_ids.extend(chunk)
        assert logits is not None
        return logits

    def _switch_prefix(self, ids: list[int], reuse: int, exact: bool, invariant: bool) -> int:
        """The prompt cache's part of a prefill: keep the live prefix before `ids` overwrite it, and copy in an
        entry's keys/values where it shares more of `ids` than the live cache does; the tokens now reusable."""
        cache = self.prompt_cache
        assert cache is not None
        entry, entry_reuse = cache.best(ids, exact=exact, chunk=self.prefill_chunk, invariant=invariant)
        if entry_reuse <= reuse:
            entry = None
        if reuse < len(self.cached_ids):  # the live prefix is about to be overwritten
            cache.add(self.cached_ids, self.prefilled, self.cache)
        if entry is None:
            return reuse
        self.cache.reserve(entry_reuse)
        cache.restore(entry, entry_reuse, self.cache)
        self.cached_ids, self.prefilled = list(entry.ids[:entry_reuse]), entry.prefilled
        return entry_reuse

    def token_steps(self, ids: list[int], params: GenerationParams, stats: GenerationStats, *,
                    constraint_processors: Sequence[ArrayLogitsProcessor] = (),
                    constraint_fork: Callable[[], ConstraintFork | None] | None = None
                    ) -> Generator[tuple[int, np.ndarray], None, None]:
        """Yield (token, processed logits) until the context is full; the caller decides when to stop.
        `constraint_processors` run last, on the numpy logits themselves (an output constraint's);
        `constraint_fork` copies that constraint's state after the tokens yielded so far (prompt lookup drafts the
        tokens it forces and only tokens it allows)."""
        defaults = self.sampling
        pick = lambda value, default: default if value is None else value  # noqa: E731
        sampling = {"temperature": pick(params.temperature, defaults.temperature),
                    "top_p": pick(params.top_p, defaults.top_p), "top_k": pick(params.top_k, defaults.top_k),
                    "min_p": pick(params.min_p, defaults.min_p)}
        sampler = make_sampler(**sampling)
        # the model's default repetition penalty is for free text: under an output constraint it would push the
        # grammar's own punctuation and repeated keys away (README, "Which model for what"); one asked for applies
        default_penalty = 1.0 if constraint_processors else defaults.repetition_penalty
        processors = make_logits_processors(
            repetition_penalty=pick(params.repetition_penalty, default_penalty),
            presence_penalty=params.presence_penalty,
            frequency_penalty=params.frequency_penalty,
            logit_bias=params.logit_bias,
        )
        # a seed is a signed 64-bit integer (the API's range); numpy's generator takes its two's complement bits
        generator = np.random.default_rng(params.seed % 2**64 if params.seed is not None
                                          else int.from_bytes(os.urandom(8), "little"))
        user_processors = [_on_torch_tensors(p) for p in params.logits_processors]
        t0 = time.perf_counter()
        greedy_or_seeded = pick(params.temperature, defaults.temperature) == 0 or params.seed is not None
        exact = params.prefix_reuse == "exact" or (params.prefix_reuse == "auto" and greedy_or_seeded)
        logits = self.prefill(ids, stats, exact=exact)
        drafter: Drafter | None = None
        if params.speculative is not None:
            drafter = self._drafter(check_speculative(params.speculative), ids, sampling, generator, exact,
                                    params, logits.size, constraint_fork)
        stats.prefill_s = time.perf_counter() - t0
        generated: list[int] = []
        pacer = Pacer(self.power, stats) if self.power is not None else None

        def process(logits: np.ndarray) -> np.ndarray:
            for processor in processors:
                logits = processor(ids, generated, logits)
            for user_processor in user_processors:
                logits = user_processor(generated, logits)
            for constraint_processor in constraint_processors:
                logits = constraint_processor(generated, logits)
            return logits

        if drafter is not None:
            try:
                yield from self._speculative_steps(drafter, logits, params, stats, process, sampler, generator,
                                                   generated, pacer)
            finally:
                if isinstance(drafter, LookupDrafter):
                    drafter.remember()  # a reply cut short (a stop string, a closed stream) too
            return
        while True:
            logits = process(logits)
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
                continue
            logits = self.model.run([token], pos, self.cache)
            self.cached_ids.append(token)

    def _drafter(self, method: str, ids: list[int], sampling: dict[str, Any], generator: np.random.Generator,
                 exact: bool, params: GenerationParams, vocab: int,
                 constraint_fork: Callable[[], ConstraintFork | None] | None) -> Drafter:
        """The request's drafter: prompt lookup over `ids` and, unless the request samples with a seed, the earlier
        replies (guided by the output constraint, if any), or the session's draft model with `ids` prefilled."""
        name = draft_model_name(method)
        if name is None:
            # a seeded sampled reply must repeat: its drafts (which decide the draws) come from the request alone
            seeded = sampling["temperature"] > 0 and params.seed is not None
            return LookupDrafter(ids, sampling=sampling, constraint=constraint_fork,
                                 memory=None if seeded else self.reply_memory)
        assert self.draft is not None and self.draft.name == name  # the engine checked the request
        reserve = len(ids) + (params.max_tokens or self.context_window) + 1
        self.draft.begin(ids, sampling, generator, exact=exact, reserve=reserve, vocab=vocab)
        return self.draft

    def _speculative_steps(self, drafter: Drafter, logits: np.ndarray, params: GenerationParams,
                           stats: GenerationStats, process: Callable[[np.ndarray], np.ndarray], sampler: Sampler,
                           generator: np.random.Generator, generated: list[int],
                           pacer: Pacer | None) -> Iterator[tuple[int, np.ndarray]]:
        """The token loop with drafts (prompt lookup or a draft model, session/speculative*.py): each fed token
        carries the draft that follows it; drafted tokens are kept by the drafter's acceptance rule, the first refused
        one replaced by a drawn token and the positions after it dropped (never entered in cached_ids, overwritten
        by the next feed)."""
        token: int | None = None  # a drawn token still to be fed (None: sample one from `logits`)
        while True:
            if token is None:
                logits = process(logits)
                token = sampler(logits, generator)
                generated.append(token)
                drafter.extend([token])
                yield token, logits
                if pacer is not None:
                    pacer.after_token()
            pos = len(self.cached_ids)
            if pos + 1 >= self.context_window:  # prompt + output may not exceed the window
                if params.context_shift is None:
                    return
                logits, token = self._shift_context(token, params, stats), None
                drafter.rebase(self.cached_ids)
                continue
            draft = drafter.propose(self.context_window - pos - 2)  # every fed position stays inside the window
            rows = step_rows(self.model, [token, *draft], pos, self.cache)
            logits = next(rows)
            self.cached_ids.append(token)
            token = None
            stats.draft_tokens += len(draft)
            stats.forced_draft_tokens += drafter.forced
            for index, drafted in enumerate(draft):
                logits = process(logits)
                choice = drafter.accept(logits, index, drafted, generator)
                generated.append(choice)
                drafter.extend([choice])
                yield choice, logits
                if pacer is not None:
                    pacer.after_token()
                if choice != drafted:
                    token = choice  # refused: the drawn token is fed next, at the refused one's position
                    break
                stats.accepted_tokens += 1
                logits = next(rows)
                self.cached_ids.append(drafted)

    def _shift_context(self, token: int, params: GenerationParams, stats: GenerationStats) -> np.ndarray:
        """The window is full: keep the head and the newest half (session/context.py); feed `token`; its logits."""
        t0 = time.perf_counter()
        kept, keep, drop = shifted_ids(self.cached_ids, self.context_window, params.context_keep)
        # "rope" moves and re-rotates the keys where the model can do it exactly; else re-encode, which is exact
        if params.context_shift == "rope" and self.model.shift_cache(self.cache, len(self.cached_ids), keep, drop):
            self.cached_ids = kept
            head = min(self.prefilled, keep)  # only the untouched head still has a fresh prefill's bits
            self.prefilled = head - head % self.prefill_chunk
            logits = self.model.run([token], len(kept), self.cache)
            self.cached_ids.append(token)
        else:
            logits = self.prefill(kept + [token], GenerationStats())
        stats.context_shifts += 1
        stats.shift_s += time.perf_counter() - t0
        return logits

    def logits(self, ids: Sequence[int], *, step_from: int | None = None) -> np.ndarray:
        """Next-token logits (T, V) for every position of `ids`, from an empty cache (for evaluation).

        Positions before `step_from` (all by default) go through the prefill chunks; from `step_from` on,
        tokens are fed one at a time, as generation computes them (the native decode step where it runs).
        """
        if len(ids) > self.context_window:
            raise ContextOverflowError(len(ids), self.context_window)
        split = len(ids) if step_from is None else max(1, min(step_from, len(ids)))
        self.cached_ids = []
        self.cache.reserve(len(ids))
        out = [self.model.run(ids[s : min(s + self.prefill_chunk, split)], s, self.cache, all_logits=True)
               for s in range(0, split, self.prefill_chunk)]
        out += [self.model.run([ids[pos]], pos, self.cache, all_logits=True) for pos in range(split, len(ids))]
        self.cached_ids = list(ids)
        self.prefilled = split  # the rest came from single-token steps
        return np.concatenate(out)

    def reset(self) -> None:
        """Forget the cached prefix (the cache's memory stays allocated)."""
        self.cached_ids = []

    def close(self) -> None:
        """Release the KV cache and the model now (the live prefix joins the prompt cache first)."""
        if self.prompt_cache is not None and self.cached_ids:
            self.prompt_cache.add(self.cached_ids, self.prefilled, self.cache)
        self.cache.release()
        if self.draft is not None:
            self.draft.cache.release()
            self.draft = None
        self.cached_ids = []
        del self.model


def _on_torch_tensors(process: Callable[[Sequence[int], Any], Any]
                      ) -> Callable[[Sequence[int], np.ndarray], np.ndarray]:
    """A request's logits processor, which takes and returns torch tensors (the public API), over numpy logits: it
    sees the array's own memory (changes in place show through) and its result comes back without a copy."""
    import torch

    def on_arrays(generated: Sequence[int], logits: np.ndarray) -> np.ndarray:
        return process(generated, torch.from_numpy(logits)).detach().float().numpy()

    return on_arrays
