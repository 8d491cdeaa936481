"""The two backends a benchmark drives: edgellm's own engine and llama.cpp (via llama-cpp-python).

`locate` and `describe` run in the benchmark's parent process: they compile or fetch the model and read
its metadata there, so a worker — whose peak resident memory is the figure reported — holds only what its
backend needs to run (the llama.cpp worker never imports torch nor parses the GGUF's tables in Python).
Both run greedy decoding for exactly `gen` tokens (end-of-sequence ignored) on a prompt of exactly
`prompt` tokens, built by each backend's own tokenizer from the same text, and record a timestamp
per generated token so inter-token latency comes from raw samples.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Protocol

from edgellm.bench.system import EnergyMeter, max_temperature
from edgellm.errors import EdgeLLMError

if TYPE_CHECKING:
    from llama_cpp import Llama

    from edgellm.runtime.engine import Engine

PROMPT_TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were programmed "
    "by rewiring panels; stored programs replaced the wires, assemblers replaced the numbers, and compilers "
    "replaced the assemblers. Each layer let people think about larger problems while trusting the layer below. "
)
HISTORY_TEXT = (
    "User: Here are my meeting notes from this week. Monday we reviewed the budget and moved two projects to "
    "next quarter. Tuesday the design team showed the new onboarding screens, which tested well with users. "
    "Wednesday we interviewed three candidates for the support role and liked the second one best. "
)
LLAMA_CPP_MISSING = (
    "llama-cpp-python is not installed; install the optional extra with pip install -e '.[compare]' "
    "(it compiles llama.cpp from source, about 25 minutes on two cores)"
)


@dataclass
class RunSample:
    """One request's raw timings; every summary figure is computed from these."""

    prompt_tokens: int
    depth_tokens: int
    ttft_s: float  # request start → first token chosen
    prefill_s: float  # the prompt's forward passes only
    token_times_s: list[float] = field(default_factory=list)  # request start → each generated token
    energy_j: float | None = None
    temperature_c: float | None = None
    complete: bool | None = None  # constrained runs: did the output reach a valid end?
    weights: str | None = None  # edgellm: where the weights were as the run began (mapped, in huge pages)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fixed_ids(encode: Callable[[str], list[int]], text: str, n: int) -> list[int]:
    """Exactly n tokens of real text (repeated as needed), so every run does the same work."""
    piece = list(encode(text))
    if not piece:
        raise EdgeLLMError("the benchmark text encodes to no tokens")
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(piece)
    return ids[:n]


class Backend(Protocol):
    name: str

    def load(self) -> float: ...
    def tokens(self, text: str, n: int) -> list[int]: ...
    def run(self, prompt: list[int], gen: int, history: list[int], schema: dict[str, Any] | None) -> RunSample: ...
    def breakdown(self, prompt_tokens: int, gen: int) -> dict[str, float | None]: ...
    def close(self) -> None: ...


class _Timed:
    """Energy and temperature around one measured request."""

    def __init__(self) -> None:
        self.meter = EnergyMeter()

    def __enter__(self) -> _Timed:
        self.meter.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.energy_j = self.meter.stop()
        self.temperature_c = max_temperature()


