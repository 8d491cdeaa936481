"""`edgellm update`: fetch a signed release, download only the files the store lacks, check, then switch.

Order of events, each a point where a failure stops with the current version untouched:
signature + trust → compatibility → delta plan (reported before any download) → resumable downloads,
each hashed before it enters the blob store → staged version verified file by file → optional canary
prompt and eval gate on the staged version → rename into the store → ``current`` switched.
Partial downloads stay in ``store/tmp`` and resume on the next run (HTTP Range).
"""

from __future__ import annotations

import http.client
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from tqdm import tqdm

from edgellm.artifact.manifest import FileEntry
from edgellm.errors import EdgeLLMError
from edgellm.store.channel import Channel, ChannelError, Release, blob_path
from edgellm.store.local import Store, StoredVersion, check_name

_CHUNK = 1 << 16


class CanaryError(EdgeLLMError):
    """The new version failed its canary prompt or eval gate; it was not activated."""


@dataclass(frozen=True)
class DeltaPlan:
    release: Release
    missing: dict[str, FileEntry]  # file name → entry, one per hash the store lacks

    @property
    def download_bytes(self) -> int:
        return sum(e.size for e in self.missing.values())

    def describe(self, current: str | None) -> str:
        frm = f"{current} → " if current else ""
        have = self.release.total_bytes - self.download_bytes
        return (f"{self.release.name} {frm}{self.release.version}: {len(self.missing)} of "
                f"{len(self.release.files)} files to download, {_mib(self.download_bytes)} "
                f"({_mib(have)} already in the store)")


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def plan(store: Store, release: Release) -> DeltaPlan:
    missing: dict[str, FileEntry] = {}
    seen: set[str] = set()
    for member, entry in sorted(release.files.items()):
        if entry.sha256 not in seen and not store.has_blob(entry.sha256):
            missing[member] = entry
        seen.add(entry.sha256)
    return DeltaPlan(release, missing)


def download(store: Store, channel: Channel, entry: FileEntry, *, progress: bool,
             counter: Callable[[int], None] | None = None) -> None:
    """Fetch one blob into ``store/tmp/<hash>.part`` (resuming what is there), verify it, move it into the store."""
    store.tmp.mkdir(parents=True, exist_ok=True)
    part = store.tmp / f"{entry.sha256}.part"
    have = part.stat().st_size if part.exists() else 0
    if have > entry.size:
        part.unlink()
        have = 0
    if have < entry.size:
        stream, _, start = channel.open(blob_path(entry.sha256), have)
        with stream, open(part, "r+b" if part.exists() else "wb") as out, \
                tqdm(total=entry.size, initial=start, unit="B", unit_scale=True, unit_divisor=1024,
                     desc=entry.sha256[:12], disable=not progress, leave=False, file=sys.stderr) as bar:
            out.seek(start)
            out.truncate()
            got = start
            try:
                while got < entry.size and (chunk := stream.read(min(_CHUNK, entry.size - got))):
                    out.write(chunk)
                    got += len(chunk)
                    bar.update(len(chunk))
                    if counter:
                        counter(len(chunk))
            except (OSError, http.client.HTTPException) as exc:
                raise ChannelError(f"download of {entry.sha256[:12]} interrupted at {got} of {entry.size} bytes "
                                   f"({exc}); kept, run the update again to resume") from None
        if got < entry.size:
            raise ChannelError(f"download of {entry.sha256[:12]} interrupted at {got} of {entry.size} bytes; "
                               "kept, run the update again to resume")
    try:
        store.adopt_blob(part, entry)
    except EdgeLLMError as exc:
        part.unlink(missing_ok=True)
        raise ChannelError(f"{exc}; the download was discarded, the current version is unchanged") from None


