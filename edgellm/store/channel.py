"""Release channels: a static folder (or its copy on any web server) with a signed index and the files.

Layout::

    index.json            {"format": "edgellm-channel/1", "key": "ed25519:...", "signature": ..., "signed": "<JSON>"}
    blobs/sha256/<hex>    every file of every release, once

``signed`` is the exact JSON text that was signed; it is parsed only after its signature verifies::

    {"channel_format": 1, "id": CHANNEL_ID, "sequence": N, "updated": ..., "expires": ...,
     "models": {NAME: {"latest": V, "versions": {V: RELEASE}}}}
    RELEASE = {"published": ..., "sequence": N, "min_edgellm": "0.1.0", "format_version": 1,
               "files": {"manifest.json": {"sha256": ..., "size": ...}, ...}}

``id`` (random, fixed when the channel is created), ``sequence`` (one more on every signing) and ``expires``
let `update` refuse a replayed older index or a frozen channel (freshness.py); an index written before they
existed has none of them. Times are UTC, ``%Y-%m-%dT%H:%M:%SZ``.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import secrets
import shutil
import stat
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from edgellm import __version__
from edgellm.artifact.config import FORMAT_VERSION
from edgellm.artifact.manifest import FileEntry
from edgellm.artifact.reader import open_artifact
from edgellm.errors import EdgeLLMError
from edgellm.store.deadline import Deadline
from edgellm.store.local import ReleaseStamp, StoreError, check_name, check_sha256, release_files
from edgellm.store.trust import key_id, load_private_key, public_key_text, require_trusted, sign, verify

INDEX_FILE = "index.json"
INDEX_FORMAT = "edgellm-channel/1"
CHANNEL_FORMAT = 1
MAX_INDEX_BYTES = 16 << 20
TIMEOUT_S = 600.0  # default total time one channel read (the index, one file) may take
MAX_TIMEOUT_S = 86400.0
CONNECT_TIMEOUT_S = 30.0
EXPIRES_DAYS = 30.0  # default validity of a signed index
TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
_TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")


class ChannelError(EdgeLLMError):
    """A channel that cannot be read, or a release it cannot offer."""


@dataclass(frozen=True)
class Release:
    name: str
    version: str
    files: dict[str, FileEntry]
    min_edgellm: str
    format_version: int
    stamp: ReleaseStamp

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
@dataclass(frozen=True)
class Opened:
    """A channel file being read: the stream, its total size if known, the offset the stream starts at
    (the one asked for, or 0 if the server cannot resume) and the read's deadline."""

    stream: IO[bytes]
    total: int | None
    start: int
    deadline: Deadline


