"""The Engine: the facade users call. It loads a verified artifact, renders and encodes prompts, and turns its
generation session's tokens (session/generation_session.py: the KV cache, prefix reuse, the token loop) into
the one text stream every consumer uses.

Its model (a Model, models/protocol.py) is the implementation `choose` picks once at load, with a reason: the
native library alone where the artifact and the CPU allow (models/native_model.py: then this process never
imports torch), else torch's Transformer, with native decode steps where they run (models/torch_native.py)."""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generator, Iterator, Sequence

import numpy as np

from edgellm.artifact.huge_pages import HugePageMover
from edgellm.artifact.reader import Artifact, open_artifact
from edgellm.errors import ContextOverflowError, EdgeLLMError, MemoryBudgetError
from edgellm.kernels.threads import default_threads
from edgellm.models.kv_space import KVSpace
from edgellm.models.load import load_model
from edgellm.models.protocol import NATIVE, TORCH, Choice, Model, choose
from edgellm.session.allocator import return_freed_memory, reuse_freed_memory
from edgellm.runtime.chat_template import render_chat
from edgellm.session.context import check_method
from edgellm.generation import (
    Constraint,
    ConstraintReport,
    GenerationParams,
    GenerationResult,
    GenerationStats,
    StreamChunk,
    TokenLogprob,
    Unconstrained,
)
from edgellm.families.config import check_kv_kind
from edgellm.runtime.memory import estimate_memory
from edgellm.runtime.draft import load_draft, plan_draft
from edgellm.runtime.planner import Plan, available_memory, plan_load
from edgellm.session.generation_session import GenerationSession
from edgellm.session.power import get_mode
from edgellm.session.prompt_cache import prompt_cache_budget
from edgellm.session.prompt_store import open_prompt_cache
from edgellm.session.speculative import check_method as check_speculative
from edgellm.session.speculative import draft_model_name
from edgellm.session.speculative_draft import DraftModel
from edgellm.runtime.stops import StopMatcher
from edgellm.tokenizer import StreamingDetokenizer, Tokenizer
from edgellm.telemetry.hook import observed

if TYPE_CHECKING:
    import torch

HUGE_PAGES_ENV = "EDGELLM_HUGE_PAGES"  # the default of Engine(huge_pages=...): background, wait or off
HUGE_PAGES_MODES = ("background", "wait", "off")
HUGE_PAGES_HEADROOM = 256 * 2**20  # free memory to leave beyond the weights moved into huge pages


def huge_pages_mode(choice: str | None = None) -> str:
    """`choice`, else the EDGELLM_HUGE_PAGES environment variable, else "background"; one of HUGE_PAGES_MODES."""
    mode = choice or os.environ.get(HUGE_PAGES_ENV, "").strip().lower() or "background"
    if mode not in HUGE_PAGES_MODES:
        raise EdgeLLMError(f"huge pages {mode!r}: choose one of {', '.join(HUGE_PAGES_MODES)} "
                           f"(from {HUGE_PAGES_ENV} when it is set)")
    return mode


def weights_stay_mapped(mode: str, *, streamed: bool) -> str | None:
    """Why an engine's weights stay mapped rather than move into huge pages (None when they move); `streamed`:
    its model's decode step reads mapped weights (the native step's), not torch's own copies."""
    if mode == "off":
        return f"{HUGE_PAGES_ENV}=off"
    return None if streamed else "torch decode path"


def _short_of_memory_for(nbytes: int) -> str | None:
    """Why `nbytes` of weights should stay in the page cache, which the OS can reclaim under pressure, rather than
    move into anonymous huge pages, which it cannot without swap (None when the free memory leaves room)."""
    available = available_memory()
    if available is None or available[0] >= nbytes + HUGE_PAGES_HEADROOM:
        return None
    return f"{available[0] / 2**20:.0f} MiB free ({available[1]}): weights stay in the reclaimable page cache"


