"""Deliberate bugs the test suite must catch: one per core promise, each applied to a copy of the source tree.

Run on demand (not in CI), from the repository root with the test extra installed:

    python scripts/mutation_check.py            # every mutation, after a baseline run of the same tests
    python scripts/mutation_check.py --list     # what each mutation breaks and which tests should notice
    python scripts/mutation_check.py --only top-k-ignored

For each mutation the tree is copied to a temporary folder (without .git and .venv), one exact snippet of one
file is replaced, and only the tests aimed at that promise run there (`python -m pytest -x`, the copy first on
PYTHONPATH). A mutation is *caught* when those tests fail, *missed* when they pass. A snippet that is no longer
in the file (or is there twice) stops the script: update the mutation with the code. Exit status 1 if any
mutation was missed or its tests did not run cleanly without it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
IGNORED = shutil.ignore_patterns(".git", ".venv", ".pytest_cache", "__pycache__", "*.egg-info", "build")


@dataclass(frozen=True)
class Mutation:
    name: str
    promise: str  # what the bug breaks
    path: str  # the file it changes, from the repository root
    old: str  # an exact snippet of that file (present once)
    new: str
    tests: tuple[str, ...]  # pytest node ids (files or file::test): the tests that must notice


MUTATIONS = (
    Mutation("q4-min-off", "4-bit quantization: each group's min stored half a step too high",
             "edgellm/quant/formats.py", "_f16_bytes(mins), qs)",
             "_f16_bytes((mins.float() + scales.float() / 2).half()), qs)",
             ("tests/quant/test_quant.py", "tests/convert/test_hf_convert.py::test_quantized_artifacts_stay_close")),
    Mutation("grammar-first-token-free", "structured output: the grammar mask is not applied to the first token",
             "edgellm/structured/processor.py",
             "        apply_bitmask(logits, self._bitmask, self._vocab_size)",
             "        if generated:\n            apply_bitmask(logits, self._bitmask, self._vocab_size)",
             ("tests/structured/test_structured_errors.py", "tests/structured/test_structured_whitespace.py")),
    Mutation("kv-position-off-by-one", "decode: each new token's keys/values written one position back",
             "edgellm/session/generation_session.py",
             "logits = self.model.run([token], pos, self.cache)",
             "logits = self.model.run([token], pos - 1, self.cache)",
             ("tests/convert/test_hf_convert.py::test_greedy_generation_matches_transformers",
              "tests/convert/test_hf_convert.py::test_every_decode_step_matches_transformers", "tests/runtime/test_engine.py",
              "tests/session/test_generation_session.py")),
    Mutation("top-k-ignored", "sampling: top_k has no effect", "edgellm/session/sampling.py",
             "    if top_k > 0:", "    if top_k > logits.numel():", ("tests/session/test_sampling.py",)),
    Mutation("queue-full-503", "server: a full queue answers 503 instead of 429 + Retry-After",
             "edgellm/serve/errors.py", "super().__init__(429, \"the server is busy",
             "super().__init__(503, \"the server is busy",
             ("tests/serve/test_serve_errors.py::test_a_full_queue_is_429_with_retry_after_and_queued_requests_are_served",)),
    Mutation("context-overflow-500", "server: a prompt over the context window answers 500 instead of 400",
             "edgellm/serve/errors.py", "return APIError(400, f\"This model's maximum context length",
             "return APIError(500, f\"This model's maximum context length",
             ("tests/serve/test_serve_errors.py::test_prompt_over_the_context_window",)),
    Mutation("hash-check-skipped", "artifact: a file's content digest is never compared on load",
             "edgellm/artifact/manifest.py", "if xxh3_file(path) != entry.xxh3:",
             "if xxh3_file(path) != entry.xxh3 and sha256:", ("tests/artifact/test_artifact.py",)),
    Mutation("kl-reversed", "eval: KL computed as KL(candidate || reference)", "edgellm/eval/metrics.py",
             "return (p.exp() * (p - q)).sum(-1).clamp_min(0.0)", "return (q.exp() * (q - p)).sum(-1).clamp_min(0.0)",
             ("tests/eval/test_eval_metrics.py",)),
    Mutation("whitespace-unbounded", "structured output: JSON whitespace unbounded by default",
             "edgellm/response_format.py", "max_whitespace: int | None = 0",
             "max_whitespace: int | None = None", ("tests/structured/test_structured_whitespace.py",)),
    Mutation("tool-name-unchecked", "server: tool_choice auto turns a call of a tool nobody offered into tool_calls",
             "edgellm/serve/responses.py", 'if not isinstance(item, dict) or item.get("name") not in names:',
             "if not isinstance(item, dict):", ("tests/serve/test_serve_promises.py::test_auto_keeps_other_replies_as_content",)),
    Mutation("serve-binds-everywhere", "server: `edgellm serve` listens on every interface by default",
             "edgellm/cli.py", 'p.add_argument("--host", default="127.0.0.1"', 'p.add_argument("--host", default="0.0.0.0"',
             ("tests/serve/test_serve_cli.py::test_serve_verb_loads_answers_and_stops",)),
    Mutation("manifest-absolute-path", "artifact: an absolute manifest path is followed out of the folder",
             "edgellm/artifact/manifest.py", 'if pure.is_absolute() or ".." in pure.parts', 'if ".." in pure.parts',
             ("tests/fuzz/test_fuzz_files.py::test_manifest_paths_escaping_the_folder",)),
    Mutation("canary-failure-ignored", "update: a release whose canary fails is activated anyway",
             "edgellm/updates/update.py", "                    run_canary(staged, canary, say)\n",
             "                    try:\n                        run_canary(staged, canary, say)\n"
             "                    except CanaryError:\n                        pass\n", ("tests/updates/test_store_canary.py",)),
    Mutation("telemetry-derived-leak", "telemetry: an event carries something derived from the conversation",
             "edgellm/telemetry/events.py", '"finish_reason": finish_reason, "error_class": error_class,',
             '"finish_reason": finish_reason, "error_class": error_class or f"x{sum(engine.session.cached_ids) % 97}",',
             ("tests/telemetry/test_telemetry.py",)),
    Mutation("disconnect-ignored", "server: a client that leaves does not stop its generation",
             "edgellm/serve/queue.py", "        if job.cancelled.is_set() or job.failed:\n            raise Dropped()\n",
             "        if job.failed:\n            raise Dropped()\n", ("tests/serve/test_serve_errors.py::test_disconnect_mid_stream_frees_the_engine",
                  "tests/serve/test_serve_errors.py::test_client_that_gives_up_on_a_whole_response_frees_the_engine")),
    Mutation("keyword-silently-ignored", "structured output: a keyword the grammar cannot enforce is neither "
             "enforced nor refused", "edgellm/structured/schema_support.py", '    "uniqueItems": "a grammar',
             '    "uniqueItems-unlisted": "a grammar',
             ("tests/structured/test_structured_errors.py::test_every_keyword_of_the_spec_is_enforced_or_refused_by_name",)),
    Mutation("kv-cache-not-counted", "planner: the KV cache left out of the memory a plan promises",
             "edgellm/runtime/memory.py", "    kv = sequences * KVSpace.bytes_needed(", "    kv = 0 * KVSpace.bytes_needed(",
             ("tests/runtime/test_device_planner.py::test_the_chosen_plan_holds_in_measured_memory",)),
)


def copy_tree(dest: Path) -> Path:
    tree = dest / "tree"
    shutil.copytree(ROOT, tree, ignore=IGNORED, symlinks=True)
    return tree


def apply(tree: Path, m: Mutation) -> None:
    target = tree / m.path
    text = target.read_text(encoding="utf-8")
    if text.count(m.old) != 1:
        raise SystemExit(f"mutation {m.name}: the snippet occurs {text.count(m.old)} times in {m.path} "
                         f"(expected once); update it to the current code: {m.old!r}")
    target.write_text(text.replace(m.old, m.new), encoding="utf-8")


def run_tests(tree: Path, tests: tuple[str, ...], timeout_s: int) -> tuple[int, str, float]:
    """(pytest's exit status, its last lines, seconds) for `tests` run in `tree` with the copy's edgellm."""
    env = {**os.environ, "PYTHONPATH": str(tree) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    where = subprocess.run([sys.executable, "-c", "import edgellm; print(edgellm.__file__)"], cwd=tree, env=env,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not Path(where).resolve().is_relative_to(tree.resolve()):
        raise SystemExit(f"the copy imports edgellm from {where}, not from {tree}")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {timeout_s} s", time.monotonic() - t0
    tail = [line for line in proc.stdout.splitlines() if line.strip()][-1:] or ["(no output)"]
    return proc.returncode, tail[0], time.monotonic() - t0


def verdict(status: int) -> str:
    return {0: "MISSED", 1: "caught"}.get(status, f"error (pytest exit {status})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutation (repeatable)")
    parser.add_argument("--no-baseline", action="store_true", help="skip the run of the same tests without bugs")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per pytest run (default 900)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTATIONS}
    if unknown:
        parser.error(f"unknown mutation(s) {', '.join(sorted(unknown))}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:26} {m.promise}\n{'':26} {m.path}; tests: {' '.join(m.tests)}")
        return 0
    start, failed = time.monotonic(), False
    with tempfile.TemporaryDirectory(prefix="edgellm-mutation-") as tmp:
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            status, tail, seconds = run_tests(copy_tree(Path(tmp) / "baseline"), tests, args.timeout)
            print(f"{'baseline (no mutation)':26} {'passes' if status == 0 else 'FAILS':8} {seconds:6.0f} s  {tail}",
                  flush=True)
            if status != 0:
                print("the targeted tests must pass without mutations first", file=sys.stderr)
                return 1
        for m in chosen:
            tree = copy_tree(Path(tmp) / m.name)
            apply(tree, m)
            status, tail, seconds = run_tests(tree, m.tests, args.timeout)
            failed |= status != 1
            print(f"{m.name:26} {verdict(status):8} {seconds:6.0f} s  {tail}", flush=True)
            shutil.rmtree(tree)
    print(f"{len(chosen)} mutations in {time.monotonic() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
