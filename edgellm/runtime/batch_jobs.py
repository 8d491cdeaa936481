"""Background batch jobs (`edgellm run --batch FILE.jsonl`): many prompts, one JSON result per line, resumable.

An input line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}`` (chat messages, rendered with
the model's template), with optional ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop``
overriding the job's parameters. Every line is checked before the first prompt runs (a bad one is named by its line
number). An output line is ``{"id", "text", "finish_reason", "usage"}`` (or ``{"id", "error"}`` for a prompt that
cannot run, such as one longer than the context window), written and flushed as each prompt finishes;
ids already in the output file are skipped, so an interrupted job goes on where it stopped (a line cut short by a crash
is dropped first). Lines are written in the order their prompts finish. `parallel` prompts run at once, their decode
steps batched (runtime/batched.py: a slot takes the next prompt as soon as its own finishes); a greedy result is the
text of the prompt's solo run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.progress import bar
from edgellm.runtime.batched import DEFAULT_PARALLEL, RequestOutcome, Request, StepCounts, generate_many

if TYPE_CHECKING:
    from edgellm.runtime.engine import Engine

MAX_LINE_BYTES = 16 * 2**20
OVERRIDES: dict[str, type[int] | tuple[type[int], type[float]]] = {
    "max_tokens": int, "temperature": (int, float), "top_p": (int, float), "top_k": int, "seed": int}


@dataclass(frozen=True)
class BatchItem:
    """One input line: its id, the prompt (text) or chat messages, and its parameter overrides."""

    id: str
    prompt: str | None
    messages: tuple[dict[str, str], ...] | None
    overrides: dict[str, int | float | tuple[str, ...]]


@dataclass(frozen=True)
class BatchSummary:
    done: int  # prompts run now (an error line counts)
    skipped: int  # ids already in the output file
    steps: StepCounts = StepCounts()  # the decode steps they took, and their rows


def read_items(path: str | Path) -> list[BatchItem]:
    """Every input line, checked; EdgeLLMError naming the file and line of the first bad one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EdgeLLMError(f"cannot read the batch file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    items: list[BatchItem] = []
    seen: set[str] = set()
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        if len(line) > MAX_LINE_BYTES:
            raise EdgeLLMError(f"{where}: the line is over {MAX_LINE_BYTES // 2**20} MiB")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EdgeLLMError(f"{where}: not JSON ({exc.msg})") from None
        items.append(_item(obj, where))
        if items[-1].id in seen:
            raise EdgeLLMError(f"{where}: the id {items[-1].id!r} appears twice")
        seen.add(items[-1].id)
    if not items:
        raise EdgeLLMError(f"{path} has no prompts")
    return items


def _item(obj: object, where: str) -> BatchItem:
    if not isinstance(obj, dict):
        raise EdgeLLMError(f"{where}: a line must be a JSON object")
    item_id = obj.get("id")
    if isinstance(item_id, bool) or not isinstance(item_id, (str, int)) or item_id == "":
        raise EdgeLLMError(f"{where}: \"id\" must be a non-empty string or an integer")
    unknown = set(obj) - {"id", "prompt", "messages", "stop", *OVERRIDES}
    if unknown:
        raise EdgeLLMError(f"{where}: unknown field {sorted(unknown)[0]!r}")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        raise EdgeLLMError(f"{where}: give exactly one of \"prompt\" and \"messages\"")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise EdgeLLMError(f"{where}: \"prompt\" must be a non-empty string")
    if messages is not None and not (isinstance(messages, list) and messages and all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages)):
        raise EdgeLLMError(f"{where}: \"messages\" must be a list of {{\"role\", \"content\"}} strings")
    overrides: dict[str, int | float | tuple[str, ...]] = {}
    for key, kind in OVERRIDES.items():
        if key in obj:
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, kind):
                raise EdgeLLMError(f"{where}: \"{key}\" must be a number" + (" (an integer)" if kind is int else ""))
            overrides[key] = value
    if "stop" in obj:
        stop = obj["stop"]
        stop = [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise EdgeLLMError(f"{where}: \"stop\" must be a string or a list of strings")
        overrides["stop"] = tuple(stop)
    chat = tuple({"role": m["role"], "content": m["content"]} for m in messages) if messages is not None else None
    return BatchItem(str(item_id), prompt, chat, overrides)


def finished_ids(path: Path) -> set[str]:
    """Ids of the complete result lines already in `path`; a last line cut short (no newline, or not JSON) is cut
    off the file so appended results start on a line of their own."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a line a crash cut short
    ids: set[str] = set()
    for line in data[:keep].splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise EdgeLLMError(f"{path} has a line that is not JSON: not a batch output file?") from None
        if isinstance(obj, dict) and "id" in obj:
            ids.add(str(obj["id"]))
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    return ids


def run_batch(engine: Engine, items: Sequence[BatchItem], output: str | Path, params: GenerationParams | None = None,
              *, system: str | None = None, raw: bool = False, progress: bool = True,
              parallel: int = DEFAULT_PARALLEL, max_batch: int | None = None) -> BatchSummary:
    """Run each item not yet in `output` and append its result line (flushed at once), `parallel` at a time with
    at most `max_batch` rows a decode step (runtime/batched.py). `system`: a system message put before plain
    prompts; `raw`: plain prompts go as they are, without the chat template."""
    output = Path(output)
    try:
        done_ids = finished_ids(output)
        out = open(output, "a", encoding="utf-8")
    except OSError as exc:
        raise EdgeLLMError(f"cannot write the batch output {output}: {exc.strerror or exc}") from None
    todo = [item for item in items if item.id not in done_ids]
    base = params or GenerationParams()
    with out, bar(total=len(todo), enabled=progress, desc="batch", unit="prompt") as shown:

        def write(item_id: str, outcome: RequestOutcome) -> None:
            out.write(json.dumps(_line(item_id, outcome), ensure_ascii=False) + "\n")
            out.flush()
            shown.update(1)

        ids: list[str] = []
        requests: list[Request] = []
        for item in todo:
            try:  # a prompt the template refuses, or a bad parameter, is that prompt's error line
                params = replace(base, **item.overrides)  # type: ignore[arg-type]  # each key's type: read_items
                request = Request(_prompt(engine, item, system, raw), params)
            except EdgeLLMError as exc:
                write(item.id, exc)
            else:
                ids.append(item.id)
                requests.append(request)
        steps = generate_many(engine, requests, lambda index, outcome: write(ids[index], outcome),
                              parallel=parallel, max_batch=max_batch)
    return BatchSummary(len(todo), len(items) - len(todo), steps)


def _line(item_id: str, outcome: RequestOutcome) -> dict[str, object]:
    if isinstance(outcome, EdgeLLMError):  # this prompt cannot run (too long, a bad parameter): said, and go on
        return {"id": item_id, "error": str(outcome)}
    return {"id": item_id, "text": outcome.text, "finish_reason": outcome.finish_reason,
            "usage": {"prompt_tokens": outcome.stats.prompt_tokens,
                      "completion_tokens": outcome.stats.completion_tokens}}


def _prompt(engine: Engine, item: BatchItem, system: str | None, raw: bool) -> str:
    if item.messages is not None:
        return engine.render(list(item.messages))
    assert item.prompt is not None
    if raw or not engine.chat_template:
        return item.prompt
    head = [{"role": "system", "content": system}] if system else []
    return engine.render(head + [{"role": "user", "content": item.prompt}])