class Engine:
    """A loaded model with its tokenizer and one generation session; one request at a time."""

    def __init__(self, artifact: Artifact, *, context_window: int | None = None, threads: int | None = None,
                 kv_dtype: torch.dtype | None = None, memory_budget: int | None = None,
                 kv_cache: str | None = None, power: str | None = None, huge_pages: str | None = None,
                 runtime: str | None = None, prompt_cache: int | None = None,
                 prompt_cache_dir: str | Path | None = None, speculative: str | None = None,
                 sequences: int = 1) -> None:
        """`huge_pages`: after loading, move the weights every decode step streams into transparent huge pages
        (artifact/huge_pages.py) in the "background" (the default), or "wait" for it, or leave them mapped
        ("off"); the default comes from the EDGELLM_HUGE_PAGES environment variable when it is set. `kv_dtype`: the
        float type of the f32 KV kind's storage on torch's path (float32 when None; another keeps the model on
        torch's path). `runtime`: "native" (the native library alone — prompts token by token through the
        decode step where the kernel library has no native prefill (the scalar variant) — or an error saying why
        it cannot), "torch" (torch's Transformer, its decode steps native where they can be), or None: native where it
        can prefill natively (models/protocol.py's `choose` decides, `self.choice` says what and why). `prompt_cache`:
        bytes of earlier prompts' KV kept beside the live cache (session/prompt_cache.py; off by default),
        `prompt_cache_dir`: a folder they are persisted in (256 MiB of them when `prompt_cache` is None).
        `speculative`: the speculative decoding of requests that name none ("lookup": session/speculative.py;
        "draft:MODEL": that draft model is loaded beside this one, runtime/draft.py).
        `sequences`: KV caches its memory estimate counts (a server's batch slots, runtime/batching.py)."""
        self.choice: Choice = choose(artifact.config, runtime, kv_dtype)  # which implementation, and why
        huge_pages = huge_pages_mode(huge_pages)
        reuse_freed_memory()  # before the first activations are allocated (session/allocator.py)
        config = artifact.config
        window = context_window or config.context_window
        if not 0 < window <= config.context_window:
            raise EdgeLLMError(f"context window {window} is outside 1..{config.context_window} for this artifact")
        self.power = get_mode(power) if power else None  # threads and pacing (session/power.py)
        self.speculative = check_speculative(speculative) if speculative is not None else None
        self.threads = threads or (self.power.threads(default_threads()) if self.power else default_threads())
        self.artifact = artifact
        self.config = config
        self.context_window = window
        self.kv_cache = check_kv_kind(kv_cache or config.kv_cache)
        self.memory = estimate_memory(config, window, kv_dtype, self.kv_cache, sequences)
        cache_budget = prompt_cache_budget(prompt_cache, prompt_cache_dir)
        self.memory = replace(self.memory, prompt_cache_bytes=cache_budget)
        draft_name = draft_model_name(self.speculative) if self.speculative is not None else None
        draft_plan = (plan_draft(draft_name, window=window, kv_cache=self.kv_cache, sequences=sequences)
                      if draft_name is not None else None)
        if draft_plan is not None:
            self.memory = replace(self.memory, draft_bytes=draft_plan.bytes)
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
        self.draft: DraftModel | None = None  # the draft model of speculative="draft:MODEL"
        if draft_plan is not None:
            self.draft = load_draft(draft_plan, self.tokenizer, window=window, kv_cache=self.kv_cache,
                                    threads=self.threads, prefill_chunk=min(config.prefill_chunk_size, window))
        weights = artifact.weights(arrays=self.choice.implementation == NATIVE)  # numpy arrays: no torch
        model = load_model(self.choice, config, weights, threads=self.threads, window=window, kv_dtype=kv_dtype)
        cache = model.new_cache(window, kind=self.kv_cache)
        # how single-token steps run: the model's own words, or for torch alone why they are not native
        self.decode_path = self.choice.decode if self.choice.implementation == TORCH else model.describe()
        self._model: Model = model
        self.session = GenerationSession(model, cache, context_window=window,
                                         prefill_chunk=min(config.prefill_chunk_size, window),
                                         sampling=config.sampling, power=self.power)
        if self.draft is not None:
            self.session.draft = self.draft.runner()
        if cache_budget:
            files = {name: entry.sha256 for name, entry in artifact.manifest.files.items()}
            self.session.prompt_cache = open_prompt_cache(cache_budget, prompt_cache_dir, files, cache)
        streamed = model.streamed_spans()
        stay_mapped = (weights_stay_mapped(huge_pages, streamed=bool(streamed))
                       or _short_of_memory_for(sum(n for _, n in streamed)))
        self.huge_pages = HugePageMover(weights.mappings, streamed, stay_mapped)
        self.huge_pages.start()
        if huge_pages == "wait":
            self.huge_pages.wait()
        return_freed_memory()  # the tokenizer's and loader's temporaries (session/allocator.py)
        self.plan: Plan | None = None  # the memory plan, when loaded through Engine.load
        self._lock = threading.Lock()

    @classmethod
    def load(cls, model: str | Path, *, quantization: str | None = None, verify: bool = True,
             progress: bool = True, context_window: int | None = None, kv_cache: str | None = None,
             memory_budget: int | None = None, degrade: bool = False, **kwargs: Any) -> Engine:
        """Load an artifact folder or a catalog name (compiled on first use); checks every file first.

        The memory planner runs first: over `memory_budget` (default: the free memory the OS reports, less
        a margin) it refuses, listing what would fit, or with `degrade` loads the first step that fits.
        """
        reserved = prompt_cache_budget(kwargs.get("prompt_cache"), kwargs.get("prompt_cache_dir"))
        speculative = kwargs.get("speculative")
        draft_name = draft_model_name(check_speculative(speculative)) if speculative is not None else None
        draft_bytes = 0
        if draft_name is not None:  # counted at the window asked for (else the draft's own)
            draft = plan_draft(draft_name, window=context_window or 2**31, kv_cache=kv_cache,
                               sequences=kwargs.get("sequences", 1), progress=progress)
            draft_bytes = draft.bytes
        folder, plan = plan_load(model, quantization=quantization, context_window=context_window,
                                 kv_cache=kv_cache, memory_budget=memory_budget, degrade=degrade, progress=progress,
                                 reserved=reserved, sequences=kwargs.get("sequences", 1), draft_bytes=draft_bytes)
        chosen = plan.chosen
        assert chosen is not None
        artifact = open_artifact(folder, verify=verify, check_weights_meanwhile=True)  # hashed while the tokenizer loads
        engine = cls(artifact, context_window=chosen.context_window, kv_cache=chosen.kv_cache, **kwargs)
        engine.plan = plan
        return engine

    @property
    def name(self) -> str:
        return self.artifact.folder.name

    # the session's parts, settable (tests swap the cache or the model, or shrink the prefill chunk)
    @property
    def model(self) -> Model:
        return self._model

    @model.setter
    def model(self, model: Model) -> None:
        self._model = self.session.model = model

    @property
    def cache(self) -> KVSpace:
        return self.session.cache

    @cache.setter
    def cache(self, cache: KVSpace) -> None:
        self.session.cache = cache

    @property
    def prefill_chunk(self) -> int:
        return self.session.prefill_chunk

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int) -> None:
        self.session.prefill_chunk = chunk

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

    # ---- layer 2: text stream with stats --------------------------------------------------------------
    def stream(self, prompt: str | Sequence[int], params: GenerationParams | None = None
               ) -> Generator[StreamChunk, None, None]:
        """Stream text deltas; the final chunk carries finish_reason and stats. Text never splits a character."""
        params = params or GenerationParams()
        constraint = self.constraint(params)  # a bad schema/grammar raises here, before any token
        return self._stream_guarded(prompt, params, constraint)

    def constraint(self, params: GenerationParams) -> Constraint | None:
        """The grammar constraint of `params.response_format` for this model's vocabulary (None without one)."""
        if params.response_format is None or params.response_format.type == "text":
            return None  # unconstrained: neither xgrammar nor the torch it imports are loaded
        from edgellm.structured.processor import build_constraint

        return build_constraint(self.tokenizer, self.config.model.vocab_size, params,
                                stop_token_ids=self.config.tokenizer.stop_token_ids, threads=self.threads,
                                default_max_tokens=self.config.sampling.max_tokens)

    def stream_on(self, session: GenerationSession, prompt: str | Sequence[int],
                  params: GenerationParams | None = None) -> Generator[StreamChunk, None, None]:
        """As `stream`, on `session` (one of a batch's sequences, runtime/batching.py) instead of the engine's own:
        no lock, its caller owns that session."""
        params = params or GenerationParams()
        constraint = self.constraint(params)
        return observed(self, self._stream_locked(prompt, params, constraint, session))

    def _stream_guarded(self, prompt: str | Sequence[int], params: GenerationParams,
                        constraint: Constraint | None) -> Generator[StreamChunk, None, None]:
        if not self._lock.acquire(blocking=False):
            raise EdgeLLMError("the engine is already generating; finish or close the other stream first")
        try:
            yield from observed(self, self._stream_locked(prompt, params, constraint))  # telemetry, if enabled
        finally:
            self._lock.release()

    def _stream_locked(self, prompt: str | Sequence[int], params: GenerationParams,
                       constraint: Constraint | None = None,
                       session: GenerationSession | None = None) -> Generator[StreamChunk, None, None]:
        """One request on `session` (the engine's own when None): its checks and settings, the text loop, then the
        final chunk with the constraint's report."""
        session = session or self.session
        stats = GenerationStats()
        t_start = time.perf_counter()
        ids = self.encode(prompt)
        stats.tokenize_s = time.perf_counter() - t_start
        stats.prompt_tokens = len(ids)
        request = self._request(ids, params, constraint or Unconstrained())
        stats.grammar_s = request.constraint.prepare_s
        # room for the prompt and every token asked for, in one allocation: growing the cache mid-reply
        # would copy it and hold the old and new caches at once
        session.cache.reserve(min(self.context_window, len(ids) + request.max_tokens))
        end = yield from self._text_loop(session, ids, request, stats, t_start)
        report = request.constraint.report(end.finish, stop_string=end.stop_string)
        t_end = time.perf_counter()
        if end.t_first is not None:
            stats.decode_s = t_end - end.t_first
        stats.total_s = t_end - t_start
        stats.guard_interventions = report.guard_interventions
        yield _final_chunk(end.tail, report, stats)

    def _request(self, ids: list[int], params: GenerationParams, constraint: Constraint) -> _Request:
        """The checked request: its limits, the engine's defaults filled in, its stop tokens and processors."""
        max_tokens = params.max_tokens if params.max_tokens is not None else self.config.sampling.max_tokens
        if not ids:
            raise EdgeLLMError("the prompt is empty")
        if max_tokens < 1:
            raise EdgeLLMError("max_tokens must be at least 1")
        if len(ids) >= self.context_window:
            raise ContextOverflowError(len(ids), self.context_window)
        if params.context_shift is not None:
            check_method(params.context_shift)
        if params.speculative is None and self.speculative is not None:
            params = replace(params, speculative=self.speculative)
        if params.speculative is not None:
            name = draft_model_name(check_speculative(params.speculative))
            if name is not None and (self.draft is None or self.draft.name != name):
                loaded = f"the loaded one is {self.draft.name!r}" if self.draft is not None else "none is loaded"
                raise EdgeLLMError(f"draft model {name!r} is not loaded ({loaded}): load the engine with "
                                   f"speculative='draft:{name}' (--speculative draft:{name})")
        stop_ids = set(params.stop_token_ids) | constraint.stop_token_ids
        if not params.ignore_eos:
            stop_ids.update(self.config.tokenizer.stop_token_ids)
        return _Request(params, max_tokens, frozenset(stop_ids), constraint)

    def _text_loop(self, session: GenerationSession, ids: list[int], request: _Request, stats: GenerationStats,
                   t_start: float) -> Generator[StreamChunk, None, _Ending]:
        """Stream the reply's text chunks until a stop (token, string, the constraint's end) or the length limit;
        return how it ended."""
        params, constraint = request.params, request.constraint
        detok = StreamingDetokenizer(self.tokenizer)
        stops = StopMatcher(list(params.stop))
        finish = "length"
        t_first = None
        # the constraint's processors go last, after penalties and the user's
        steps = session.token_steps(ids, params, stats, constraint_processors=constraint.logits_processors(),
                                    constraint_fork=constraint.fork)
        try:
            for token, logits in steps:
                if t_first is None:
                    t_first = time.perf_counter()
                    stats.ttft_s = t_first - t_start
                if not constraint.accept(token) or token in request.stop_ids:
                    finish = "stop"  # a stop token, or one the constraint rejects (the output is then incomplete)
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
                if constraint.finished:
                    finish = "stop"  # only an end can follow: skip sampling the forced EOS
                    break
                if stats.completion_tokens >= request.max_tokens:
                    break
        finally:
            steps.close()
        tail = "" if finish == "stop" and stops.hit else stops.feed(detok.flush())[0] + stops.flush()
        return _Ending(finish, tail, stops.hit, t_first)

    # ---- layer 3: collect ---------------------------------------------------------------------------------
    def generate(self, prompt: str | Sequence[int], params: GenerationParams | None = None) -> GenerationResult:
        """Run a request to completion."""
        return collect(self.stream(prompt, params))

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
    def logits(self, ids: Sequence[int], *, step_from: int | None = None) -> torch.Tensor:
        """Next-token logits (T, V) for every position of `ids`, from an empty cache (for evaluation).

        Positions before `step_from` (all by default) go through the prefill chunks; from `step_from` on,
        tokens are fed one at a time, as generation computes them (the native decode step where it runs).
        """
        import torch  # evaluation compares in torch

        with self._lock:
            return torch.from_numpy(self.session.logits(ids, step_from=step_from))

    def reset(self) -> None:
        """Forget the cached conversation prefix."""
        self.session.reset()

    def close(self) -> None:
        """Release the KV cache and weights now."""
        self.huge_pages.stop()
        self.session.close()
        self.draft = None
        del self._model


