"""Artifact integrity: every way a folder can be damaged gives a clear ArtifactError naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import ArtifactError, EdgeLLMError
from edgellm.runtime.engine import Engine
from tests.tiny import make_tiny


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
    assert resolve_model("smollm2-135m") == target and calls == []  # current format: used as it is
    manifest = json.loads((target / "manifest.json").read_text())
    manifest["format_version"] = 1
    (target / "manifest.json").write_text(json.dumps(manifest))
    assert resolve_model("smollm2-135m") == target
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


def test_convert_refuses_to_overwrite_and_failure_leaves_nothing(artifact: Path, tmp_path: Path) -> None:
    with pytest.raises(EdgeLLMError, match="already exists"):
        convert(artifact.parent / "hf", artifact, progress=False)
    with pytest.raises(EdgeLLMError, match="unknown quantization|q9f16"):
        convert(artifact.parent / "hf", tmp_path / "bad", quantization="q9f16", progress=False)
    assert not (tmp_path / "bad").exists()
    assert not list(tmp_path.glob(".*partial"))


def test_weights_are_memory_mapped(artifact: Path) -> None:
    tensors = open_artifact(artifact).weights()
    norm = tensors["model.norm.weight"]
    assert not norm.untyped_storage().resizable()  # a view on the mapped file, not a private copy


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
