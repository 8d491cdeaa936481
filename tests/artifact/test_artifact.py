"""Artifact integrity: every way a folder can be damaged gives a clear ArtifactError naming the file."""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from edgellm.artifact.huge_pages import mapping_bounds
from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import ArtifactError, EdgeLLMError
from edgellm.runtime.engine import Engine
from tests.support.tiny import make_tiny


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("art")
    make_tiny(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "q4", quantization="q4f16_1", progress=False)


@pytest.fixture
def copy(artifact: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(artifact, tmp_path / "copy"))


def test_layout_and_manifest(artifact: Path) -> None:
    names = sorted(p.name for p in artifact.iterdir())
    shards = [f"weights-0000{i}.safetensors" for i in (1, 2, 3)]  # embeddings + final norm, then one per layer
    assert names == ["edgellm-config.json", "manifest.json", "tokenizer.json", *shards]
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert set(manifest["files"]) == set(names) - {"manifest.json"}
    assert manifest["parameter_count"] > 0 and 4 < manifest["bits_per_parameter"] < 8
    config = json.loads((artifact / "edgellm-config.json").read_text())
    assert config["quantization"]["scheme"] == "q4f16_1"
    assert config["quantization"]["formats"]["model.layers.0.mlp.up_proj"] == "q4"
    assert not list(artifact.parent.glob(".*partial"))  # no temp folder left behind


def test_flipped_byte_in_shard_is_caught(copy: Path) -> None:
    shard = copy / "weights-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights-00001.safetensors fails its xxh3 check"):
        open_artifact(copy)  # every load: the fast digest
    with pytest.raises(ArtifactError, match="weights-00001.safetensors fails its sha256 check"):
        open_artifact(copy, sha256=True)  # `edgellm verify`
    open_artifact(copy, verify=False)  # the size-only check cannot see a same-size change
    for sha256, kind in ((False, "xxh3"), (True, "sha256")):  # checked while the caller goes on, before any use
        meanwhile = open_artifact(copy, sha256=sha256, check_weights_meanwhile=True)
        with pytest.raises(ArtifactError, match=f"weights-00001.safetensors fails its {kind} check"):
            meanwhile.weights()
    with pytest.raises(ArtifactError, match="weights-00001.safetensors fails its xxh3 check"):
        Engine.load(copy, threads=1, progress=False)  # Engine.load checks the weights that way


def test_weights_checked_meanwhile_are_the_same_and_sizes_are_checked_at_once(copy: Path) -> None:
    meanwhile = open_artifact(copy, check_weights_meanwhile=True)
    assert meanwhile.weights_check is not None
    tensors, mapped = meanwhile.weights(), open_artifact(copy).weights()
    assert tensors.keys() == mapped.keys() and all(torch.equal(tensors[k], mapped[k]) for k in mapped)
    assert open_artifact(copy, verify=False, check_weights_meanwhile=True).weights_check is None  # nothing to check
    shard = copy / "weights-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.raises(ArtifactError, match="weights-00001.safetensors is .* bytes, the manifest says"):
        open_artifact(copy, check_weights_meanwhile=True)


