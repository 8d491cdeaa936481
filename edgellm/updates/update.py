"""`edgellm update`: fetch a signed release, download only the files the store lacks, check, then switch.

Order of events, each a point where a failure stops with the current version untouched:
signature + trust → the key may publish this model and is the one pinned for it → freshness (no expired
or older index, freshness.py) → compatibility → no downgrade unless asked for → delta plan (reported before any
download) → resumable downloads, each hashed before it enters the blob store → staged version verified
file by file → optional canary prompt and eval gate on the staged version → rename into the store →
``current`` switched. Partial downloads stay in ``store/tmp`` and resume on the next run (HTTP Range).

Every channel read has a total deadline. Downloads, staging and the canary hold only the store's shared
``fetching()`` lock; the exclusive lock that `rollback` and `store activate` take is held only for the
final rename and switch, after the checks are made again under it.
"""

from __future__ import annotations

import http.client
import shutil
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, Callable

from tqdm import tqdm

from edgellm.artifact.manifest import FileEntry
from edgellm.errors import EdgeLLMError
from edgellm.store import freshness
from edgellm.store.channel import TIMEOUT_S, Channel, ChannelError, Release, SignedIndex, blob_path
from edgellm.store.local import Refs, Store, StoredVersion, check_name
from edgellm.store.trust import SignatureError, key_id

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
    """Fetch one blob into ``store/tmp/<hash>.part`` (resuming what is there), verify it, move it into the store
    (replacing a damaged blob of that hash). The part file is locked: a second download of it is refused."""
    store.tmp.mkdir(parents=True, exist_ok=True)
    part = store.tmp / f"{entry.sha256}.part"
    with open(part, "a+b") as out:
        _lock_part(out, entry)
        have = out.seek(0, 2)
        if have > entry.size:
            out.truncate(0)
            have = 0
        if have < entry.size:
            _fetch(channel, entry, out, have, progress, counter)
        try:
            store.adopt_blob(part, entry)
        except EdgeLLMError as exc:
            part.unlink(missing_ok=True)
            raise ChannelError(f"{exc}; the download was discarded, the current version is unchanged") from None


def _lock_part(out: IO[bytes], entry: FileEntry) -> None:
    try:
        import fcntl
    except ImportError:
        return
    try:
        fcntl.flock(out.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)  # released when ``out`` is closed
    except BlockingIOError:
        raise ChannelError(f"another update or repair is downloading {entry.sha256[:12]}; "
                           "run this one again when it has finished") from None


def _fetch(channel: Channel, entry: FileEntry, out: IO[bytes], have: int, progress: bool,
           counter: Callable[[int], None] | None) -> None:
    """Append the blob's bytes from ``have`` on to ``out``; ChannelError (the part kept) if it stops short."""
    with channel.open(blob_path(entry.sha256), have) as got, \
            tqdm(total=entry.size, initial=got.start, unit="B", unit_scale=True, unit_divisor=1024,
                 desc=entry.sha256[:12], disable=not progress, leave=False, file=sys.stderr) as bar:
        out.seek(got.start)
        out.truncate()
        done = got.start
        error: BaseException | None = None
        try:
            while done < entry.size and not got.deadline.passed and \
                    (chunk := got.stream.read(min(_CHUNK, entry.size - done))):
                out.write(chunk)
                done += len(chunk)
                bar.update(len(chunk))
                if counter:
                    counter(len(chunk))
        except (OSError, http.client.HTTPException) as exc:
            error = exc
        out.flush()
        if done >= entry.size:
            return
        if got.deadline.passed:
            raise ChannelError(f"download of {entry.sha256[:12]} stopped at the {channel.timeout_s:g} s deadline, "
                               f"{done} of {entry.size} bytes; kept, run the update again to resume "
                               "(or give a longer --timeout)")
        detail = f" ({error})" if error else ""
        raise ChannelError(f"download of {entry.sha256[:12]} interrupted at {done} of {entry.size} bytes{detail}; "
                           "kept, run the update again to resume")