# ---- edgellm ---------------------------------------------------------------------------------------------
class NativeBackend:
    """edgellm's Engine on a compiled artifact."""

    name = "edgellm"

    def __init__(self, folder: Path, threads: int, n_ctx: int) -> None:
        self.folder = folder
        self.threads, self.n_ctx = threads, n_ctx
        self.engine: Engine | None = None

    def load(self) -> float:
        """Seconds to verify (sha256) and load the artifact; replaces any engine already loaded."""
        from edgellm.runtime.engine import Engine

        if self.engine is not None:
            self.engine.close()
            self.engine = None
        t0 = time.perf_counter()
        self.engine = Engine.load(self.folder, threads=self.threads, context_window=self.n_ctx, progress=False)
        return time.perf_counter() - t0

    def _loaded(self) -> Engine:
        if self.engine is None:
            raise EdgeLLMError("the edgellm backend has no engine: load() it first")
        return self.engine

    def tokens(self, text: str, n: int) -> list[int]:
        return fixed_ids(self._loaded().tokenizer.encode, text, n)

    def _params(self, gen: int, schema: dict[str, Any] | None) -> Any:
        from edgellm.generation import GenerationParams
        from edgellm.structured import ResponseFormat

        fmt = ResponseFormat(type="json_schema", schema=schema) if schema is not None else None
        # A constrained reply ends where its grammar does; a plain one runs to exactly `gen` tokens.
        # --depth measures a request whose history is cached, as in a chat: reuse every cached token
        return GenerationParams(max_tokens=gen, temperature=0.0, repetition_penalty=1.0,
                                ignore_eos=schema is None, response_format=fmt, prefix_reuse="any")

    def run(self, prompt: list[int], gen: int, history: list[int], schema: dict[str, Any] | None) -> RunSample:
        engine = self._loaded()  # it keeps its own thread count (torch's too, on torch's path)
        engine.reset()
        if history:  # fill the KV cache with the history; the measured request reuses it as its prefix
            from edgellm.generation import GenerationParams

            engine.generate(history, GenerationParams(max_tokens=1, temperature=0.0))
        params = self._params(gen, schema)
        times: list[float] = []
        final = None
        weights = engine.huge_pages.describe()
        with _Timed() as timed:
            t0 = time.perf_counter()
            for chunk in engine.stream(history + prompt, params):
                now = time.perf_counter() - t0
                times.extend([now] * len(chunk.token_ids))
                if chunk.finish_reason is not None:
                    final = chunk
        assert final is not None and final.stats is not None
        if schema is not None and final.complete is None:
            raise EdgeLLMError("this edgellm engine ignores response_format (structured output is not available)")
        if final.stats.cached_tokens != len(history):
            raise EdgeLLMError(f"expected {len(history)} cached history tokens, engine reused {final.stats.cached_tokens}")
        return RunSample(len(prompt), len(history), final.stats.ttft_s, final.stats.prefill_s, times,
                         timed.energy_j, timed.temperature_c, final.complete, weights)

    def breakdown(self, prompt_tokens: int, gen: int) -> dict[str, float | None]:
        """Stages of one chat request: template, tokenize, prefill, decode (streamed detokenize included)."""
        from edgellm.generation import GenerationParams
        from edgellm.tokenizer import StreamingDetokenizer

        engine = self._loaded()
        engine.reset()
        words = (PROMPT_TEXT * (1 + prompt_tokens // 40)).split()[: max(1, prompt_tokens * 3 // 4)]
        t0 = time.perf_counter()
        text = engine.render([{"role": "user", "content": " ".join(words)}]) if engine.chat_template else " ".join(words)
        t1 = time.perf_counter()
        ids = engine.tokenizer.encode(text)
        t2 = time.perf_counter()
        result = engine.generate(ids, GenerationParams(max_tokens=gen, temperature=0.0, ignore_eos=True))
        t3 = time.perf_counter()
        detok = StreamingDetokenizer(engine.tokenizer)
        for token in result.token_ids:
            detok.add(token)
        detok.flush()
        t4 = time.perf_counter()
        stats = result.stats
        return {"template_s": t1 - t0, "tokenize_s": t2 - t1, "prefill_s": stats.prefill_s,
                "decode_s": stats.decode_s, "detokenize_s": t4 - t3, "request_s": t3 - t2,
                "prompt_tokens": len(ids), "gen_tokens": len(result.token_ids)}

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


# ---- llama.cpp -------------------------------------------------------------------------------------------
class LlamaCppBackend:
    """llama.cpp through llama-cpp-python on the model's source GGUF file."""

    name = "llama.cpp"

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        require_llama_cpp()
        self.gguf = gguf
        self.threads, self.n_ctx = threads, n_ctx
        self.llm: Llama | None = None

    def load(self) -> float:
        from llama_cpp import Llama

        if self.llm is not None:
            self.llm.close()
            self.llm = None
        t0 = time.perf_counter()
        self.llm = Llama(model_path=str(self.gguf), n_threads=self.threads, n_threads_batch=self.threads,
                         n_ctx=self.n_ctx, n_batch=512, n_ubatch=512, verbose=False)
        elapsed = time.perf_counter() - t0
        self.n_vocab = self.llm.n_vocab()
        return elapsed

    def _loaded(self) -> Llama:
        if self.llm is None:
            raise EdgeLLMError("the llama.cpp backend has no model: load() it first")
        return self.llm

    def tokens(self, text: str, n: int) -> list[int]:
        llm = self._loaded()
        return fixed_ids(lambda t: llm.tokenize(t.encode("utf-8"), add_bos=False), text, n)

    def _next(self) -> int:
        """Greedy choice from the logits of the last evaluated position."""
        import llama_cpp
        import numpy as np

        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(self._loaded().ctx, -1), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def run(self, prompt: list[int], gen: int, history: list[int], schema: dict[str, Any] | None) -> RunSample:
        if schema is not None:
            raise EdgeLLMError("the llama.cpp backend is measured without a JSON Schema constraint only")
        llm = self._loaded()
        llm.reset()
        if history:
            llm.eval(history)
        times: list[float] = []
        with _Timed() as timed:
            t0 = time.perf_counter()
            llm.eval(prompt)
            prefill = time.perf_counter() - t0
            token = self._next()
            times.append(time.perf_counter() - t0)
            llm.detokenize([token])
            for _ in range(gen - 1):
                llm.eval([token])
                token = self._next()
                times.append(time.perf_counter() - t0)
                llm.detokenize([token])  # what a streaming caller does per token, as edgellm's stream does
        return RunSample(len(prompt), len(history), times[0], prefill, times, timed.energy_j, timed.temperature_c)

    def breakdown(self, prompt_tokens: int, gen: int) -> dict[str, float | None]:
        """Stages of one raw-text request (llama-cpp-python's chat templating is not timed: None)."""
        llm = self._loaded()
        llm.reset()
        words = (PROMPT_TEXT * (1 + prompt_tokens // 40)).split()[: max(1, prompt_tokens * 3 // 4)]
        t1 = time.perf_counter()
        ids = llm.tokenize(" ".join(words).encode("utf-8"), add_bos=False)
        t2 = time.perf_counter()
        llm.eval(ids)
        t_prefill = time.perf_counter()
        out = [self._next()]
        for _ in range(gen - 1):
            llm.eval([out[-1]])
            out.append(self._next())
        t3 = time.perf_counter()
        llm.detokenize(out)
        t4 = time.perf_counter()
        return {"template_s": None, "tokenize_s": t2 - t1, "prefill_s": t_prefill - t2, "decode_s": t3 - t_prefill,
                "detokenize_s": t4 - t3, "request_s": t3 - t2, "prompt_tokens": len(ids), "gen_tokens": len(out)}

    def close(self) -> None:
        if self.llm is not None:
            self.llm.close()
            self.llm = None


def gguf_path(model: str) -> Path:
    """The source GGUF of a catalog model (`name` or `name:scheme`), or a .gguf path as given."""
    path = Path(model).expanduser()
    if path.suffix == ".gguf" and path.is_file():
        return path
    from edgellm.catalog import CATALOG
    from edgellm.pull import pull
    from edgellm.resolve import split_model_name

    name, _ = split_model_name(model)
    if name not in CATALOG:
        raise EdgeLLMError(f"llama.cpp needs a catalog model or a .gguf file, not {model!r}")
    return Path(pull(name, progress=False))


def require_llama_cpp() -> None:
    """A one-line error naming the install command when llama-cpp-python is missing."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        raise EdgeLLMError(LLAMA_CPP_MISSING) from exc


def locate(kind: str, model: str, quantization: str | None) -> Path:
    """The file a backend runs: edgellm's compiled artifact folder (compiled once, untimed) or the GGUF."""
    if kind == "edgellm":
        from edgellm.resolve import resolve_model

        return resolve_model(model, quantization=quantization, progress=False)
    if kind == "llama.cpp":
        require_llama_cpp()
        return gguf_path(model)
    raise EdgeLLMError(f"unknown backend {kind!r}; use edgellm or llama.cpp")


def describe(kind: str, location: Path, n_ctx: int) -> dict[str, Any]:
    """What the report says about a backend's model file: format, bits, weight bytes read per token, ..."""
    if kind == "llama.cpp":
        from edgellm.bench.roofline import gguf_bits_per_parameter, gguf_weight_bytes_per_token

        return {
            "path": str(location),
            "format": "GGUF (source file)",
            "quantization": "source GGUF",
            "bits_per_parameter": gguf_bits_per_parameter(location),
            "weight_bytes_per_token": gguf_weight_bytes_per_token(location),
            "kv_cache_dtype": "float16",
            "n_ctx": n_ctx,
        }
    from edgellm.artifact.reader import open_artifact
    from edgellm.bench.roofline import artifact_weight_bytes_per_token
    from edgellm.families.config import check_kv_kind
    from edgellm.models.protocol import choose

    art = open_artifact(location, verify=False)
    return {
        "path": str(location),
        "format": "edgellm artifact",
        "quantization": art.config.quantization.scheme,
        "bits_per_parameter": art.manifest.bits_per_parameter,
        "parameters": art.manifest.parameter_count,
        "weight_bytes_per_token": artifact_weight_bytes_per_token(location),
        "kv_cache_dtype": {"f32": "float32", "f16": "float16", "q8": "int8"}[check_kv_kind(art.config.kv_cache)],
        "n_ctx": n_ctx,
        "decode_path": choose(art.config).decode,
    }


def make_backend(kind: str, location: Path, threads: int, n_ctx: int) -> Backend:
    """The backend a worker runs, on the file `locate` found."""
    if kind == "edgellm":
        return NativeBackend(location, threads, n_ctx)
    if kind == "llama.cpp":
        return LlamaCppBackend(location, threads, n_ctx)
    raise EdgeLLMError(f"unknown backend {kind!r}; use edgellm or llama.cpp")
