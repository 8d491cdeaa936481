"""How often a first run answers the README question: "What is the capital of France?" asked N times.

For each catalog model, with the model's defaults (its default scheme and its authors' sampling), counts
the replies whose first non-empty line names Paris; with `--llama-cpp`, llama.cpp (llama-cpp-python, from
`pip install -e ".[compare]"`) on the same GGUF too, at llama.cpp's own sampler defaults (top-k 40,
top-p 0.95, min-p 0.05, no repetition penalty) and the same temperature as edgellm's default for that
model. A model without a chat template (gemma3-270m is a base model) gets the question as a plain
completion, "Q: ...\\nA:", on both engines.

Each run draws a new seed base (printed; `--seed` repeats a run). From the repository root:

    python scripts/first_answer_rate.py                       # the three catalog models, 20 times each
    python scripts/first_answer_rate.py --llama-cpp --threads 2
    python scripts/first_answer_rate.py --models smollm2-135m --temperature 0.5 --verbose
    python scripts/first_answer_rate.py --models smollm2-135m --runs 50 --repetition-penalty 1.2
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass, field

from edgellm.catalog import CATALOG
from edgellm.generation import GenerationParams
from edgellm.pull import pull
from edgellm.runtime.engine import Engine

QUESTION = "What is the capital of France?"
COMPLETION_PROMPT = f"Q: {QUESTION}\nA:"  # for a model with no chat template (a base model)
PARIS = re.compile(r"\bparis\b", re.IGNORECASE)


def first_line(text: str) -> str:
    """The first line of `text` that is not blank, stripped ('' if none)."""
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def names_paris(text: str) -> bool:
    return PARIS.search(first_line(text)) is not None


@dataclass
class Tally:
    """Replies of one engine on one model."""

    engine: str
    model: str
    setup: str
    replies: list[str] = field(default_factory=list)

    @property
    def hits(self) -> int:
        return sum(names_paris(r) for r in self.replies)

    def row(self) -> str:
        misses = [first_line(r) for r in self.replies if not names_paris(r)]
        example = f"`{misses[0][:50]}`" if misses else ""
        return f"| {self.model} | {self.engine} | {self.setup} | {self.hits}/{len(self.replies)} | {example} |"


def run_edgellm(name: str, seeds: list[int], args: argparse.Namespace) -> tuple[Tally, bool, float]:
    """`name` at its defaults; also whether it has a chat template (else it was asked as a completion) and
    the temperature it sampled at."""
    engine = Engine.load(name, progress=False, threads=args.threads)
    chat = bool(engine.chat_template)
    s = engine.config.sampling
    temperature = s.temperature if args.temperature is None else args.temperature
    penalty = s.repetition_penalty if args.repetition_penalty is None else args.repetition_penalty
    setup = (f"{engine.config.quantization.scheme}, "
             f"T {temperature}, top-p {s.top_p}, top-k {s.top_k}, rep {penalty}"
             + (f", frequency {args.frequency_penalty}" if args.frequency_penalty else "")
             + ("" if chat else ", completion"))
    tally = Tally("edgellm", name, setup)
    for seed in seeds:
        params = GenerationParams(max_tokens=args.max_tokens, seed=seed, temperature=args.temperature,
                                  repetition_penalty=args.repetition_penalty,
                                  frequency_penalty=args.frequency_penalty)
        result = (engine.chat([{"role": "user", "content": QUESTION}], params) if chat
                  else engine.generate(COMPLETION_PROMPT, params))
        tally.replies.append(result.text)
        if args.verbose:
            print(f"  edgellm {name} seed {seed}: {first_line(result.text)!r}", file=sys.stderr)
    engine.close()
    return tally, chat, temperature


def run_llama_cpp(name: str, seeds: list[int], chat: bool, temperature: float,
                  args: argparse.Namespace) -> Tally:
    """llama.cpp on the catalog model's GGUF, its sampler defaults, edgellm's temperature for the model."""
    from llama_cpp import Llama  # optional: pip install -e ".[compare]"

    llm = Llama(model_path=str(pull(name, progress=False)), n_ctx=512, n_threads=args.threads or os.cpu_count(),
                verbose=False)
    tally = Tally("llama.cpp", name, f"GGUF, T {temperature}, llama.cpp defaults" + ("" if chat else ", completion"))
    for seed in seeds:
        if chat:
            out = llm.create_chat_completion([{"role": "user", "content": QUESTION}], temperature=temperature,
                                             max_tokens=args.max_tokens, seed=seed)
            text = out["choices"][0]["message"]["content"] or ""
        else:
            out = llm.create_completion(COMPLETION_PROMPT, temperature=temperature, max_tokens=args.max_tokens,
                                        seed=seed)
            text = out["choices"][0]["text"]
        tally.replies.append(text)
        if args.verbose:
            print(f"  llama.cpp {name} seed {seed}: {first_line(text)!r}", file=sys.stderr)
    llm.close()
    return tally


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(CATALOG), help="comma-separated catalog names (default: all)")
    parser.add_argument("--runs", type=int, default=20, help="questions per model and engine (default 20)")
    parser.add_argument("--seed", type=int, help="first seed (default: a new random one each run)")
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per reply (default 32)")
    parser.add_argument("--temperature", type=float, help="override every model's default temperature")
    parser.add_argument("--repetition-penalty", type=float, help="override every model's default repetition penalty")
    parser.add_argument("--frequency-penalty", type=float, default=0.0,
                        help="OpenAI's frequency penalty, over generated tokens only (default 0; edgellm only)")
    parser.add_argument("--threads", type=int, help="threads for both engines (default: edgellm's default)")
    parser.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (needs llama-cpp-python)")
    parser.add_argument("--verbose", action="store_true", help="print every reply's first line to stderr")
    args = parser.parse_args()
    base = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") >> 1
    seeds = list(range(base, base + args.runs))
    print(f"seeds {seeds[0]}..{seeds[-1]}, up to {args.max_tokens} new tokens, first non-empty line names Paris")
    print("\n| model | engine | scheme / setup | Paris | a miss |\n|---|---|---|---|---|", flush=True)
    for name in args.models.split(","):
        t0 = time.perf_counter()
        tally, chat, temperature = run_edgellm(name, seeds, args)
        print(tally.row(), flush=True)
        if args.llama_cpp:
            print(run_llama_cpp(name, seeds, chat, temperature, args).row(), flush=True)
        print(f"  ({name}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr)


if __name__ == "__main__":
    main()