def update(name: str, channel_location: str | None = None, *, version: str | None = None,
           canary: str | None = None, gate: Path | None = None, max_drop: float = 5.0,
           activate: bool = True, progress: bool | None = None, store: Store | None = None,
           say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> StoredVersion:
    """Install (and by default activate) NAME at the channel's latest version, or ``version``."""
    store = store or Store()
    check_name(name, "model name")
    refs = store.refs(name) if name in store.names() else None
    location = channel_location or (refs.channel if refs else None)
    if not location:
        raise ChannelError(f"no channel known for {name}; pass --channel URL_OR_DIR")
    progress = sys.stderr.isatty() if progress is None else progress
    channel = Channel(location)
    release = channel.release(name, version)
    release.check_compatible()
    current = refs.current if refs else None
    if release.version in store.versions(name):
        if store.get(name, release.version).files != release.files:
            raise ChannelError(f"the channel's {name}@{release.version} differs from the installed one; "
                               "a version never changes, so the channel is wrong: nothing was changed")
        say(f"{name}@{release.version} is already installed")
        if activate and current != release.version:
            store.activate(name, release.version, channel=location)
            say(f"{name}: current is now {release.version}")
        return store.get(name, release.version)
    delta = plan(store, release)
    say(delta.describe(current))
    with store.locked():
        for entry in delta.missing.values():
            download(store, channel, entry, progress=progress)
        staged = store.stage(release.files)
    try:
        if canary is not None:
            run_canary(staged, canary, say)
        if gate is not None:
            run_gate(staged, gate, max_drop, say)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    with store.locked():
        installed = store.commit(staged, name, release.version)
    if activate:
        store.activate(name, release.version, channel=location)
        say(f"{name}: current is now {release.version}" + (f" (previous: {current})" if current else ""))
    return installed


def run_canary(folder: Path, prompt: str, say: Callable[[str], None]) -> None:
    """Load the staged version and generate a short greedy reply; CanaryError if it fails or says nothing."""
    from edgellm.artifact.reader import open_artifact
    from edgellm.runtime.engine import Engine
    from edgellm.generation import GenerationParams

    try:
        engine = Engine(open_artifact(folder, verify=False))
        text = prompt if not engine.chat_template else engine.render([{"role": "user", "content": prompt}])
        result = engine.generate(text, GenerationParams(max_tokens=16, temperature=0.0))
        engine.close()
    except EdgeLLMError as exc:
        raise CanaryError(f"canary failed: {exc}; the new version was not activated") from None
    if not result.token_ids:
        raise CanaryError("canary failed: the new version produced no output; it was not activated")
    say(f"canary passed ({result.stats.completion_tokens} tokens, finish {result.finish_reason})")


def run_gate(folder: Path, baseline_path: Path, max_drop: float, say: Callable[[str], None]) -> None:
    """Run `eval task` on the staged version with the baseline report's modes and item count, then the gate."""
    from edgellm.artifact.reader import open_artifact
    from edgellm.eval import tasks
    from edgellm.eval.gate import compare, format_rows, load_report
    from edgellm.runtime.engine import Engine

    baseline = load_report(baseline_path)
    modes = list(baseline.get("modes", {}))
    if baseline.get("kind") != "task" or not modes:
        raise EdgeLLMError(f"{baseline_path}: --gate takes a report written by `edgellm eval task --json`")
    limit = int(baseline["modes"][modes[0]].get("items", 0)) or None
    items = tasks.load_dataset(tasks.DEFAULT_DATASET)
    if limit:  # the same even spread `eval task --limit` uses
        items = items[:: max(1, len(items) // limit)][:limit]
    try:
        engine = Engine(open_artifact(folder, verify=False))
        report = tasks.evaluate_tasks(engine, items, modes)
        engine.close()
    except EdgeLLMError as exc:
        raise CanaryError(f"eval gate could not run on the new version ({exc}); it was not activated") from None
    rows = compare(baseline, report, max_drop)
    say(format_rows(rows, max_drop))
    if any(r.failed for r in rows):
        raise CanaryError(f"eval gate failed against {baseline_path}; the new version was not activated")
