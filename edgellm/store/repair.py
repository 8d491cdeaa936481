"""`edgellm store repair NAME`: re-fetch the files of installed versions that fail their sha256.

The expected hashes come from the channel's signed index (not from the local manifest, which may be
the damaged file); only the damaged files are downloaded, verified, and linked back into every
version that uses them.
"""

from __future__ import annotations

import sys
from typing import Callable

from edgellm.artifact.manifest import FileEntry, sha256_file
from edgellm.store.channel import Channel, ChannelError
from edgellm.store.local import Store, StoreError
from edgellm.store.update import download


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
           progress: bool | None = None, say: Callable[[str], None] = lambda m: print(m, file=sys.stderr)) -> int:
    """Restore every damaged file of NAME's installed versions from the channel; returns how many were fetched."""
    store = store or Store()
    if name not in store.names():
        raise StoreError(f"no model {name!r} in the store; `edgellm store list` shows them")
    location = channel_location or store.refs(name).channel
    if not location:
        raise ChannelError(f"no channel known for {name}; pass --channel URL_OR_DIR")
    channel = Channel(location)
    expected = {}
    for version in store.versions(name):
        try:
            expected[version] = channel.release(name, version).files
        except ChannelError:
            say(f"{name}@{version} is not in the channel; it cannot be checked against it")
    progress = sys.stderr.isatty() if progress is None else progress
    with store.locked():
        bad = damaged(store, name, expected)
        for entry in bad.values():
            store.drop_blob(entry.sha256)
            download(store, channel, entry, progress=progress)
        for version, files in expected.items():
            for member, entry in files.items():
                if entry.sha256 in bad:
                    store.relink(store.version_dir(name, version), member, entry.sha256)
    say(f"{name}: {len(bad)} damaged file(s) fetched again" if bad else f"{name}: every file is intact")
    return len(bad)