class Channel:
    """A channel at an http(s) URL or in a folder (kept as an absolute path); reads the index and opens files
    (from a byte offset), each read bounded by ``timeout_s`` in total."""

    def __init__(self, location: str, *, timeout_s: float = TIMEOUT_S) -> None:
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ChannelError(f"--timeout takes 0 < SECONDS <= {MAX_TIMEOUT_S:g}, not {timeout_s}")
        self.timeout_s = timeout_s
        self.is_http = location.startswith(("http://", "https://"))
        self.location = location
        if not self.is_http:
            if "://" in location:
                raise ChannelError(f"channel {location!r}: only http://, https:// or a folder are supported")
            self.folder = Path(location).expanduser().absolute()
            self.location = str(self.folder)

    def _url(self, rel: str) -> str:
        return self.location.rstrip("/") + "/" + rel

    @contextlib.contextmanager
    def open(self, rel: str, offset: int = 0) -> Iterator[Opened]:
        """The file ``rel`` from ``offset``; the whole read must end within ``timeout_s`` (then its socket is shut)."""
        with Deadline(self.timeout_s) as deadline:
            stream, total, start = self._open_folder(rel, offset) if not self.is_http else \
                self._open_http(rel, offset, deadline)
            with stream:
                yield Opened(stream, total, start, deadline)

    def _open_folder(self, rel: str, offset: int) -> tuple[IO[bytes], int, int]:
        nonblocking = getattr(os, "O_NONBLOCK", 0)  # so a FIFO without a writer cannot hang the open
        try:
            fd = os.open(self.folder / rel, os.O_RDONLY | nonblocking | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise ChannelError(f"the channel {self.location} has no {rel}") from None
        except OSError as exc:
            raise ChannelError(f"cannot read {rel} from the channel {self.location}: {exc.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ChannelError(f"the channel's {rel} is not a regular file (a FIFO, device or folder): refused")
        if nonblocking:
            os.set_blocking(fd, True)
        fh = os.fdopen(fd, "rb")
        fh.seek(min(offset, info.st_size))
        return fh, info.st_size, min(offset, info.st_size)

    def _open_http(self, rel: str, offset: int, deadline: Deadline) -> tuple[IO[bytes], int | None, int]:
        request = urllib.request.Request(self._url(rel), headers={"User-Agent": f"edgellm/{__version__}"})
        if offset:
            request.add_header("Range", f"bytes={offset}-")
        opener = urllib.request.build_opener(_WatchedHTTPHandler(deadline), _WatchedHTTPSHandler(deadline))
        try:
            resp = opener.open(request, timeout=min(CONNECT_TIMEOUT_S, deadline.remaining()))
        except urllib.error.HTTPError as exc:
            exc.close()
            if exc.code == 416 and offset:  # the partial file is already complete (or longer): start over
                return self._open_http(rel, 0, deadline)
            raise ChannelError(f"{self._url(rel)}: HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            if deadline.passed:
                raise ChannelError(f"the channel {self.location} did not answer for {rel} within the "
                                   f"{self.timeout_s:g} s deadline; nothing was changed") from None
            reason = getattr(exc, "reason", exc)
            raise ChannelError(f"cannot reach channel {self.location}: {reason}") from None
        length = resp.headers.get("Content-Length")
        if resp.status == 206:
            total = resp.headers.get("Content-Range", "").rpartition("/")[2]
            return resp, int(total) if total.isdigit() else None, offset
        return resp, int(length) if length and length.isdigit() else None, 0

    def read_index(self) -> SignedIndex:
        """The channel index, its signature verified and its key trusted (for some model) first."""
        with self.open(INDEX_FILE) as got:
            if got.total is not None and got.total > MAX_INDEX_BYTES:
                raise ChannelError(f"the channel index is {got.total} bytes, over the {MAX_INDEX_BYTES} byte cap")
            error: OSError | http.client.HTTPException | None
            try:
                body = got.stream.read(MAX_INDEX_BYTES + 1)
            except (OSError, http.client.HTTPException) as exc:
                body, error = b"", exc
            else:
                error = None
            if got.deadline.passed:
                raise ChannelError(f"the channel index did not arrive within the {self.timeout_s:g} s deadline "
                                   f"({self.location}); nothing was changed")
            if error is not None or (got.total is not None and len(body) < got.total):
                raise ChannelError(f"the channel index from {self.location} was cut short; nothing was changed")
        if len(body) > MAX_INDEX_BYTES:
            raise ChannelError(f"the channel index is over the {MAX_INDEX_BYTES} byte cap")
        return parse_index(body, self.location)


class _WatchedHTTPHandler(urllib.request.HTTPHandler):
    """urllib's http handler, each connection's socket handed to a deadline."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def http_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        deadline = self.deadline

        class Connection(http.client.HTTPConnection):
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        return self.do_open(Connection, req)


class _WatchedHTTPSHandler(urllib.request.HTTPSHandler):
    """urllib's https handler, each connection's socket handed to a deadline."""

    def __init__(self, deadline: Deadline) -> None:
        super().__init__()
        self.deadline = deadline

    def https_open(self, req: urllib.request.Request) -> http.client.HTTPResponse:
        deadline = self.deadline

        class Connection(http.client.HTTPSConnection):
            def connect(self) -> None:
                super().connect()
                deadline.watch(self.sock)

        # urllib's HTTPSHandler keeps its SSL context in _context, which typeshed does not declare
        return self.do_open(Connection, req, context=self._context)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class SignedIndex:
    """A channel index whose signature verified with a trusted key; the payload is what that key signed."""

    key: str
    payload: dict[str, Any]
    digest: str  # sha256 of the signed text
    location: str

    @property
    def identity(self) -> str:
        """The channel as the freshness record knows it: its signer and its id (its location before it had one)."""
        channel_id = self.payload.get("id")
        return f"{key_id(self.key)}/{channel_id}" if channel_id else f"{key_id(self.key)}@{self.location}"

    @property
    def sequence(self) -> int | None:
        return self.payload.get("sequence")

    @property
    def updated(self) -> str:
        return str(self.payload.get("updated", ""))

    @property
    def expires(self) -> str | None:
        return self.payload.get("expires")

    def release(self, name: str, version: str | None = None) -> Release:
        """NAME at ``version`` (default: the latest); SignatureError unless the key may publish NAME."""
        models = self.payload.get("models", {})
        entry = models.get(name)
        if not isinstance(entry, dict):
            have = ", ".join(sorted(models)) or "none"
            raise ChannelError(f"the channel {self.location} has no model {name!r} (it has: {have})")
        require_trusted(self.key, name)
        version = version or entry.get("latest")
        versions = entry["versions"] if isinstance(entry.get("versions"), dict) else {}
        raw = versions.get(version)
        if not isinstance(raw, dict):
            have = ", ".join(versions) or "none"
            raise ChannelError(f"the channel has no version {version!r} of {name} (it has: {have})")
        return _release_from(name, str(version), raw)


def parse_index(body: bytes, where: str) -> SignedIndex:
    try:
        outer = json.loads(body)
        if outer.get("format") != INDEX_FORMAT:
            raise ChannelError(f"{where}: not an edgellm channel index (format {outer.get('format')!r})")
        public, signature, signed = outer["key"], outer["signature"], outer["signed"]
        if not isinstance(signed, str):
            raise TypeError
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
    fresh = [payload.get(k) is not None for k in ("id", "sequence", "expires")]
    if (any(fresh) and not all(fresh)) or (all(fresh) and not _fresh_fields_ok(payload)):
        raise ChannelError(f"{where}: the signed channel index has a malformed id, sequence or expires")
    return SignedIndex(public.strip(), payload, hashlib.sha256(signed.encode("utf-8")).hexdigest(), where)


def _fresh_fields_ok(payload: dict[str, Any]) -> bool:
    sequence, expires, channel_id = payload["sequence"], payload["expires"], payload["id"]
    return (isinstance(sequence, int) and not isinstance(sequence, bool) and sequence > 0
            and isinstance(expires, str) and bool(_TIME.match(expires))
            and isinstance(channel_id, str) and bool(re.fullmatch(r"[0-9a-f]{16,64}", channel_id)))


def _release_from(name: str, version: str, raw: dict[str, Any]) -> Release:
    try:
        files = {member: FileEntry(check_sha256(e["sha256"]), int(e["size"])) for member, e in raw["files"].items()}
        published = str(raw.get("published", ""))
        if not _TIME.match(published):
            raise ValueError(f"published {published!r} is not a UTC time")
        stamp = ReleaseStamp(published, int(raw.get("sequence", 0)))
        return Release(check_name(name, "model name"), check_name(version, "version"), files,
                       str(raw.get("min_edgellm", "0")), int(raw.get("format_version", 1)), stamp)
    except (KeyError, TypeError, ValueError, AttributeError, StoreError) as exc:
        raise ChannelError(f"release {name}@{version} in the channel index is malformed: {exc}") from None


# ---- publishing ---------------------------------------------------------------------------------------------
def publish(artifact: Path, channel: Path, name: str, version: str, key_path: Path,
            *, min_edgellm: str | None = None, expires_days: float = EXPIRES_DAYS) -> tuple[Release, int]:
    """Add ``artifact`` to the channel folder as NAME@VERSION and re-sign the index (valid ``expires_days``).

    Returns the release and the number of bytes of new files written (files already published are shared).
    """
    check_name(name, "model name")
    check_name(version, "version")
    _check_expires(expires_days)
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
        "published": time.strftime(TIME_FORMAT, time.gmtime()),
        "sequence": _next_sequence(payload),
        "min_edgellm": min_edgellm or art.config.edgellm_version or __version__,
        "format_version": art.manifest.format_version,
        "files": {m: {"sha256": e.sha256, "size": e.size} for m, e in sorted(files.items())},
    }
    versions[version] = release
    payload["models"][name]["latest"] = version
    write_index(channel, payload, key_path, expires_days=expires_days)
    return _release_from(name, version, release), written


def refresh(channel: Path, key_path: Path, *, expires_days: float = EXPIRES_DAYS) -> dict[str, Any]:
    """Re-sign the channel's index unchanged but for a new sequence and expiry (a channel must be refreshed
    before it expires, or updates refuse it as frozen); returns the new payload."""
    if not (channel / INDEX_FILE).is_file():
        raise ChannelError(f"{channel} has no {INDEX_FILE}; `edgellm publish` creates the channel")
    payload = _existing_payload(channel, public_key_text(load_private_key(key_path).public_key()))
    write_index(channel, payload, key_path, expires_days=expires_days)
    return payload


def _check_expires(days: float) -> None:
    if not 0 < days <= 3660:
        raise ChannelError(f"--expires takes 0 < DAYS <= 3660, not {days}")


def _next_sequence(payload: dict[str, Any]) -> int:
    sequence = payload.get("sequence")
    return (sequence if isinstance(sequence, int) else 0) + 1


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


def write_index(channel: Path, payload: dict[str, Any], key_path: Path, *,
                expires_days: float = EXPIRES_DAYS) -> None:
    """Sign ``payload`` as the channel's next index (a new sequence number, ``updated`` now, valid for
    ``expires_days``; the channel id made once) and replace the channel's index.json atomically."""
    _check_expires(expires_days)
    key = load_private_key(key_path)
    now = time.time()
    payload.setdefault("id", secrets.token_hex(8))
    payload["sequence"] = _next_sequence(payload)
    payload["updated"] = time.strftime(TIME_FORMAT, time.gmtime(now))
    payload["expires"] = time.strftime(TIME_FORMAT, time.gmtime(now + expires_days * 86400))
    signed = json.dumps(payload, indent=1, sort_keys=True)
    outer = {"format": INDEX_FORMAT, "key": public_key_text(key.public_key()),
             "signature": sign(key, signed.encode("utf-8")), "signed": signed}
    channel.mkdir(parents=True, exist_ok=True)
    tmp = channel / f".{INDEX_FILE}.{secrets.token_hex(4)}.tmp"
    tmp.write_text(json.dumps(outer, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, channel / INDEX_FILE)