@dataclass(frozen=True)
class _Request:
    """A request as the text loop runs it: its parameters with the engine's defaults and the constraint's
    processors, its reply length, every token id that ends it, and its constraint."""

    params: GenerationParams
    max_tokens: int
    stop_ids: frozenset[int]
    constraint: Constraint


@dataclass(frozen=True)
class _Ending:
    """How the text loop ended: the finish reason, the text still held back, whether a stop string ended it, and
    when the first token came (None: none did)."""

    finish: str
    tail: str
    stop_string: bool
    t_first: float | None


def collect(stream: Iterator[StreamChunk]) -> GenerationResult:
    """A stream's chunks gathered into its result (the final chunk carries the finish reason and stats)."""
    texts: list[str] = []
    ids: list[int] = []
    logprobs: list[TokenLogprob] = []
    for chunk in stream:
        texts.append(chunk.text)
        ids.extend(chunk.token_ids)
        logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            assert chunk.stats is not None
            return GenerationResult("".join(texts), ids, chunk.finish_reason, chunk.stats, logprobs,
                                    complete=chunk.complete, unenforced=chunk.unenforced, narrowed=chunk.narrowed,
                                    budget_closed=chunk.budget_closed)
    raise AssertionError("stream ended without a final chunk")


def _final_chunk(tail: str, report: ConstraintReport, stats: GenerationStats) -> StreamChunk:
    """The stream's last chunk: the text held back, the finish reason, the stats and the constraint's fields."""
    return StreamChunk(tail, [], [], finish_reason=report.finish_reason, stats=stats, complete=report.complete,
                       unenforced=report.unenforced, narrowed=report.narrowed, budget_closed=report.budget_closed)


def _logprob(logits: np.ndarray, token: int, top: int) -> TokenLogprob:
    """The sampled token's log-probability and the `top` most likely tokens' (highest first), from float32
    logits as torch's log_softmax computes them (max-shifted, the sum in float32)."""
    shifted = logits.astype(np.float32) - logits.max()
    logp = shifted - np.log(np.exp(shifted).sum(dtype=np.float32))
    if top <= 0:
        return TokenLogprob(token, float(logp[token]), ())
    best = np.argpartition(-logp, top - 1)[:top] if top < logp.size else np.arange(logp.size)
    best = best[np.lexsort((best, -logp[best]))]  # highest first, ties by the lower id
    return TokenLogprob(token, float(logp[token]), tuple((int(i), float(logp[i])) for i in best))
