"""Background batch jobs (`edgellm run --batch FILE.jsonl`): many prompts, one JSON result per line, resumable.

An input line is ``{"id": ..., "prompt": "..."}`` or ``{"id": ..., "messages": [...]}`` (chat messages, rendered with
the model's template), with optional ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` and ``stop``
overriding the job's parameters. Every line is checked before the first prompt runs (a bad one is named by its line
number). An output line is ``{"id", "text", "finish_reason", "usage"}`` (or ``{"id", "error"}`` for a prompt that
cannot run, such as one longer than the context window), written and flushed as each prompt finishes;
ids already in the output file are skipped, so an interrupted job goes on where it stopped (a line cut short by a crash
is dropped first). Prompts run one after another through the engine, for now: the batched decode step, which would
decode several at once, is not built yet.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.progress import bar

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
              *, system: str | None = None, raw: bool = False, progress: bool = True) -> BatchSummary:
    """Run each item not yet in `output` and append its result line (flushed at once). `system`: a system message
    put before plain prompts; `raw`: plain prompts go as they are, without the chat template."""
    output = Path(output)
    try:
        done_ids = finished_ids(output)
        out = open(output, "a", encoding="utf-8")
    except OSError as exc:
        raise EdgeLLMError(f"cannot write the batch output {output}: {exc.strerror or exc}") from None
    todo = [item for item in items if item.id not in done_ids]
    base = params or GenerationParams()
    with out:
        for item in bar(todo, enabled=progress, desc="batch", unit="prompt"):
            try:
                result = engine.generate(_prompt(engine, item, system, raw), replace(base, **item.overrides))
            except EdgeLLMError as exc:  # this prompt cannot run (too long, a bad parameter): said, and go on
                line: dict[str, object] = {"id": item.id, "error": str(exc)}
            else:
                line = {"id": item.id, "text": result.text, "finish_reason": result.finish_reason,
                        "usage": {"prompt_tokens": result.stats.prompt_tokens,
                                  "completion_tokens": result.stats.completion_tokens}}
            out.write(json.dumps(line, ensure_ascii=False) + "\n")
            out.flush()
    return BatchSummary(len(todo), len(items) - len(todo))


def _prompt(engine: Engine, item: BatchItem, system: str | None, raw: bool) -> str:
    if item.messages is not None:
        return engine.render(list(item.messages))
    assert item.prompt is not None
    if raw or not engine.chat_template:
        return item.prompt
    head = [{"role": "system", "content": system}] if system else []
    return engine.render(head + [{"role": "user", "content": item.prompt}])
