"""Release channels: a static folder (or its copy on any web server) with a signed index and the files.

Layout::

    index.json            {"format": "edgellm-channel/1", "key": "ed25519:...", "signature": ..., "signed": "<JSON>"}
    blobs/sha256/<hex>    every file of every release, once

``signed`` is the exact JSON text that was signed; it is parsed only after its signature verifies::

    {"channel_format": 1, "updated": ..., "models": {NAME: {"latest": V, "versions": {V: RELEASE}}}}
    RELEASE = {"published": ..., "min_edgellm": "0.1.0", "format_version": 1,
               "files": {"manifest.json": {"sha256": ..., "size": ...}, ...}}
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edgellm import __version__
from edgellm.artifact.config import FORMAT_VERSION
from edgellm.artifact.manifest import FileEntry
from edgellm.artifact.reader import open_artifact
from edgellm.errors import EdgeLLMError
from edgellm.store.local import StoreError, check_name, check_sha256, release_files
from edgellm.store.trust import load_private_key, public_key_text, require_trusted, sign, verify

INDEX_FILE = "index.json"
INDEX_FORMAT = "edgellm-channel/1"
CHANNEL_FORMAT = 1
MAX_INDEX_BYTES = 16 << 20
TIMEOUT_S = 30.0


class ChannelError(EdgeLLMError):
    """A channel that cannot be read, or a release it cannot offer."""


@dataclass(frozen=True)
class Release:
    name: str
    version: str
    files: dict[str, FileEntry]
    min_edgellm: str
    format_version: int

    @property
    def total_bytes(self) -> int:
        return sum(e.size for e in self.files.values())

    def check_compatible(self) -> None:
        """ChannelError when this edgellm is too old for the release."""
        if _version_tuple(__version__) < _version_tuple(self.min_edgellm):
            raise ChannelError(f"{self.name}@{self.version} needs edgellm >= {self.min_edgellm} (this is {__version__}); "
                               "upgrade edgellm first, nothing was changed")
        if self.format_version > FORMAT_VERSION:
            raise ChannelError(f"{self.name}@{self.version} uses artifact format {self.format_version}; this edgellm "
                               f"reads format {FORMAT_VERSION}: upgrade edgellm first, nothing was changed")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("."):
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def blob_path(sha256: str) -> str:
    return f"blobs/sha256/{check_sha256(sha256)}"


# ---- reading a channel ------------------------------------------------------------------------------------
class Channel:
    """A channel at an http(s) URL or in a folder; reads the index and opens files (from a byte offset)."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.is_http = location.startswith(("http://", "https://"))
        if not self.is_http:
            if "://" in location:
                raise ChannelError(f"channel {location!r}: only http://, https:// or a folder are supported")
            self.folder = Path(location).expanduser()

    def _url(self, rel: str) -> str:
        return self.location.rstrip("/") + "/" + rel

    def open(self, rel: str, offset: int = 0) -> tuple[IO[bytes], int | None, int]:
        """(stream, total size if known, offset the stream starts at: ``offset`` or 0 if the server cannot resume)."""
        if not self.is_http:
            path = self.folder / rel
            try:
                fh = path.open("rb")
            except FileNotFoundError:
                raise ChannelError(f"the channel {self.location} has no {rel}") from None
            size = path.stat().st_size
            fh.seek(min(offset, size))
            return fh, size, min(offset, size)
        request = urllib.request.Request(self._url(rel), headers={"User-Agent": f"edgellm/{__version__}"})
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        try:
            resp = urllib.request.urlopen(request, timeout=TIMEOUT_S)  # noqa: S310 - http(s) only, checked above
        except urllib.error.HTTPError as exc:
            if exc.code == 416 and offset:  # the partial file is already complete (or longer): start over
                return self.open(rel, 0)
            raise ChannelError(f"{self._url(rel)}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ChannelError(f"cannot reach channel {self.location}: {reason}") from None
        length = resp.headers.get("Content-Length")
        if resp.status == 206:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            return resp, int(total) if total.isdigit() else None, offset
        return resp, int(length) if length and length.isdigit() else None, 0

    def read_index(self) -> dict[str, Any]:
        """The verified, parsed payload of the channel index (signature and trust checked first)."""
        fh, size, _ = self.open(INDEX_FILE)
        with fh:
            if size is not None and size > MAX_INDEX_BYTES:
                raise ChannelError(f"the channel index is {size} bytes, over the {MAX_INDEX_BYTES} byte cap")
            body = fh.read(MAX_INDEX_BYTES + 1)
        if len(body) > MAX_INDEX_BYTES:
            raise ChannelError(f"the channel index is over the {MAX_INDEX_BYTES} byte cap")
        return parse_index(body, self.location)

    def release(self, name: str, version: str | None = None) -> Release:
        models = self.read_index().get("models", {})
        entry = models.get(name)
        if not isinstance(entry, dict):
            have = ", ".join(sorted(models)) or "none"
            raise ChannelError(f"the channel {self.location} has no model {name!r} (it has: {have})")
        version = version or entry.get("latest")
        versions = entry.get("versions") if isinstance(entry.get("versions"), dict) else {}
        raw = versions.get(version)
        if not isinstance(raw, dict):
            have = ", ".join(versions) or "none"
            raise ChannelError(f"the channel has no version {version!r} of {name} (it has: {have})")
        return _release_from(name, version, raw)


def parse_index(body: bytes, where: str) -> dict[str, Any]:
    try:
        outer = json.loads(body)
        if outer.get("format") != INDEX_FORMAT:
            raise ChannelError(f"{where}: not an edgellm channel index (format {outer.get('format')!r})")
        public, signature, signed = outer["key"], outer["signature"], outer["signed"]
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError, KeyError, TypeError):
        raise ChannelError(f"{where}: the channel index is malformed") from None
    require_trusted(public)
    verify(public, signature, signed.encode("utf-8"))
    payload = json.loads(signed)
    if not isinstance(payload, dict) or not isinstance(payload.get("models", {}), dict):
        raise ChannelError(f"{where}: the signed channel index is malformed")
    if payload.get("channel_format") != CHANNEL_FORMAT:
        raise ChannelError(f"{where}: channel format {payload.get('channel_format')!r}; this edgellm reads "
                           f"{CHANNEL_FORMAT}: upgrade edgellm")
    return payload