def update(name: str, channel_location: str | None = None, *, version: str | None = None,
           canary: str | None = None, gate: Path | None = None, max_drop: float = 5.0,
           activate: bool = True, progress: bool | None = None, store: Store | None = None,
           timeout_s: float = TIMEOUT_S,
           say: Callable[[str], None] = lambda m: print(m, file=sys.stderr, flush=True)) -> StoredVersion:
    """Install (and by default activate) NAME at the channel's latest version, or ``version`` (which may be
    older than the current one: asked for by name, it is installed, and said so)."""
    store = store or Store()
    check_name(name, "model name")
    refs = store.refs(name) if name in store.names() else Refs()
    channel = Channel(remembered_channel(name, channel_location, refs), timeout_s=timeout_s)
    index = channel.read_index()
    release = index.release(name, version)
    check_pin(name, refs, index)
    freshness.accept(store, index, say)  # remembered only once the key may update this model
    release.check_compatible()
    installed = release.version in store.versions(name)
    if installed and store.get(name, release.version).files != release.files:
        raise ChannelError(f"the channel's {name}@{release.version} differs from the installed one; "
                           "a version never changes, so the channel is wrong: nothing was changed")
    check_not_older(store, name, release, refs, index, explicit=version is not None, say=say)
    if installed:
        say(f"{name}@{release.version} is already installed")
    with store.fetching():
        if release.version in store.versions(name):
            staged = None
        else:
            delta = plan(store, release)
            say(delta.describe(refs.current))
            for entry in delta.missing.values():
                download(store, channel, entry, progress=sys.stderr.isatty() if progress is None else progress)
            staged = store.stage(release.files)
            try:
                if canary is not None:
                    run_canary(staged, canary, say)
                if gate is not None:
                    run_gate(staged, gate, max_drop, say)
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
        return _switch(store, name, release, index, staged, activate=activate,
                       explicit=version is not None, say=say)


def _switch(store: Store, name: str, release: Release, index: SignedIndex, staged: Path | None, *,
            activate: bool, explicit: bool, say: Callable[[str], None]) -> StoredVersion:
    """Under the store lock, briefly: check the pin and the order against the refs as they are now (a rollback
    or another update may have run meanwhile), rename the staged version in, switch current."""
    with store.locked():
        refs = store.refs(name) if name in store.names() else Refs()
        try:
            check_pin(name, refs, index)
            check_not_older(store, name, release, refs, index, explicit=explicit, say=lambda _: None)
        except EdgeLLMError:
            if staged is not None:
                shutil.rmtree(staged, ignore_errors=True)
            raise
        if staged is not None:
            store.commit(staged, name, release.version)
        if activate and refs.current != release.version:
            new = store.switch(name, release.version, channel=index.location, key=index.key, stamp=release.stamp)
            say(f"{name}: current is now {release.version}" + (f" (previous: {new.previous})" if new.previous else ""))
        elif refs.key is None or release.version not in refs.releases:  # pin the key, remember the order
            store.write_refs(name, replace(refs, channel=refs.channel or index.location, key=refs.key or index.key,
                                           releases={**refs.releases, release.version: release.stamp}))
    return store.get(name, release.version)


def remembered_channel(name: str, given: str | None, refs: Refs) -> str:
    """The channel to read: the one given, else the one NAME came from (never a relative path: one remembered
    by an older edgellm would be read against whatever the current directory is)."""
    if given:
        return given
    if not refs.channel:
        raise ChannelError(f"no channel known for {name}; pass --channel URL_OR_DIR")
    if not refs.channel.startswith(("http://", "https://")) and not Path(refs.channel).expanduser().is_absolute():
        raise ChannelError(f"the channel remembered for {name} is the relative path {refs.channel!r}; pass "
                           "--channel again (it is then remembered as an absolute path)")
    return refs.channel


def check_pin(name: str, refs: Refs, index: SignedIndex) -> None:
    """SignatureError if NAME is pinned to another key than the one that signed this index."""
    if refs.key is not None and refs.key != index.key:
        raise SignatureError(f"{name} is pinned to key {key_id(refs.key)} (the one that signed its first channel "
                             f"install), but this channel is signed by {key_id(index.key)}: refused; if the "
                             f"publisher really changed keys, `edgellm trust pin {name} {index.key}`")


def check_not_older(store: Store, name: str, release: Release, refs: Refs, index: SignedIndex, *, explicit: bool,
                    say: Callable[[str], None]) -> None:
    """Refuse moving NAME to a release published before the current version, unless asked for by name.

    The current version's place in its publisher's order is the one recorded when it was installed from a
    channel, else this index's entry for it (if its files are the installed ones); with neither, there is
    no order to compare (a version added with `store add`), and only the index's freshness protects."""
    current = refs.current
    if current is None or current == release.version:
        return
    stamp = refs.releases.get(current)
    if stamp is None:
        try:
            listed = index.release(name, current)
        except ChannelError:
            return
        stamp = listed.stamp if current in store.versions(name) and listed.files == store.get(name, current).files \
            else None
    if stamp is None or not release.stamp < stamp:
        return
    if not explicit:
        raise ChannelError(f"the channel's latest {name} is {release.version}, published before the current "
                           f"{current}: refused (a replayed or rolled-back channel?); to go back on purpose: "
                           f"`edgellm update {name} --version {release.version}` (or `edgellm rollback {name}`)")
    say(f"{name}: installing {release.version}, published before the current {current}, as --version asks")


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
