"""Versioned store, signed channels and delta updates, against a real HTTP server on loopback.

v1 and v2 are the same tiny random model; v2's recipe keeps one more layer (layer 1) at 8 bits, so
per-layer shards make the update one shard plus the config and manifest.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from edgellm.artifact.reader import open_artifact
from edgellm.cli import main
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from edgellm.store.channel import Channel, ChannelError, publish, write_index
from edgellm.store.local import Store, StoreError, release_files
from edgellm.store.trust import SignatureError, generate_keypair, read_key_argument, trust
from edgellm.updates.update import CanaryError, update
from tests.support.channel_server import ChannelServer
from tests.support.tiny import make_tiny

LAYER1 = [f"model.layers.1.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                          "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
PROMPT = "t1 t2 t3 t4"


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    make_tiny(root / "hf", "llama", tied=True)
    (root / "hf" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    v1 = convert(root / "hf", root / "v1", quantization="q4f16_1", progress=False)
    v2 = convert(root / "hf", root / "v2", quantization="q4f16_1", overrides=dict.fromkeys(LAYER1, "q8"),
                 progress=False)
    return {"1": v1, "2": v2}


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def key(tmp_path: Path, home: Path) -> Path:
    path = tmp_path / "keys" / "release.key"
    trust(generate_keypair(path))
    return path


@pytest.fixture
def server(tmp_path: Path):
    srv = ChannelServer(tmp_path / "channel")
    yield srv
    srv.close()


def reply(model: str) -> tuple[str, list[int]]:
    engine = Engine.load(model, threads=1, progress=False)
    result = engine.generate(PROMPT, GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    engine.close()
    return result.text, result.token_ids


def changed(a: Path, b: Path) -> dict[str, int]:
    fa, fb = release_files(a), release_files(b)
    return {n: e.size for n, e in fb.items() if fa.get(n) != e}


def test_per_layer_shards_make_a_one_layer_change_one_shard(versions: dict[str, Path]) -> None:
    shards = sorted(p.name for p in versions["1"].glob("weights-*"))
    assert len(shards) == 3  # globals, layer 0, layer 1
    delta = changed(versions["1"], versions["2"])
    assert set(delta) == {"weights-00003.safetensors", "edgellm-config.json", "manifest.json"}


def test_store_shares_files_activates_and_rolls_back(versions: dict[str, Path], home: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    store = Store()
    for v in ("1", "2"):
        assert main(["store", "add", str(versions[v]), f"tiny@{v}"]) == 0
    one, two = store.get("tiny", "1"), store.get("tiny", "2")
    shared = release_files(versions["1"])["weights-00002.safetensors"]
    assert os.stat(one.folder / "weights-00002.safetensors").st_ino == os.stat(two.folder / "weights-00002.safetensors").st_ino
    assert store.usage()["blob_bytes"] < one.total_bytes + two.total_bytes - shared.size + 1
    capsys.readouterr()
    assert main(["store", "list", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    states = {r["version"]: (r["state"], r["shared_files"]) for r in listing["versions"]}
    assert states == {"1": ("previous", 4), "2": ("current", 4)}  # globals, layer 0, tokenizer, template
    own = {r["version"]: r["own_files"] for r in listing["versions"]}
    assert own["2"] == own["1"] == ["edgellm-config.json", "manifest.json", "weights-00003.safetensors"]
    from edgellm.resolve import resolve_model

    assert resolve_model("tiny") == two.folder and resolve_model("tiny@1") == one.folder
    assert main(["rollback", "tiny"]) == 0
    assert resolve_model("tiny") == one.folder
    assert main(["store", "activate", "tiny", "2"]) == 0 and store.refs("tiny").previous == "1"
    assert main(["store", "gc"]) == 0 and store.get("tiny", "1").files  # nothing in use is dropped
    open_artifact(store.get("tiny", "1").folder)
    with pytest.raises(StoreError, match="already installed"):
        store.add_folder(versions["1"], "tiny", "1")
    store.add_folder(versions["1"], "tiny", "3")  # v1's bytes again: nothing new is stored
    store.activate("tiny", "3")
    assert store.gc(prune=True) == (["tiny@1"], 0, 0)  # 2 is previous, 3 current; every blob still in use
    with pytest.raises(EdgeLLMError, match="no version '9'"):
        resolve_model("tiny@9")


def test_update_over_http_fetches_only_changed_files_and_rollback_is_identical(
        versions: dict[str, Path], home: Path, key: Path, server: ChannelServer) -> None:
    publish(versions["1"], server.root, "tiny", "1", key)
    update("tiny", server.url)
    assert len(server.blob_requests()) == len(release_files(versions["1"]))
    before = reply("tiny")
    publish(versions["2"], server.root, "tiny", "2", key)
    server.log.clear()
    messages: list[str] = []
    update("tiny", server.url, canary=PROMPT, say=messages.append)  # channel given again: no memory needed
    delta = changed(versions["1"], versions["2"])
    fetched = server.blob_requests()
    assert len(fetched) == len(delta) == 3
    assert sum(s.sent for s in fetched) == sum(delta.values())
    assert "3 of 7 files to download" in messages[0]  # reported before the download
    assert Store().refs("tiny").current == "2"
    server.log.clear()
    assert main(["rollback", "tiny"]) == 0
    assert server.log == []  # nothing downloaded
    assert reply("tiny") == before
    assert reply("tiny@2")[1]  # still installed, still loads


def _install_v1_then_publish_v2(versions: dict[str, Path], key: Path, server: ChannelServer) -> tuple[str, list[int]]:
    publish(versions["1"], server.root, "tiny", "1", key)
    update("tiny", server.url)
    publish(versions["2"], server.root, "tiny", "2", key)
    server.log.clear()
    return reply("tiny")


def _still_v1(before: tuple[str, list[int]]) -> None:
    assert Store().refs("tiny").current == "1"
    assert reply("tiny") == before


def test_tampered_file_is_refused(versions: dict[str, Path], home: Path, key: Path, server: ChannelServer) -> None:
    before = _install_v1_then_publish_v2(versions, key, server)
    sha = release_files(versions["2"])["weights-00003.safetensors"].sha256
    blob = server.root / "blobs" / "sha256" / sha
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 1
    blob.write_bytes(bytes(data))
    with pytest.raises(ChannelError, match="fails its sha256 check.*current version is unchanged"):
        update("tiny", server.url)
    _still_v1(before)
    assert not list((Store().tmp).glob(f"{sha}*"))  # the bad download is not kept


def test_wrong_signature_and_untrusted_key_are_refused(versions: dict[str, Path], home: Path, key: Path,
                                                       server: ChannelServer, tmp_path: Path) -> None:
    before = _install_v1_then_publish_v2(versions, key, server)
    index = server.root / "index.json"
    good = index.read_text()
    outer = json.loads(good)
    outer["signed"] = outer["signed"].replace('"latest": "2"', '"latest": "1"')
    index.write_text(json.dumps(outer))
    with pytest.raises(SignatureError, match="does not verify"):
        update("tiny", server.url)
    _still_v1(before)
    other = tmp_path / "other.key"
    generate_keypair(other)  # signs a channel with a key that is not trusted
    publish(versions["2"], tmp_path / "rogue", "tiny", "2", other)
    with pytest.raises(SignatureError, match="which you do not trust"):
        update("tiny", str(tmp_path / "rogue"))
    forged = json.loads((tmp_path / "rogue" / "index.json").read_text())
    forged["key"] = read_key_argument(str(key) + ".pub")  # claims the trusted key, signed by the other
    (tmp_path / "rogue" / "index.json").write_text(json.dumps(forged))
    with pytest.raises(SignatureError, match="does not verify"):
        update("tiny", str(tmp_path / "rogue"))
    _still_v1(before)
    assert server.blob_requests() == []  # nothing was fetched before the signature checked out


def test_server_killed_mid_download_resumes(versions: dict[str, Path], home: Path, key: Path,
                                            server: ChannelServer) -> None:
    before = _install_v1_then_publish_v2(versions, key, server)
    server.cut_after = 1000
    with pytest.raises(ChannelError, match="interrupted at 1000 of .*run the update again to resume"):
        update("tiny", server.url)
    _still_v1(before)
    first = server.blob_requests()[0]
    size = release_files(versions["2"])
    size_of = {e.sha256: e.size for e in size.values()}
    sha = first.path.rsplit("/", 1)[1]
    server.cut_after = None
    server.log.clear()
    update("tiny", server.url)
    resumed = next(s for s in server.blob_requests() if s.path == first.path)
    assert resumed.status == 206 and resumed.range == "bytes=1000-"
    assert resumed.sent == size_of[sha] - 1000
    assert Store().refs("tiny").current == "2"
    open_artifact(Store().get("tiny", "2").folder)


def test_failed_gate_and_newer_edgellm_leave_current(versions: dict[str, Path], home: Path, key: Path,
                                                     server: ChannelServer, tmp_path: Path) -> None:
    before = _install_v1_then_publish_v2(versions, key, server)
    baseline = tmp_path / "baseline.json"  # a perfect score the random model cannot match
    rates = {f"{m}.{r}": 100.0 for m in ("constrained",) for r in ("valid_json", "fields_complete", "values_correct")}
    baseline.write_text(json.dumps({"kind": "task", "modes": {"constrained": {"items": 1}}, "rates": rates}))
    with pytest.raises(CanaryError, match="eval gate (failed|could not run)"):
        update("tiny", server.url, gate=baseline)
    _still_v1(before)
    assert "2" not in Store().versions("tiny")
    pruned, removed, freed = Store().gc()  # v2's downloaded files are referenced by no version
    assert (pruned, removed, freed) == ([], 3, sum(changed(versions["1"], versions["2"]).values()))
    _still_v1(before)
    publish(versions["2"], server.root, "tiny", "3", key, min_edgellm="99.0")
    with pytest.raises(ChannelError, match=r"needs edgellm >= 99.0 \(this is"):
        update("tiny", server.url)
    payload = json.loads(json.loads((server.root / "index.json").read_text())["signed"])
    payload["models"]["tiny"]["versions"]["2"]["format_version"] = 99  # a newer artifact format, signed
    write_index(server.root, payload, key)
    with pytest.raises(ChannelError, match=r"uses artifact format 99; this edgellm reads format \d+"):
        update("tiny", server.url, version="2")
    _still_v1(before)
    publish(versions["2"], tmp_path / "other", "tiny", "1", key)  # another channel's "1" is v2's bytes
    with pytest.raises(ChannelError, match="differs from the installed one"):
        update("tiny", str(tmp_path / "other"))
    _still_v1(before)


def test_cli_errors_are_one_line(versions: dict[str, Path], home: Path, key: Path, server: ChannelServer,
                                 capsys: pytest.CaptureFixture[str]) -> None:
    publish(versions["1"], server.root, "tiny", "1", key)
    (home / "trusted-keys.json").unlink()
    capsys.readouterr()
    assert main(["update", "tiny", "--channel", server.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("edgellm: error: the channel is signed by key")
    assert main(["rollback", "nothing"]) == 1
    assert "no model 'nothing' in the store" in capsys.readouterr().err
    assert main(["trust", "add", str(key) + ".pub"]) == 0
    assert main(["update", "tiny", "--channel", server.url, "--quiet"]) == 0
    assert main(["rollback", "tiny"]) == 1
    assert capsys.readouterr().err.strip().endswith("tiny has no previous version to roll back to")


def test_channel_rejects_non_http_schemes() -> None:
    with pytest.raises(ChannelError, match="only http"):
        Channel("ftp://example.org/channel")


def test_repair_fetches_only_the_damaged_shared_file(versions: dict[str, Path], home: Path, key: Path,
                                                     server: ChannelServer) -> None:
    before = _install_v1_then_publish_v2(versions, key, server)
    update("tiny", server.url)
    shared = Store().get("tiny", "1").folder / "weights-00002.safetensors"  # linked by both versions
    os.chmod(shared, 0o644)
    data = bytearray(shared.read_bytes())
    data[len(data) // 2] ^= 1
    shared.write_bytes(bytes(data))
    with pytest.raises(EdgeLLMError, match="weights-00002.safetensors fails its xxh3"):
        open_artifact(Store().get("tiny", "2").folder)
    server.log.clear()
    assert main(["store", "repair", "tiny"]) == 0
    assert [s.path.rsplit("/", 1)[1] for s in server.blob_requests()] == [release_files(versions["1"])["weights-00002.safetensors"].sha256]
    for v in ("1", "2"):
        open_artifact(Store().get("tiny", v).folder)
    assert main(["rollback", "tiny"]) == 0
    assert reply("tiny") == before