def _release_from(name: str, version: str, raw: dict[str, Any]) -> Release:
    try:
        files = {member: FileEntry(check_sha256(e["sha256"]), int(e["size"])) for member, e in raw["files"].items()}
        return Release(check_name(name, "model name"), check_name(version, "version"), files,
                       str(raw.get("min_edgellm", "0")), int(raw.get("format_version", 1)))
    except (KeyError, TypeError, ValueError, AttributeError, StoreError) as exc:
        raise ChannelError(f"release {name}@{version} in the channel index is malformed: {exc}") from None


# ---- publishing ---------------------------------------------------------------------------------------------
def publish(artifact: Path, channel: Path, name: str, version: str, key_path: Path,
            *, min_edgellm: str | None = None) -> tuple[Release, int]:
    """Add ``artifact`` to the channel folder as NAME@VERSION and re-sign the index.

    Returns the release and the number of bytes of new files written (files already published are shared).
    """
    check_name(name, "model name")
    check_name(version, "version")
    key = load_private_key(key_path)
    art = open_artifact(artifact, verify=True)
    public = public_key_text(key.public_key())
    payload = _existing_payload(channel, public)
    versions = payload["models"].setdefault(name, {"versions": {}})["versions"]
    if version in versions:
        raise ChannelError(f"{name}@{version} is already published; releases never change (pick a new version)")
    files = release_files(art.folder)
    written = 0
    for member, entry in files.items():
        dest = channel / blob_path(entry.sha256)
        if dest.is_file() and dest.stat().st_size == entry.size:
            continue
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{secrets.token_hex(4)}.tmp")
        shutil.copyfile(art.folder / member, tmp)
        os.replace(tmp, dest)
        written += entry.size
    release = {
        "published": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "min_edgellm": min_edgellm or art.config.edgellm_version or __version__,
        "format_version": art.manifest.format_version,
        "files": {m: {"sha256": e.sha256, "size": e.size} for m, e in sorted(files.items())},
    }
    versions[version] = release
    payload["models"][name]["latest"] = version
    payload["updated"] = release["published"]
    write_index(channel, payload, key_path)
    return _release_from(name, version, release), written


def _existing_payload(channel: Path, public: str) -> dict[str, Any]:
    """The channel's current payload (checked against the publisher's own key), or an empty one."""
    path = channel / INDEX_FILE
    if not path.is_file():
        return {"channel_format": CHANNEL_FORMAT, "models": {}}
    try:
        outer = json.loads(path.read_bytes())
        signer, signature, signed = outer["key"], outer["signature"], outer["signed"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise ChannelError(f"{path} is malformed; move it away to start a new channel") from None
    if signer != public:
        raise ChannelError(f"{path} is signed by another key; publish with that key, or to a new channel folder")
    verify(public, signature, signed.encode("utf-8"))
    return json.loads(signed)


def write_index(channel: Path, payload: dict[str, Any], key_path: Path) -> None:
    """Sign ``payload`` and replace the channel's index.json atomically."""
    key = load_private_key(key_path)
    signed = json.dumps(payload, indent=1, sort_keys=True)
    outer = {"format": INDEX_FORMAT, "key": public_key_text(key.public_key()),
             "signature": sign(key, signed.encode("utf-8")), "signed": signed}
    channel.mkdir(parents=True, exist_ok=True)
    tmp = channel / f".{INDEX_FILE}.{secrets.token_hex(4)}.tmp"
    tmp.write_text(json.dumps(outer, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, channel / INDEX_FILE)
