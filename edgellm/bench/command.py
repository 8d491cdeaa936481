"""`edgellm bench` arguments and entry point (kept light: heavy imports happen only when it runs)."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timezone
from pathlib import Path

from edgellm.errors import EdgeLLMError

COLD_LOADS = 3  # --cold-loads default (BenchConfig's own): left out of the canonical command when unchanged

EPILOG = """\
Each configuration runs in its own process; configurations of the same model, threads and depth are
measured in turns (alternating), so drift of the machine falls on all of them alike.
Examples:
  edgellm bench smollm2-135m --prompt-tokens 16 --gen-tokens 8 --warmup 2 --runs 3
  edgellm bench smollm2-135m qwen2.5-coder-0.5b -q q4f16_1,q8f16_1 --threads 1,2 --backends edgellm,llama.cpp
  edgellm bench --compare before.json after.json"""


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument("models", nargs="*", metavar="MODEL", help="catalog names (NAME or NAME:SCHEME) or artifact folders")
    p.add_argument("--quantization", "-q", type=_names, default=[None], metavar="S1,S2",
                   help="edgellm schemes to compare (default: the NAME:SCHEME given, or the catalog model's own)")
    p.add_argument("--threads", "-t", type=_ints, default=[2], metavar="N1,N2", help="thread counts (default 2)")
    p.add_argument("--backends", type=_names, default=None, metavar="B1,B2",
                   help="edgellm and/or llama.cpp (default: both when llama-cpp-python is installed)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="prompt length in tokens (default 512)")
    p.add_argument("--gen-tokens", type=int, default=128, help="generated tokens per run (default 128)")
    p.add_argument("--warmup", type=int, default=10, help="runs not counted (default 10)")
    p.add_argument("--runs", type=int, default=10, help="counted runs after the warm-up (default 10: 20 runs, keep the last 10)")
    p.add_argument("--cold-loads", type=int, default=COLD_LOADS, metavar="N",
                   help=f"first loads in fresh processes per configuration; the report gives their median "
                        f"(default {COLD_LOADS})")
    p.add_argument("--depth", type=_ints, default=[0], metavar="D1,D2",
                   help="tokens of history prefilled before each measured request (default 0)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="also measure edgellm constrained to this JSON Schema, alternating with the plain run")
    p.add_argument("--output", "-o", default=None, metavar="PREFIX",
                   help="write PREFIX.json (raw samples, configuration) and PREFIX.png (default edgellm-bench-<UTC time>)")
    p.add_argument("--compare", nargs=2, default=None, metavar=("A.json", "B.json"),
                   help="show the change between two saved reports and exit")


def _default_backends() -> list[str]:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        print("note: llama-cpp-python is not installed, measuring edgellm only "
              "(pip install -e '.[compare]' adds llama.cpp; it compiles for about 25 minutes)", file=sys.stderr)
        return ["edgellm"]
    return ["edgellm", "llama.cpp"]


def command_line(args: argparse.Namespace, backends: list[str]) -> list[str]:
    """The canonical command that repeats this run (recorded in the report)."""
    cmd = ["edgellm", "bench", *args.models]
    if args.quantization != [None]:
        cmd += ["-q", ",".join(q for q in args.quantization if q)]
    cmd += ["--threads", ",".join(map(str, args.threads)), "--backends", ",".join(backends),
            "--prompt-tokens", str(args.prompt_tokens), "--gen-tokens", str(args.gen_tokens),
            "--warmup", str(args.warmup), "--runs", str(args.runs)]
    if args.cold_loads != COLD_LOADS:
        cmd += ["--cold-loads", str(args.cold_loads)]
    if args.depth != [0]:
        cmd += ["--depth", ",".join(map(str, args.depth))]
    if args.json_schema:
        cmd += ["--json-schema", args.json_schema]
    return cmd


def run(args: argparse.Namespace) -> int:
    from edgellm.bench.report import compare_reports, format_report, read_json, write_json, write_png

    if args.compare:
        print(compare_reports(read_json(Path(args.compare[0])), read_json(Path(args.compare[1]))))
        return 0
    if not args.models:
        raise EdgeLLMError("name at least one MODEL to benchmark (or use --compare A.json B.json)")
    from edgellm.bench.runner import BenchConfig, run_bench

    backends = args.backends or _default_backends()
    unknown = set(backends) - {"edgellm", "llama.cpp"}
    if unknown:
        raise EdgeLLMError(f"unknown backend(s) {', '.join(sorted(unknown))}; use edgellm and/or llama.cpp")
    schema = None
    if args.json_schema:
        try:
            schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise EdgeLLMError(f"cannot read JSON Schema {args.json_schema}: {exc}") from exc
    config = BenchConfig(models=list(args.models), quantizations=list(args.quantization), threads=args.threads,
                         backends=backends, prompt_tokens=args.prompt_tokens, gen_tokens=args.gen_tokens,
                         warmup=args.warmup, runs=args.runs, cold_loads=args.cold_loads, depths=args.depth,
                         json_schema=schema,
                         json_schema_path=args.json_schema)
    say = (lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    report = run_bench(config, argv=command_line(args, backends), say=say)
    prefix = args.output or f"edgellm-bench-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    json_path, png_path = Path(f"{prefix}.json"), Path(f"{prefix}.png")
    write_json(report, json_path)
    write_png(report, png_path)
    print(format_report(report))
    print(f"\nwrote {json_path} and {png_path}")
    return 0
