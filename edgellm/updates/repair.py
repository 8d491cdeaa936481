"""`edgellm store repair NAME`: re-fetch the files of installed versions that fail their sha256.

The expected hashes come from the channel's signed index (not from the local manifest, which may be
the damaged file); only the damaged files are downloaded, verified, and linked back into every
version that uses them.
"""

from __future__ import annotations

import sys
from typing import Callable

from edgellm.artifact.manifest import FileEntry, sha256_file
from edgellm.store import freshness
from edgellm.store.channel import TIMEOUT_S, Channel, ChannelError
from edgellm.store.local import Store, StoreError
from edgellm.updates.update import check_pin, download, remembered_channel


def damaged(store: Store, name: str, expected: dict[str, dict[str, FileEntry]]) -> dict[str, FileEntry]:
    """sha256 → entry of every file some version of ``name`` should hold but holds missing or altered."""
    seen: dict[tuple[int, int], str] = {}  # (device, inode) → its hash: a shared file is hashed once
    bad: dict[str, FileEntry] = {}
    for version, files in expected.items():
        folder = store.version_dir(name, version)
        for member, entry in files.items():
            path = folder / member
            try:
                st = path.stat()
            except FileNotFoundError:
                bad[entry.sha256] = entry
                continue
            key = (st.st_dev, st.st_ino)
            if key not in seen:
                seen[key] = sha256_file(path) if st.st_size == entry.size else ""
            if seen[key] != entry.sha256:
                bad[entry.sha256] = entry
    return bad


def repair(name: str, channel_location: str | None = None, *, store: Store | None = None,
           progress: bool | None = None, timeout_s: float = TIMEOUT_S,
           say: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> int:
    """Restore every damaged file of NAME's installed versions from the channel; returns how many were fetched.

    The index is checked as an update checks it (fresh, the key allowed for NAME and the one pinned for it);
    the downloads hold only the shared ``fetching()`` lock, the relinks the store lock, briefly."""
    store = store or Store()
    if name not in store.names():
        raise StoreError(f"no model {name!r} in the store; `edgellm store list` shows them")
    refs = store.refs(name)
    channel = Channel(remembered_channel(name, channel_location, refs), timeout_s=timeout_s)
    index = channel.read_index()
    check_pin(name, refs, index)
    freshness.accept(store, index, say)
    expected = {}
    for version in store.versions(name):
        try:
            expected[version] = index.release(name, version).files
        except ChannelError:
            say(f"{name}@{version} is not in the channel; it cannot be checked against it")
    progress = sys.stderr.isatty() if progress is None else progress
    with store.fetching():
        bad = damaged(store, name, expected)
        for entry in bad.values():
            download(store, channel, entry, progress=progress)  # replaces the damaged blob once verified
        with store.locked():
            for version, files in expected.items():
                for member, entry in files.items():
                    if entry.sha256 in bad:
                        store.relink(store.version_dir(name, version), member, entry.sha256)
    say(f"{name}: {len(bad)} damaged file(s) fetched again" if bad else f"{name}: every file is intact")
    return len(bad)
