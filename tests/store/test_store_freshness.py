"""Update security (issue 29): replayed or expired indexes, downgrades, keys scoped to model names and pinned,
stalled channels (a FIFO, a trickling server) that neither hang `update` nor block `rollback`, absolute
folder channels.

v1, v2, v3 are the same tiny random model converted with different per-layer overrides, so every version
has a shard the others lack (an update always downloads something).
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from edgellm.cli import main
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.store.channel import INDEX_FILE, ChannelError, blob_path, publish, refresh, write_index
from edgellm.store.local import Store, release_files
from edgellm.store.trust import SignatureError, generate_keypair, load_private_key, read_key_argument, sign, trust
from edgellm.updates.repair import repair
from edgellm.updates.update import update
from tests.support.channel_server import ChannelServer
from tests.store.test_store import home, key, server  # noqa: F401  (fixtures shared with the store tests)
from tests.support.tiny import make_tiny

LAYER = {n: [f"model.layers.{n}.{m}" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
         for n in (0, 1)}


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("versions")
    make_tiny(root / "hf", "llama", tied=True)
    recipes = {"1": {}, "2": dict.fromkeys(LAYER[1], "q8"), "3": dict.fromkeys(LAYER[0], "q8")}
    return {v: convert(root / "hf", root / f"v{v}", quantization="q4f16_1", overrides=o, progress=False)
            for v, o in recipes.items()}


def quiet(_: str) -> None:
    pass


def state(home: Path, *, record: bool = True) -> dict[str, Any]:
    """What a refused update must leave as it was: every refs.json, the versions and (unless the index was
    genuinely newer, so rightly remembered) the freshness record."""
    store = home / "store"
    files = [p for p in sorted(store.rglob("*.json")) if record or p.name != "channels.json"]
    return {str(p.relative_to(store)): p.read_bytes() for p in files} | \
        {"versions": {n: Store().versions(n) for n in Store().names()}}


def signed_as_is(channel: Path, payload: dict[str, Any], key_path: Path) -> None:
    """Sign ``payload`` exactly as given (no new sequence or expiry): an old or hand-made index."""
    private = load_private_key(key_path)
    text = json.dumps(payload, indent=1, sort_keys=True)
    public = (key_path.with_name(key_path.name + ".pub")).read_text().strip()
    outer = {"format": "edgellm-channel/1", "key": public, "signature": sign(private, text.encode()), "signed": text}
    (channel / INDEX_FILE).write_text(json.dumps(outer))


def payload_of(channel: Path) -> dict[str, Any]:
    return json.loads(json.loads((channel / INDEX_FILE).read_text())["signed"])


# ---- freshness ------------------------------------------------------------------------------------------------
def test_replayed_older_index_is_refused_and_nothing_changes(versions: dict[str, Path], home: Path, key: Path,
                                                             server: ChannelServer) -> None:
    publish(versions["1"], server.root, "tiny", "1", key)
    update("tiny", server.url, say=quiet)
    old_index = (server.root / INDEX_FILE).read_bytes()  # genuinely signed, v1 latest
    publish(versions["2"], server.root, "tiny", "2", key)
    update("tiny", server.url, say=quiet)
    before = state(home)
    (server.root / INDEX_FILE).write_bytes(old_index)  # a mirror replays the older index
    server.log.clear()
    with pytest.raises(ChannelError, match=r"older than one seen before \(sequence 1, seen sequence 2\)"):
        update("tiny", server.url, say=quiet)
    assert state(home) == before and Store().refs("tiny").current == "2"
    assert server.blob_requests() == []


def test_a_newer_index_pointing_back_is_a_downgrade_refused_unless_asked(
        versions: dict[str, Path], home: Path, key: Path, server: ChannelServer,
        capsys: pytest.CaptureFixture[str]) -> None:
    publish(versions["1"], server.root, "tiny", "1", key)
    publish(versions["2"], server.root, "tiny", "2", key)
    update("tiny", server.url, say=quiet)
    payload = payload_of(server.root)
    payload["models"]["tiny"]["latest"] = "1"  # freshly signed, but its latest was published before 2
    write_index(server.root, payload, key)
    before = state(home, record=False)
    with pytest.raises(ChannelError, match="latest tiny is 1, published before the current 2: refused"):
        update("tiny", server.url, say=quiet)
    assert state(home, record=False) == before
    capsys.readouterr()
    assert main(["update", "tiny", "--version", "1", "--quiet"]) == 0
    assert "installing 1, published before the current 2, as --version asks" in capsys.readouterr().err
    refs = Store().refs("tiny")
    assert (refs.current, refs.previous) == ("1", "2")
    assert main(["update", "tiny", "--quiet"]) == 0  # latest is 1 = current: nothing to refuse
    assert main(["store", "activate", "tiny", "2"]) == 0  # a local switch is the user's own choice
    assert main(["update", "tiny", "--quiet"]) == 1
    assert "published before the current 2" in capsys.readouterr().err


def test_expired_index_is_refused_in_one_line(versions: dict[str, Path], home: Path, key: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    channel = tmp_path / "channel"
    assert main(["publish", str(versions["1"]), "--channel", str(channel), "--version", "1", "--key", str(key),
                 "--name", "tiny", "--expires", "2"]) == 0
    payload = payload_of(channel)
    published = time.mktime(time.strptime(payload["updated"], "%Y-%m-%dT%H:%M:%SZ"))
    expires = time.mktime(time.strptime(payload["expires"], "%Y-%m-%dT%H:%M:%SZ"))
    assert expires - published == 2 * 86400
    payload["expires"] = "2020-01-01T00:00:00Z"  # a frozen channel, signed long ago
    signed_as_is(channel, payload, key)
    capsys.readouterr()
    assert main(["update", "tiny", "--channel", str(channel)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expired at 2020-01-01T00:00:00Z" in err[0], err
    assert "tiny" not in Store().names()
    refresh(channel, key, expires_days=1)  # the publisher re-signs: accepted again
    assert payload_of(channel)["sequence"] == payload["sequence"] + 1
    assert payload_of(channel)["models"] == payload["models"]
    assert main(["update", "tiny", "--channel", str(channel), "--quiet"]) == 0


def test_index_without_sequence_is_accepted_with_a_warning_only_until_a_sequenced_one_is_seen(
        versions: dict[str, Path], home: Path, key: Path, tmp_path: Path) -> None:
    channel = tmp_path / "channel"
    publish(versions["1"], channel, "tiny", "1", key)
    legacy = payload_of(channel)
    for field in ("id", "sequence", "expires"):  # what an edgellm before this change wrote
        del legacy[field]
    del legacy["models"]["tiny"]["versions"]["1"]["sequence"]
    signed_as_is(channel, legacy, key)
    said: list[str] = []
    update("tiny", str(channel), say=said.append)
    assert any(m.startswith("warning: the channel index") and "no sequence or expiry" in m for m in said)
    publish(versions["2"], channel, "tiny", "2", key)  # the publisher upgrades: the index gets its fields
    update("tiny", str(channel), say=quiet)
    signed_as_is(channel, legacy, key)  # the old index replayed
    with pytest.raises(ChannelError, match="has no sequence or expiry, but key .* has signed indexes that do"):
        update("tiny", str(channel), say=quiet)
    assert Store().refs("tiny").current == "2"


# ---- key scope and pinning -------------------------------------------------------------------------------------
def test_a_key_trusted_for_other_models_cannot_publish_this_one(versions: dict[str, Path], home: Path,
                                                                tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    a_key, b_key = tmp_path / "a.key", tmp_path / "b.key"
    generate_keypair(a_key)
    generate_keypair(b_key)
    assert main(["trust", "add", f"{a_key}.pub", "--models", "tiny"]) == 0
    assert main(["trust", "add", f"{b_key}.pub", "--models", "b-*", "other"]) == 0
    assert "models b-*,other" in (capsys.readouterr(), main(["trust", "list"]), capsys.readouterr().out)[2]
    publish(versions["1"], tmp_path / "a", "tiny", "1", a_key)
    update("tiny", str(tmp_path / "a"), say=quiet)
    publish(versions["2"], tmp_path / "b", "tiny", "9", b_key)  # B's key publishes "tiny@9"
    publish(versions["2"], tmp_path / "b", "b-model", "1", b_key)
    before = state(home)
    with pytest.raises(SignatureError, match=r"trusted only for models b-\*, other, not 'tiny': refused"):
        update("tiny", str(tmp_path / "b"), say=quiet)
    assert state(home) == before
    update("b-model", str(tmp_path / "b"), say=quiet)  # what it is trusted for, it may publish
    assert Store().refs("b-model").current == "1"
    with pytest.raises(SignatureError, match="at least one"):
        trust(read_key_argument(f"{b_key}.pub"), models=())
    with pytest.raises(SignatureError, match="invalid model pattern 'a/b'"):
        trust(read_key_argument(f"{b_key}.pub"), models=("a/b",))


def test_a_model_is_pinned_to_the_key_of_its_first_channel_install(versions: dict[str, Path], home: Path,
                                                                   tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    first, second = tmp_path / "first.key", tmp_path / "second.key"
    trust(generate_keypair(first))
    trust(generate_keypair(second))  # both trusted for every model
    publish(versions["1"], tmp_path / "c1", "tiny", "1", first)
    update("tiny", str(tmp_path / "c1"), say=quiet)
    publish(versions["2"], tmp_path / "c2", "tiny", "2", second)
    before = state(home)
    with pytest.raises(SignatureError, match="tiny is pinned to key .* but this channel is signed by"):
        update("tiny", str(tmp_path / "c2"), say=quiet)
    publish(versions["2"], tmp_path / "c3", "tiny", "1", second)  # "1" with other files: a repair would swap them
    with pytest.raises(SignatureError, match="tiny is pinned to key"):
        repair("tiny", str(tmp_path / "c3"), say=quiet)
    assert state(home) == before
    capsys.readouterr()
    assert main(["trust", "pin", "tiny", f"{second}.pub"]) == 0  # the user re-trusts explicitly
    assert "tiny: pinned to key" in capsys.readouterr().out
    update("tiny", str(tmp_path / "c2"), say=quiet)
    assert Store().refs("tiny").current == "2"
    with pytest.raises(SignatureError, match="pinned to key"):
        update("tiny", str(tmp_path / "c1"), version="1", say=quiet)


# ---- stalled channels ------------------------------------------------------------------------------------------
def in_thread(fn: Callable[[], object]) -> tuple[threading.Thread, list[BaseException | object]]:
    """Run ``fn`` in a daemon thread; the list gets its result or exception."""
    out: list[BaseException | object] = []

    def body() -> None:
        try:
            out.append(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out.append(exc)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    return thread, out


@pytest.mark.parametrize("which", ["index", "shard"])
def test_a_fifo_in_a_folder_channel_fails_the_update(versions: dict[str, Path], home: Path, key: Path,
                                                     tmp_path: Path, which: str) -> None:
    channel = tmp_path / "channel"
    publish(versions["1"], channel, "tiny", "1", key)
    update("tiny", str(channel), say=quiet)
    publish(versions["2"], channel, "tiny", "2", key)
    if which == "index":
        target = channel / INDEX_FILE
    else:
        target = channel / blob_path(release_files(versions["2"])["weights-00003.safetensors"].sha256)
    target.unlink()
    os.mkfifo(target)  # nobody ever writes to it
    thread, out = in_thread(lambda: update("tiny", str(channel), say=quiet, timeout_s=30))
    thread.join(60)
    if thread.is_alive():  # unblock the reader before failing
        os.close(os.open(target, os.O_WRONLY | os.O_NONBLOCK))
    assert not thread.is_alive(), "update hung on a FIFO"
    assert isinstance(out[0], ChannelError) and "is not a regular file" in str(out[0])
    assert Store().refs("tiny").current == "1"


def test_a_trickling_server_fails_the_update_at_its_deadline(versions: dict[str, Path], home: Path, key: Path,
                                                             server: ChannelServer) -> None:
    publish(versions["1"], server.root, "tiny", "1", key)
    update("tiny", server.url, say=quiet)
    publish(versions["2"], server.root, "tiny", "2", key)
    server.trickle = "blobs/"  # one byte every 0.2 s: every read returns, none ever finishes the file
    thread, out = in_thread(lambda: update("tiny", server.url, say=quiet, timeout_s=2))
    thread.join(60)
    server.stop_trickle.set()
    assert not thread.is_alive(), "update hung on a trickling server"
    assert isinstance(out[0], ChannelError), out
    assert "stopped at the 2 s deadline" in str(out[0]) and "kept, run the update again to resume" in str(out[0])
    assert Store().refs("tiny").current == "1"
    server.trickle = INDEX_FILE  # the index itself trickles
    server.stop_trickle.clear()
    thread, out = in_thread(lambda: update("tiny", server.url, say=quiet, timeout_s=2))
    thread.join(60)
    server.stop_trickle.set()
    assert not thread.is_alive() and isinstance(out[0], ChannelError), out
    assert "the channel index did not arrive within the 2 s deadline" in str(out[0])
    server.trickle = None
    update("tiny", server.url, say=quiet)  # the stall is over: the kept part resumes
    assert Store().refs("tiny").current == "2"


def test_rollback_and_activate_complete_while_an_update_is_stalled(versions: dict[str, Path], home: Path,
                                                                   key: Path, server: ChannelServer,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    for v in ("1", "2"):
        publish(versions[v], server.root, "tiny", v, key)
        update("tiny", server.url, say=quiet)
    publish(versions["3"], server.root, "tiny", "3", key)
    server.trickle = "blobs/"
    stalled, out = in_thread(lambda: update("tiny", server.url, say=quiet, timeout_s=300))
    assert server.trickling.wait(60)  # the update is now downloading, stalled
    try:
        recovery, done = in_thread(lambda: (main(["rollback", "tiny"]), main(["store", "activate", "tiny", "2"]),
                                            main(["rollback", "tiny"])))
        recovery.join(60)
        assert not recovery.is_alive(), "rollback waited for the stalled download"
        assert done == [(0, 0, 0)]
        assert (Store().refs("tiny").current, Store().refs("tiny").previous) == ("1", "2")
        with pytest.raises(EdgeLLMError, match="an update or repair is downloading into the store"):
            Store().gc()  # it would delete the download in flight
    finally:
        server.stop_trickle.set()
        stalled.join(60)
    assert isinstance(out[0], ChannelError) and "interrupted at" in str(out[0])
    assert Store().refs("tiny").current == "1"
    server.trickle = None
    update("tiny", server.url, say=quiet)  # the switch after a rollback: previous is what was current then
    refs = Store().refs("tiny")
    assert (refs.current, refs.previous) == ("3", "1")


# ---- folder channels are remembered absolute --------------------------------------------------------------------
def test_a_relative_folder_channel_is_remembered_absolute(versions: dict[str, Path], home: Path, key: Path,
                                                          tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "work").mkdir()
    monkeypatch.chdir(tmp_path / "work")
    publish(versions["1"], Path("channel"), "tiny", "1", key)
    update("tiny", "channel", say=quiet)
    assert Store().refs("tiny").channel == str(tmp_path / "work" / "channel")
    publish(versions["2"], Path("channel"), "tiny", "2", key)
    monkeypatch.chdir(tmp_path)  # elsewhere, the remembered channel is still the same folder
    update("tiny", say=quiet)
    assert Store().refs("tiny").current == "2"
    refs_file = Store().models / "tiny" / "refs.json"
    raw = json.loads(refs_file.read_text())
    raw["channel"] = "channel"  # what an older edgellm remembered
    refs_file.write_text(json.dumps(raw))
    with pytest.raises(ChannelError, match="relative path 'channel'; pass --channel again"):
        update("tiny", say=quiet)


def test_error_paths_are_one_line(versions: dict[str, Path], home: Path, key: Path, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    channel = tmp_path / "channel"
    publish(versions["1"], channel, "tiny", "1", key)

    def one_line(argv: list[str], expected: str) -> None:
        capsys.readouterr()
        assert main(argv) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("edgellm: error: ") and expected in err[0], err

    one_line(["update", "tiny", "--channel", str(channel), "--timeout", "0"], "--timeout takes 0 < SECONDS")
    one_line(["refresh-channel", "--channel", str(channel), "--key", str(key), "--expires", "0"],
             "--expires takes 0 < DAYS <= 3660")
    one_line(["refresh-channel", "--channel", str(tmp_path / "none"), "--key", str(key)], "has no index.json")
    other = tmp_path / "other.key"
    generate_keypair(other)
    one_line(["trust", "pin", "tiny", f"{other}.pub"], "is not trusted for tiny")
    for bad in ({"sequence": "2"}, {"expires": "tomorrow"}, {"id": None}):
        payload = payload_of(channel)
        payload.update(bad)
        signed_as_is(channel, {k: v for k, v in payload.items() if v is not None}, key)
        one_line(["update", "tiny", "--channel", str(channel)], "has a malformed id, sequence or expires")
    refresh(channel, key)
    (home / "store").mkdir(parents=True)
    (home / "store" / "channels.json").write_text("{not json")
    one_line(["update", "tiny", "--channel", str(channel)], "channels.json is unreadable")
    assert "tiny" not in Store().names()
