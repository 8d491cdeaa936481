"""A crafted artifact whose tensors are not what its config says (issue 29, finding 1): every checksum matches,
yet a norm, a bias, a q/k norm or the embedding is the wrong size or type, a shard is cut short, or an offset runs
past the end. Before families/tensor_specs.py the native decoder read past such a vector (a segfault in `run`,
`serve` and `update --canary`), and `verify`, `doctor` and `update` called the artifact sound. Now each surface
refuses it in one line naming the tensor, before any pointer reaches C, and the store never activates it.

Also: only files the manifest lists are read (finding 10), and the tensor checks themselves (units)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgellm.artifact.reader import open_artifact
from edgellm.cli import main
from edgellm.convert.pipeline import convert
from edgellm.errors import ArtifactError
from edgellm.kernels import native
from tests.support.artifact_craft import load_in_child, move_offset, reseal, replace_tensor, shard_of, truncate_shard
from tests.support.tiny import make_tiny

transformers = pytest.importorskip("transformers")
needs_native = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")
REPO = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def good(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny q8 artifacts the native decoder runs: Qwen2 (q/k/v biases, untied head) and Qwen3 (q/k norms)."""
    from tests.families.test_families import _make, _qwen3

    root = tmp_path_factory.mktemp("shapes")
    make_tiny(root / "qwen2-hf", "qwen2", tied=False)
    _make(root / "qwen3-hf", _qwen3)
    return {arch: convert(root / f"{arch}-hf", root / arch, quantization="q8f16_1", progress=False)
            for arch in ("qwen2", "qwen3")}


def _rows_short(folder: Path) -> None:
    from safetensors.numpy import load_file

    table = load_file(str(shard_of(folder, "model.embed_tokens.qweight")))["model.embed_tokens.qweight"]
    replace_tensor(folder, "model.embed_tokens.qweight", table[:-1])  # 8 rows of the vocabulary fewer


# name -> (model, how to break it, the tensor the refusal must name)
CASES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "short-norm": ("qwen2", lambda f: replace_tensor(f, "model.norm.weight", np.ones(1, np.float32)),
                   "model.norm.weight"),
    "short-bias": ("qwen2", lambda f: replace_tensor(f, "model.layers.1.self_attn.k_proj.bias",
                                                    np.zeros(3, np.float32)), "model.layers.1.self_attn.k_proj.bias"),
    "short-qk-norm": ("qwen3", lambda f: replace_tensor(f, "model.layers.1.self_attn.k_norm.weight",
                                                       np.ones(8, np.float32)), "model.layers.1.self_attn.k_norm.weight"),
    "embedding-rows": ("qwen2", _rows_short, "model.embed_tokens.qweight"),
    "norm-dtype": ("qwen2", lambda f: replace_tensor(f, "model.layers.0.input_layernorm.weight",
                                                    np.ones(64, np.float16)), "model.layers.0.input_layernorm.weight"),
    "truncated-shard": ("qwen2", lambda f: truncate_shard(f, "model.norm.weight", 100), "weights-00001"),
    "offset-past-end": ("qwen2", lambda f: move_offset(f, "model.norm.weight", 1 << 20), "model.norm.weight"),
}


def crafted(good: dict[str, Path], tmp_path: Path, case: str) -> tuple[Path, str]:
    arch, damage, named = CASES[case]
    folder = tmp_path / case
    shutil.copytree(good[arch], folder)
    damage(folder)
    return folder, named


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def assert_one_line_refusal(err: str, named: str) -> None:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("edgellm: error: ") and named in lines[0], err


# ---- every surface --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_verify_refuses_a_crafted_artifact(good: dict[str, Path], tmp_path: Path, case: str) -> None:
    folder, named = crafted(good, tmp_path, case)
    code, out, err = cli("verify", str(folder))
    assert code == 1 and not out
    assert_one_line_refusal(err, named)


def test_verify_passes_the_untouched_artifacts(good: dict[str, Path]) -> None:
    for folder in good.values():
        code, out, err = cli("verify", str(folder))
        assert code == 0 and out.startswith("ok: ") and not err, err


@needs_native
@pytest.mark.parametrize("case", list(CASES))
def test_native_engine_load_refuses_a_crafted_artifact(good: dict[str, Path], tmp_path: Path, case: str) -> None:
    folder, named = crafted(good, tmp_path, case)
    done = load_in_child(folder, "native")
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])  # never a signal, never a traceback
    assert named in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


@pytest.mark.parametrize("case", ["short-norm", "short-bias", "short-qk-norm"])
def test_torch_engine_load_refuses_a_crafted_artifact(good: dict[str, Path], tmp_path: Path, case: str) -> None:
    folder, named = crafted(good, tmp_path, case)
    done = load_in_child(folder, "torch")
    assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
    assert named in done.stderr, done.stderr


