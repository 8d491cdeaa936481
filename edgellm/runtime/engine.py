"""The Engine: a verified artifact loaded for generation, and the one generation stream every consumer uses."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from edgellm.artifact.reader import Artifact, open_artifact
from edgellm.errors import ContextOverflowError, EdgeLLMError, MemoryBudgetError
from edgellm.models.llama import Transformer
from edgellm.resolve import resolve_model
from edgellm.runtime.chat_template import render_chat
from edgellm.runtime.generation import (
    GenerationParams,
    GenerationResult,
    GenerationStats,
    StreamChunk,
    TokenLogprob,
)
from edgellm.runtime.memory import MemoryEstimate, estimate_memory
from edgellm.runtime.sampling import make_logits_processors, make_sampler
from edgellm.runtime.stops import StopMatcher
from edgellm.runtime.tokenizer import StreamingDetokenizer, Tokenizer
from edgellm.structured.processor import GrammarConstraint, build_constraint


def default_threads() -> int:
    """All the cores this process may use, never more (oversubscription hurts decode)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


class Engine:
    """A loaded model with its tokenizer, KV cache and sampler; one request at a time."""

    def __init__(self, artifact: Artifact, *, context_window: int | None = None, threads: int | None = None,
                 kv_dtype: torch.dtype = torch.float32, memory_budget: int | None = None) -> None:
        config = artifact.config
        window = context_window or config.context_window
        if not 0 < window <= config.context_window:
            raise EdgeLLMError(f"context window {window} is outside 1..{config.context_window} for this artifact")
        self.threads = threads or default_threads()
        torch.set_num_threads(self.threads)
        self.artifact = artifact
        self.config = config
        self.context_window = window
        self.prefill_chunk = min(config.prefill_chunk_size, window)
        self.memory = estimate_memory(config, window, kv_dtype)
        if memory_budget is not None and self.memory.total_bytes > memory_budget:
            raise MemoryBudgetError(
                f"model needs about {self.memory.describe()}, over the budget of {memory_budget / 2**20:.0f} MiB; "
                "a smaller context window shrinks the KV cache"
            )
        tok = config.tokenizer
        self.tokenizer = Tokenizer.from_file(
            artifact.tokenizer_path,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            add_bos_token=tok.add_bos_token,
            stop_token_ids=tok.stop_token_ids,
        )
        self.chat_template = artifact.chat_template
        self.model = Transformer(config, artifact.weights()).eval()
        self.cache = self.model.new_cache(window, dtype=kv_dtype)
        self._cached_ids: list[int] = []  # tokens whose keys/values the cache holds, from position 0
        self._prefilled = 0  # the first tokens of _cached_ids that came from a prefill (the rest: decode steps)
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model: str | Path, *, quantization: str | None = None, verify: bool = True,
             progress: bool = True, **kwargs: Any) -> Engine:
        """Load an artifact folder or a catalog name (compiled on first use); checks every file first."""
        folder = resolve_model(model, quantization=quantization, progress=progress)
        return cls(open_artifact(folder, verify=verify), **kwargs)

    @property
    def name(self) -> str:
        return self.artifact.folder.name

    # ---- prompts -------------------------------------------------------------------------------------
    def render(self, messages: Sequence[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True) -> str:
        """Chat messages → prompt text, with the model's own template."""
        if not self.chat_template:
            raise EdgeLLMError(f"{self.name} has no chat template; use a plain prompt instead")
        tok = self.config.tokenizer
        token = self.tokenizer.id_to_token
        return render_chat(
            self.chat_template,
            list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=token(tok.bos_token_id) if tok.bos_token_id is not None else "",
            eos_token=token(tok.eos_token_id) if tok.eos_token_id is not None else "",
            tools=tools,
        )

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return list(prompt) if not isinstance(prompt, str) else self.tokenizer.encode(prompt)

    # ---- layer 1: token steps -----------------------------------------------------------------------
    def _prefill(self, ids: list[int], stats: GenerationStats) -> torch.Tensor:
        """Run the prompt through the model (reusing the cached prefix); return the last logits (V,)."""
        reuse = 0
        limit = min(len(self._cached_ids), len(ids) - 1, self._prefilled)
        while reuse < limit and self._cached_ids[reuse] == ids[reuse]:
            reuse += 1
        # Greedy stays greedy: reuse only whole prefill chunks with the boundaries a fresh prefill uses (never KV
        # written by decode steps or by a chunk of another shape), so the result has the same bits as no reuse.
        reuse -= reuse % self.prefill_chunk
        stats.cached_tokens = reuse
        self._cached_ids = ids[:reuse]
        self._prefilled = len(ids)
        logits = None
        for start in range(reuse, len(ids), self.prefill_chunk):
            chunk = ids[start : start + self.prefill_chunk]
            logits = self.model(torch.tensor([chunk]), start, self.cache)
            self._cached_ids.extend(chunk)
        assert logits is not None
        return logits[0, -1]

    def _token_steps(self, ids: list[int], params: GenerationParams,
                     stats: GenerationStats) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield (token, processed logits) until the context is full; the caller decides when to stop."""
        defaults = self.config.sampling
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
        logits = self._prefill(ids, stats)
        stats.prefill_s = time.perf_counter() - t0
        generated: list[int] = []
        while True:
            logits = logits.float()
            for process in processors:
                logits = process(ids, generated, logits)
            for process in params.logits_processors:
                logits = process(generated, logits)
            token = sampler(logits, generator)
            generated.append(token)
            yield token, logits
            pos = len(self._cached_ids)
            if pos + 1 >= self.context_window:  # prompt + output may not exceed the window
                return
            logits = self.model(torch.tensor([[token]]), pos, self.cache)[0, -1]
            self._cached_ids.append(token)

    # ---- layer 2: text stream with stats --------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], params: GenerationParams | None = None) -> Iterator[StreamChunk]:
        """Stream text deltas; the final chunk carries finish_reason and stats. Text never splits a character."""
        params = params or GenerationParams()
        constraint = build_constraint(self, params)  # a bad schema/grammar raises here, before any token
        return self._stream_guarded(prompt, params, constraint)

    def _stream_guarded(self, prompt: str | Sequence[int], params: GenerationParams,
                        constraint: GrammarConstraint | None) -> Iterator[StreamChunk]:
        if not self._lock.acquire(blocking=False):
            raise EdgeLLMError("the engine is already generating; finish or close the other stream first")
        try:
            yield from self._stream_locked(prompt, params, constraint)
        finally:
            self._lock.release()

    def _stream_locked(self, prompt: str | Sequence[int], params: GenerationParams,
                       constraint: GrammarConstraint | None = None) -> Iterator[StreamChunk]:
        stats = GenerationStats()
        t_start = time.perf_counter()
        ids = self.encode(prompt)
        stats.tokenize_s = time.perf_counter() - t_start
        stats.prompt_tokens = len(ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.sampling.max_tokens
        if not ids:
            raise EdgeLLMError("the prompt is empty")
        if max_tokens < 1:
            raise EdgeLLMError("max_tokens must be at least 1")
        if len(ids) >= self.context_window:
            raise ContextOverflowError(len(ids), self.context_window)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.config.tokenizer.stop_token_ids)
        if constraint is not None:  # the grammar mask goes last, after penalties and user processors
            stop_ids.update(constraint.stop_token_ids)
            params = replace(params, logits_processors=(*params.logits_processors, constraint.process))
        detok = StreamingDetokenizer(self.tokenizer)
        stops = StopMatcher(list(params.stop))
        finish = "length"
        t_first = None
        steps = self._token_steps(ids, params, stats)
        try:
            for token, logits in steps:
                now = time.perf_counter()
                if t_first is None:
                    t_first = now
                    stats.ttft_s = now - t_start
                if constraint is not None and not constraint.accept(token):
                    finish = "stop"  # a token the grammar rejects ends the output, marked incomplete
                    break
                if token in stop_ids:
                    finish = "stop"
                    break
                stats.completion_tokens += 1
                text, hit = stops.feed(detok.add(token))
                logprobs = [_logprob(logits, token, params.top_logprobs)] if params.top_logprobs is not None else []
                if hit:
                    finish = "stop"
                    if text:
                        yield StreamChunk(text, [token], logprobs)
                    break
                yield StreamChunk(text, [token], logprobs)
                if constraint is not None and constraint.finished:
                    finish = "stop"  # the grammar can only end here: skip sampling the forced EOS
                    break
                if stats.completion_tokens >= max_tokens:
                    break
        finally:
            steps.close()
        tail = "" if finish == "stop" and stops.hit else stops.feed(detok.flush())[0] + stops.flush()
        t_end = time.perf_counter()
        if t_first is not None:
            stats.decode_s = t_end - t_first
        stats.total_s = t_end - t_start
        complete = None if constraint is None else finish == "stop" and not stops.hit and constraint.complete
        budget_closed = constraint is not None and not stops.hit and constraint.budget_closed
        if constraint is not None:
            stats.guard_interventions = constraint.guard_interventions
            finish = "length" if budget_closed else finish  # closed early for the budget: the limit was hit
        yield StreamChunk(tail, [], [], finish_reason=finish, stats=stats, complete=complete,
                          unenforced=constraint.unenforced if constraint is not None else (),
                          budget_closed=budget_closed)

    # ---- layer 3: collect ---------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None) -> GenerationResult:
        """Run a request to completion."""
        texts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob] = []
        for chunk in self.stream(prompt, params):
            texts.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            if chunk.finish_reason is not None:
                assert chunk.stats is not None
                return GenerationResult("".join(texts), ids, chunk.finish_reason, chunk.stats, logprobs,
                                        complete=chunk.complete, unenforced=chunk.unenforced,
                                        budget_closed=chunk.budget_closed)
        raise AssertionError("stream ended without a final chunk")

    def chat(self, messages: Sequence[dict[str, Any]], params: GenerationParams | None = None,
             **render_kwargs: Any) -> GenerationResult:
        return self.generate(self.render(messages, **render_kwargs), params)

    def stream_chat(self, messages: Sequence[dict[str, Any]], params: GenerationParams | None = None,
                    **render_kwargs: Any) -> Iterator[StreamChunk]:
        return self.stream(self.render(messages, **render_kwargs), params)

    def chat_json(self, messages: Sequence[dict[str, Any]], schema: dict[str, Any] | None,
                  params: GenerationParams | None = None, **render_kwargs: Any) -> Any:
        """A reply constrained to `schema` (any JSON object if None), parsed and validated with jsonschema.

        Raises SchemaError (unsupported schema) or StructuredOutputError (incomplete or invalid output).
        """
        from edgellm.structured.api import chat_json

        return chat_json(self, messages, schema, params, **render_kwargs)

    # ---- evaluation and lifecycle -------------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits (T, V) for every position of `ids`, from an empty cache (for evaluation)."""
        if len(ids) > self.context_window:
            raise ContextOverflowError(len(ids), self.context_window)
        with self._lock:
            self._cached_ids = []
            out = [self.model(torch.tensor([list(ids[s : s + self.prefill_chunk])]), s, self.cache, all_logits=True)[0]
                   for s in range(0, len(ids), self.prefill_chunk)]
            self._cached_ids = list(ids)
        return torch.cat(out)

    def reset(self) -> None:
        """Forget the cached conversation prefix."""
        self._cached_ids = []

    def close(self) -> None:
        """Release the KV cache and weights now."""
        self.cache.release()
        self._cached_ids = []
        del self.model


def _logprob(logits: torch.Tensor, token: int, top: int) -> TokenLogprob:
    logp = torch.log_softmax(logits.float(), dim=-1)
    best = torch.topk(logp, top) if top > 0 else None
    pairs = tuple(zip(best.indices.tolist(), best.values.tolist())) if best is not None else ()
    return TokenLogprob(token, float(logp[token]), pairs)