def test_manifest_without_fast_digests_is_checked_with_sha256(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    assert all(len(e["xxh3_128"]) == 32 and len(e["sha256"]) == 64 for e in manifest["files"].values())
    for entry in manifest["files"].values():
        del entry["xxh3_128"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    open_artifact(copy)
    shard = copy / "weights-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="weights-00001.safetensors fails its sha256 check"):
        open_artifact(copy)


def test_old_format_artifact_folder_says_reconvert(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"format 1 from an older edgellm.*re-run `edgellm convert`") as e:
        open_artifact(copy)
    assert "\n" not in str(e.value)


def test_old_format_catalog_artifact_recompiles_itself(
    copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import edgellm.convert.pipeline as pipeline
    from edgellm.resolve import resolve_model

    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    target = tmp_path / "home" / "artifacts" / "smollm2-135m-q4f16_1"
    shutil.copytree(copy, target)
    calls: list[tuple[str, Path, bool]] = []
    monkeypatch.setattr(pipeline, "convert", lambda name, out, **kw: calls.append((name, out, kw["force"])))
    assert resolve_model("smollm2-135m:q4f16_1") == target and calls == []  # current format: used as it is
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["format_version"] = 1
    (target / "manifest.json").write_text(json.dumps(manifest))
    assert resolve_model("smollm2-135m:q4f16_1") == target
    assert calls == [("smollm2-135m", target, True)]


def test_truncated_shard_is_caught_even_without_hashing(copy: Path) -> None:
    shard = copy / "weights-00001.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(ArtifactError, match="weights-00001.safetensors is .* bytes, the manifest says"):
        open_artifact(copy, verify=False)


def test_missing_files(copy: Path) -> None:
    (copy / "tokenizer.json").unlink()
    with pytest.raises(ArtifactError, match="tokenizer.json is missing"):
        open_artifact(copy)
    (copy / "manifest.json").unlink()
    with pytest.raises(ArtifactError, match="no manifest.json"):
        open_artifact(copy)


def test_manifest_paths_cannot_escape_the_folder(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["../../etc/passwd"] = {"sha256": "0" * 64, "size": 1}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="unsafe path '../../etc/passwd'"):
        open_artifact(copy)


def test_newer_format_version_is_refused(copy: Path) -> None:
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="format_version 99"):
        open_artifact(copy)


def test_convert_refuses_to_overwrite_and_bad_options_leave_nothing(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(EdgeLLMError, match="already exists"):
        convert(artifact.parent / "hf", artifact, progress=False)
    with pytest.raises(EdgeLLMError, match="unknown quantization|q9f16"):
        convert(artifact.parent / "hf", tmp_path / "bad", quantization="q9f16", progress=False)
    assert list(tmp_path.iterdir()) == []


SMALL_SHARD_BYTES = 8 << 10  # the tiny q4 model then spans several shards, so a failure can fall between them


def _nothing_looks_like_an_artifact(parent: Path, out: Path) -> None:
    """`out` is absent and every leftover in `parent` is a hidden temporary folder (or its lock file), never a
    valid artifact."""
    assert not out.exists()
    for left in parent.iterdir():
        assert left.name.startswith(f".{out.name}.") and left.name.endswith((".partial", ".partial.lock")), left


def test_an_exception_after_some_shards_leaves_nothing_and_keeps_the_old_artifact(
        artifact: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from edgellm.artifact import tensors
    from edgellm.convert import pipeline

    written: list[str] = []

    class FailingWriter(tensors.ShardWriter):
        def __init__(self, folder: Path) -> None:
            super().__init__(folder, max_bytes=SMALL_SHARD_BYTES)

        def flush(self) -> None:
            super().flush()
            written.extend(self.files[len(written):])
            if len(self.files) == 2:
                raise OSError("disk full (injected)")

    monkeypatch.setattr(pipeline, "ShardWriter", FailingWriter)
    out = tmp_path / "out" / "q4"
    with pytest.raises(OSError, match="injected"):
        convert(artifact.parent / "hf", out, progress=False)
    assert written == ["weights-00001.safetensors", "weights-00002.safetensors"]
    assert list(out.parent.iterdir()) == []  # the temporary folder, shards and all, is gone

    old = Path(shutil.copytree(artifact, tmp_path / "old"))
    with pytest.raises(OSError, match="injected"):
        convert(artifact.parent / "hf", old, force=True, progress=False)
    open_artifact(old)  # --force over an artifact keeps the old one, verified, when the new one fails
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old", "out"]

    monkeypatch.setattr(pipeline, "ShardWriter", tensors.ShardWriter)
    open_artifact(convert(artifact.parent / "hf", out, progress=False))  # a rerun succeeds


# `edgellm convert` with small shards that stops after each shard until told to go on, so the test can kill it
# with SIGKILL exactly after shard k (no cleanup code runs).
_PAUSING_CONVERT = """
import sys
from edgellm.artifact import tensors
from edgellm.convert import pipeline
from edgellm.cli import main

class PausingWriter(tensors.ShardWriter):
    def __init__(self, folder):
        super().__init__(folder, max_bytes={max_bytes})

    def flush(self):
        super().flush()
        print("shard", len(self.files), flush=True)
        sys.stdin.readline()

pipeline.ShardWriter = PausingWriter
sys.exit(main(sys.argv[1:]))
"""


def _edgellm(*args: str) -> list[str]:
    return [sys.executable, "-c", _PAUSING_CONVERT.format(max_bytes=SMALL_SHARD_BYTES), *args]


@pytest.mark.parametrize("kill_after", [1, 2, "random"])
def test_sigkill_during_convert_leaves_nothing_and_a_rerun_succeeds(artifact: Path, tmp_path: Path,
                                                                   kill_after: object) -> None:
    out = tmp_path / "q4"
    cmd = ["convert", str(artifact.parent / "hf"), "-q", "q4f16_1", "-o", str(out), "--quiet"]
    proc = subprocess.Popen(_edgellm(*cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    if kill_after == "random":  # let it run freely, then kill it at a random moment of the write
        assert proc.stdout.readline().startswith("shard 1")
        proc.stdin.write("\n" * 1000)
        proc.stdin.flush()
        time.sleep(random.uniform(0.0, 0.3))
    else:
        for k in range(1, int(kill_after) + 1):  # type: ignore[call-overload]
            assert proc.stdout.readline() == f"shard {k}\n"
            if k < kill_after:  # type: ignore[operator]
                proc.stdin.write("\n")
                proc.stdin.flush()
    proc.kill()
    proc.wait(30)
    if out.exists():  # the random kill came after the final rename: then it is a whole, verified artifact
        assert kill_after == "random" and open_artifact(out).config.quantization.scheme == "q4f16_1"
        return
    _nothing_looks_like_an_artifact(tmp_path, out)
    rerun = subprocess.run([sys.executable, "-m", "edgellm", *cmd], capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr
    open_artifact(out)
    assert [p.name for p in tmp_path.iterdir()] == [out.name]  # the rerun removed what the killed one left


def test_weights_are_memory_mapped(artifact: Path) -> None:
    tensors = open_artifact(artifact).weights()
    norm = tensors["model.norm.weight"]
    assert not norm.untyped_storage().resizable()  # a view on the mapped file, not a private copy
    assert len(tensors.mappings) == len(list(artifact.glob("weights-*.safetensors")))
    bounds = [mapping_bounds(mm) for mm in tensors.mappings]
    for t in tensors.values():  # each tensor lies in the mapping of its shard (artifact/huge_pages.py moves by them)
        assert any(lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= hi for lo, hi in bounds)


def test_engine_reports_memory_estimate(artifact: Path) -> None:
    engine = Engine(open_artifact(artifact), threads=1)
    mem = engine.memory
    assert mem.kv_cache_bytes == engine.cache.nbytes
    assert mem.weights_bytes > 0 and mem.total_bytes > mem.kv_cache_bytes
    smaller = Engine(open_artifact(artifact), context_window=32).memory
    assert smaller.kv_cache_bytes * 8 == mem.kv_cache_bytes  # the tiny model's window is 256


def test_memory_budget_refuses_with_the_numbers(artifact: Path) -> None:
    from edgellm.errors import MemoryBudgetError

    with pytest.raises(MemoryBudgetError, match=r"needs about \d+ MiB .* over the budget of 0 MiB"):
        Engine(open_artifact(artifact), memory_budget=1)
    fits = Engine(open_artifact(artifact), context_window=32)
    assert Engine(open_artifact(artifact), context_window=32, memory_budget=fits.memory.total_bytes).memory == fits.memory


@pytest.mark.parametrize("size", [0, 1, 4 << 20, (4 << 20) + 1, 9_000_001])
def test_file_digests_match_digests_of_the_whole_bytes(tmp_path: Path, size: int) -> None:
    """The chunked file digests (xxh3 in a reused buffer, sha256 in chunks) against hashing all the bytes at once."""
    import hashlib

    import xxhash

    from edgellm.artifact.manifest import sha256_file, xxh3_file

    data = random.Random(size).randbytes(size)
    path = tmp_path / "blob"
    path.write_bytes(data)
    assert xxh3_file(path) == xxhash.xxh3_128_hexdigest(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