def test_the_untouched_artifacts_load_and_generate(good: dict[str, Path]) -> None:
    """The anchor of the two tests above: the same child, on the artifacts before they were broken, runs."""
    for folder in good.values():
        for runtime in ("native", "torch") if native.load_library() else ("torch",):
            done = load_in_child(folder, runtime)
            assert done.returncode == 0, (runtime, done.stderr[-2000:])


def test_run_refuses_a_crafted_artifact_in_one_line(good: dict[str, Path], tmp_path: Path) -> None:
    folder, named = crafted(good, tmp_path, "short-norm")
    done = subprocess.run([sys.executable, "-m", "edgellm", "run", str(folder), "t1 t2", "--raw", "--max-tokens",
                           "2", "--threads", "1"], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO)})
    assert done.returncode == 1 and not done.stdout
    assert_one_line_refusal(done.stderr, named)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_reports_the_load_refused_and_stays_up(good: dict[str, Path], tmp_path: Path) -> None:
    """`serve` loads in the background: /health says the load failed, naming the tensor, a request is answered
    503, and the process is still alive after it (it used to die on the first request)."""
    folder, named = crafted(good, tmp_path, "short-norm")
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "edgellm", "serve", str(folder), "--port", str(port),
                               "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env=os.environ | {"PYTHONPATH": str(REPO)})
    try:
        health = _health_once_loaded(port, server)
        assert health["status"] == "error" and named in health["error"], health
        body = json.dumps({"model": str(folder), "messages": [{"role": "user", "content": "t1"}], "max_tokens": 2}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", body,
                                         {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as reply:
            urllib.request.urlopen(request, timeout=60)
        assert reply.value.code == 503
        assert server.poll() is None, "the server process died"
    finally:
        server.terminate()
        server.wait(30)


def _health_once_loaded(port: int, server: subprocess.Popen[str]) -> dict:
    """/health once the background load has finished (status no longer "loading")."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert server.poll() is None, server.stderr.read() if server.stderr else ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                health = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            health = json.loads(exc.read())
        except OSError:
            time.sleep(0.2)
            continue
        if health["status"] != "loading":
            return health
        time.sleep(0.2)
    raise AssertionError("the server never finished loading")


def test_doctor_reports_a_crafted_artifact_quick_and_full(good: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    folder, named = crafted(good, tmp_path / "home" / "artifacts", "short-norm")
    from edgellm.doctor import run_checks

    for quick in (True, False):
        problems = run_checks(quick=quick).problems
        assert any(named in p and folder.name in p for p in problems), (quick, problems)


# ---- the store: never activated -----------------------------------------------------------------------------
@pytest.fixture
def store_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _publish_unchecked(artifact: Path, channel: Path, name: str, version: str, key: Path) -> None:
    """What a channel holding a crafted artifact looks like: its files and a signed index naming them (written as
    a publisher with the key could, without `edgellm publish`'s own check of the artifact)."""
    from edgellm.store.channel import INDEX_FILE, blob_path, write_index
    from edgellm.store.local import release_files

    index = channel / INDEX_FILE
    payload = json.loads(json.loads(index.read_text())["signed"])
    files = release_files(artifact)
    for member, entry in files.items():
        (channel / blob_path(entry.sha256)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(artifact / member, channel / blob_path(entry.sha256))
    release = dict(payload["models"][name]["versions"][max(payload["models"][name]["versions"])])
    release["files"] = {m: {"sha256": e.sha256, "size": e.size} for m, e in sorted(files.items())}
    payload["models"][name]["versions"][version] = release
    payload["models"][name]["latest"] = version
    write_index(channel, payload, key)


@pytest.fixture
def channel_with_crafted_v2(good: dict[str, Path], tmp_path: Path, store_home: Path) -> tuple[Path, str]:
    """A folder channel whose v1 is good and whose v2 (latest) is the short-norm artifact; v1 installed, current."""
    from edgellm.store.channel import publish
    from edgellm.store.trust import generate_keypair, trust
    from edgellm.updates.update import update

    key = tmp_path / "keys" / "release.key"
    trust(generate_keypair(key))
    channel = tmp_path / "channel"
    publish(good["qwen2"], channel, "tiny", "1", key)
    update("tiny", str(channel), say=lambda m: None)
    folder, named = crafted(good, tmp_path, "short-norm")
    _publish_unchecked(folder, channel, "tiny", "2", key)
    return channel, named


def test_update_never_activates_a_crafted_version(channel_with_crafted_v2: tuple[Path, str]) -> None:
    from edgellm.store.local import Store
    from edgellm.updates.update import update

    channel, named = channel_with_crafted_v2
    with pytest.raises(ArtifactError, match=named.replace(".", r"\.")):
        update("tiny", str(channel), say=lambda m: None)
    store = Store()
    assert store.refs("tiny").current == "1" and store.versions("tiny") == ["1"]


def test_update_with_a_canary_refuses_in_one_line(channel_with_crafted_v2: tuple[Path, str],
                                                  store_home: Path) -> None:
    """`update --canary` used to load the crafted version and crash in the canary's first decode step."""
    channel, named = channel_with_crafted_v2
    done = subprocess.run([sys.executable, "-m", "edgellm", "update", "tiny", "--channel", str(channel), "--canary",
                           "t1 t2", "--quiet"], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": str(REPO), "EDGELLM_HOME": str(store_home)})
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert_one_line_refusal(done.stderr.strip().splitlines()[-1], named)  # after the plan's line ("1 → 2: ...")


def test_store_activate_refuses_a_version_damaged_after_install(good: dict[str, Path], tmp_path: Path,
                                                                store_home: Path) -> None:
    """A version installed before this check existed (here: rewritten in place, manifest included) cannot be made
    current again: `store activate` checks its tensors first."""
    from edgellm.store.local import Store

    store = Store()
    store.add_folder(good["qwen2"], "tiny", "1")
    store.add_folder(good["qwen2"], "tiny", "2")
    store.activate("tiny", "2")
    folder = store.version_dir("tiny", "1")
    for path in folder.iterdir():  # unlink the blobs' hard links before rewriting
        data = path.read_bytes()
        path.unlink()
        path.write_bytes(data)
    replace_tensor(folder, "model.norm.weight", np.ones(1, np.float32))
    with pytest.raises(ArtifactError, match=r"model\.norm\.weight"):
        store.activate("tiny", "1")
    assert store.refs("tiny").current == "2"


# ---- only the files the manifest lists (finding 10) -------------------------------------------------------
def test_an_unlisted_chat_template_is_never_rendered(good: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "art"
    shutil.copytree(good["qwen2"], folder)
    assert "chat_template.jinja" not in open_artifact(folder).manifest.files
    (folder / "chat_template.jinja").write_text("INJECTED {{ messages[0].content }}")
    assert open_artifact(folder).chat_template is None
    code, out, err = cli("verify", str(folder))
    assert code == 0 and out.startswith("ok: ")
    assert err.strip() == "edgellm: warning: 1 file(s) not in manifest.json, never read: chat_template.jinja"


def test_a_listed_chat_template_is_read(good: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "art"
    shutil.copytree(good["qwen2"], folder)
    (folder / "chat_template.jinja").write_text("{{ messages[0].content }}")
    m = json.loads((folder / "manifest.json").read_text())
    m["files"]["chat_template.jinja"] = {"sha256": "0" * 64, "size": 0}
    (folder / "manifest.json").write_text(json.dumps(m))
    reseal(folder)
    assert open_artifact(folder).chat_template == "{{ messages[0].content }}"


# ---- the checks themselves ----------------------------------------------------------------------------------
def _specs():  # imported here, so that the surface tests above also run (and fail) on code without the module
    from edgellm.families import tensor_specs

    return tensor_specs


def test_expected_tensors_are_exactly_what_the_converter_writes(good: dict[str, Path]) -> None:
    """Independent of tensor_specs: the shard headers safetensors itself reads."""
    from safetensors import safe_open

    TensorSpec, expected_tensors = _specs().TensorSpec, _specs().expected_tensors

    for folder in good.values():
        art = open_artifact(folder)
        found = {}
        for shard in art.shard_names:
            with safe_open(str(folder / shard), "np") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    found[name] = TensorSpec(str(t.dtype), tuple(t.shape))
        assert found == expected_tensors(art.config)


def test_each_format_part_takes_its_size_from_the_format(good: dict[str, Path]) -> None:
    """q8's stored rows: N/8 groups of K/32 blocks of 8 x 34 bytes (quant/formats.py), for an untied lm_head."""
    TensorSpec, expected_tensors = _specs().TensorSpec, _specs().expected_tensors
    config = open_artifact(good["qwen2"]).config
    m = config.model
    assert expected_tensors(config)["lm_head.qweight"] == TensorSpec("uint8", (m.vocab_size // 8,
                                                                              m.hidden_size // 32 * 34 * 8))


def _config(good: dict[str, Path], **model: object):
    config = open_artifact(good["qwen2"]).config
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **model))


@pytest.mark.parametrize("field,value", [("hidden_size", 0), ("head_dim", 15), ("vocab_size", 1 << 30),
                                         ("rope_theta", float("nan")), ("rms_norm_eps", -1.0),
                                         ("query_pre_attn_scalar", -4.0), ("sliding_window", -3),
                                         ("intermediate_size", True)])
def test_config_sanity(good: dict[str, Path], field: str, value: object) -> None:
    with pytest.raises(ArtifactError, match=field):
        _specs().check_model_config(_config(good, **{field: value}).model)


@pytest.mark.parametrize("field,value", [("eos_token_id", 256), ("bos_token_id", -1), ("stop_token_ids", [3, 10**6])])
def test_special_token_ids_lie_in_the_vocabulary(good: dict[str, Path], field: str, value: object) -> None:
    from edgellm.artifact.config import ArtifactConfig

    raw = json.loads((good["qwen2"] / "edgellm-config.json").read_text())
    raw["tokenizer"][field] = value
    with pytest.raises(ArtifactError, match="outside the vocabulary"):
        ArtifactConfig.from_dict(raw)


def test_formats_must_name_every_weight_and_no_other(good: dict[str, Path]) -> None:
    config = open_artifact(good["qwen2"]).config
    formats = dict(config.quantization.formats)
    q, expected_tensors = dataclasses.replace, _specs().expected_tensors
    with pytest.raises(ArtifactError, match="lm_head"):
        expected_tensors(q(config, quantization=q(config.quantization, formats={k: v for k, v in formats.items()
                                                                                if k != "lm_head"})))
    with pytest.raises(ArtifactError, match="model.layers.9.mlp.up_proj"):
        expected_tensors(q(config, quantization=q(config.quantization,
                                                  formats=formats | {"model.layers.9.mlp.up_proj": "q8"})))
    with pytest.raises(ArtifactError, match="cannot be stored as q8"):  # K = 63: no whole blocks of 32
        expected_tensors(q(config, model=q(config.model, hidden_size=63)))


def test_unexpected_and_duplicate_tensors_are_refused(good: dict[str, Path], tmp_path: Path) -> None:
    config = open_artifact(good["qwen2"]).config
    specs = _specs().expected_tensors(config)
    extra = {"model.layers.0.self_attn.o_proj.bias": _specs().TensorSpec("float32", (64,))}
    with pytest.raises(ArtifactError, match="o_proj.bias is not one this qwen2 model reads"):
        _specs().check_tensors(config, specs | extra)
    folder = tmp_path / "dup"
    shutil.copytree(good["qwen2"], folder)
    from safetensors.numpy import load_file, save_file

    shard = shard_of(folder, "model.layers.0.input_layernorm.weight")
    other = shard_of(folder, "model.norm.weight")
    tensors = load_file(str(other)) | {"model.layers.0.input_layernorm.weight": np.ones(64, np.float32)}
    save_file(tensors, str(other), metadata={"format": "pt"})
    reseal(folder)
    with pytest.raises(ArtifactError, match="in two weight shards") as refused:
        open_artifact(folder)
    assert shard.name in str(refused.value) and other.name in str(refused.value)


@pytest.mark.parametrize("arrays", [True, False])
def test_weights_are_checked_when_mapped_too(good: dict[str, Path], tmp_path: Path, arrays: bool) -> None:
    """A shard swapped after the artifact was opened (and checked) is caught when the weights are mapped: the
    views are built from the headers that mapping checked."""
    folder = tmp_path / "art"
    shutil.copytree(good["qwen2"], folder)
    art = open_artifact(folder, verify=False)
    replace_tensor(folder, "model.norm.weight", np.ones(1, np.float32))
    with pytest.raises(ArtifactError, match=r"model\.norm\.weight is float32 \[1\]"):
        art.weights(arrays=arrays)


@pytest.mark.parametrize("runtime", [pytest.param("native", marks=needs_native), "torch"])
def test_each_model_checks_the_arrays_it_is_handed(good: dict[str, Path], runtime: str) -> None:
    """The last line before C: NativeModel and torch's Transformer (whose native decode step reads the same
    arrays) refuse a short vector themselves, whoever built the weights."""
    from edgellm.models.native_model import NativeModel
    from edgellm.models.transformer import Transformer

    art = open_artifact(good["qwen2"])
    weights = dict(art.weights(arrays=runtime == "native"))
    name = "model.layers.1.post_attention_layernorm.weight"
    weights[name] = weights[name][:3]
    with pytest.raises(ArtifactError, match=rf"{name} is float32 \[3\], expected float32 \[64\]"):
        if runtime == "native":
            NativeModel(art.config, weights, threads=1, window=16)
        else:
            Transformer(art.config, weights)


@needs_native
def test_the_c_check_refuses_a_description_without_its_final_norm(good: dict[str, Path]) -> None:
    """el_decoder_check, the C side's own cheap check: a NULL final norm (which it once let through) is refused."""
    import ctypes

    from edgellm.models.native_model import NativeModel

    art = open_artifact(good["qwen2"])
    decoder = NativeModel(art.config, art.weights(arrays=True), threads=1, window=16).native
    lib = native.load_library()
    description = type(decoder._model).from_buffer_copy(decoder._model)
    assert lib.el_decoder_check(ctypes.byref(description)) == 0
    description.final_norm = None
    assert lib.el_decoder_check(ctypes.byref(description)) != 0
