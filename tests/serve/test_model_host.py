"""Several models in one server (serve/model_host.py): load on first use by name, unload after keep-alive idle
(driven by a fake clock, never by sleeping), the memory budget with least-recently-used eviction, lease files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi")
transformers = pytest.importorskip("transformers")

from edgellm import leases  # noqa: E402
from edgellm.artifact.config import ArtifactConfig  # noqa: E402
from edgellm.artifact.reader import open_artifact  # noqa: E402
from edgellm.errors import MemoryBudgetError, ModelNotFoundError  # noqa: E402
from edgellm.generation import GenerationParams  # noqa: E402
from edgellm.runtime.engine import Engine  # noqa: E402
from edgellm.runtime.memory import estimate_memory  # noqa: E402
from edgellm.serve.metrics import Metrics  # noqa: E402
from edgellm.serve.model_host import KeepAlive, ModelHost, parse_keep_alive  # noqa: E402
from tests.support.tiny_chat import _byte_tokenizer  # noqa: E402
from tests.support.tiny import VOCAB  # noqa: E402


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EDGELLM_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _wide_model(root: Path) -> Path:
    """A random llama wide enough (about 70 MB of f32 weights) for its unload to show in the process's RSS."""
    import torch

    from edgellm.convert.pipeline import convert

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=2048, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128,
                                   tie_word_embeddings=True, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    transformers.LlamaForCausalLM(cfg).eval().save_pretrained(root / "hf", safe_serialization=True)
    _byte_tokenizer(root / "hf")
    return convert(root / "hf", root / "art", quantization="q0f32", progress=False)


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _wide_model(tmp_path_factory.mktemp("wide"))


def _host(folders: dict[str, Path], clock: Clock, **kw: Any) -> ModelHost:
    def locate(name: str) -> tuple[Path, int]:
        if name not in folders:
            raise ModelNotFoundError(f"no model {name!r}")
        return folders[name], estimate_memory(ArtifactConfig.read(folders[name])).total_bytes

    def open_model(name: str, folder: Path) -> Engine:
        return Engine(open_artifact(folder), threads=1, huge_pages="off")

    return ModelHost(locate, open_model, Metrics(), max_queue=2, timeout_s=60, clock=clock, **kw)


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_keep_alive_parsing() -> None:
    assert parse_keep_alive(30) == KeepAlive(30.0)
    assert parse_keep_alive("5m") == KeepAlive(300.0)
    assert parse_keep_alive("1h30m") == KeepAlive(5400.0)
    assert parse_keep_alive("250ms") == KeepAlive(0.25)
    assert parse_keep_alive("0") == KeepAlive(0.0)
    assert parse_keep_alive(-1) == KeepAlive(None) and parse_keep_alive("-1m") == KeepAlive(None)
    for bad in ("5 minutes", "", "m", "1x", True, [1], float("nan")):
        with pytest.raises(ValueError):
            parse_keep_alive(bad)


def idle_unload_rss(wide: Path) -> dict[str, int]:
    """Load, use, keep-alive, reap: the RSS at each step and the weights' size (run in a fresh process)."""
    clock = Clock()
    host = _host({"wide": wide}, clock, keep_alive=KeepAlive(120.0))
    out = {"weights": estimate_memory(ArtifactConfig.read(wide)).weights_bytes, "before": _rss()}
    resident = host.load("wide")
    resident.engine.generate("hello", GenerationParams(max_tokens=2, temperature=0))  # touches every weight
    host.release(resident)
    del resident
    out["loaded"] = _rss()
    assert [r.name for r in host.residents()] == ["wide"]
    assert leases.holder(wide) is not None and leases.holder(wide).pid == os.getpid()
    clock.now += 119
    assert host.reap() == [] and host.find("wide") is not None
    clock.now += 2
    assert host.reap() == ["wide"]
    assert host.find("wide") is None and leases.holder(wide) is None
    out["after"] = _rss()
    return out


def test_idle_unload_returns_the_memory(wide: Path) -> None:
    """Loaded and used, the model adds its weights to the RSS; after its keep-alive the reaper unloads it and
    the RSS falls back by most of them. Measured in a fresh process: in the test run's own, memory that earlier
    tests freed is reused and a load need not grow the RSS at all."""
    code = ("import json, sys; from pathlib import Path; from tests.serve.test_model_host import idle_unload_rss; "
            "print(json.dumps(idle_unload_rss(Path(sys.argv[1]))))")
    proc = subprocess.run([sys.executable, "-c", code, str(wide)], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    rss = json.loads(proc.stdout.strip().splitlines()[-1])
    assert rss["loaded"] - rss["before"] > rss["weights"] * 0.8, rss
    assert rss["loaded"] - rss["after"] > rss["weights"] * 0.8, rss


def test_keep_alive_zero_and_negative(wide: Path) -> None:
    clock = Clock()
    host = _host({"wide": wide}, clock)
    resident = host.load("wide", KeepAlive(None))
    host.release(resident)
    clock.now += 10 ** 9
    assert host.reap() == [] and host.find("wide") is not None  # negative: kept
    resident = host.load("wide")
    host.release(resident, KeepAlive(0.0))
    assert host.find("wide") is None  # 0: unloaded as the request ends, no reaper needed


def test_default_keep_alive_is_five_minutes(wide: Path) -> None:
    clock = Clock()
    host = _host({"wide": wide}, clock)
    host.release(host.load("wide"))
    clock.now += 299
    assert host.reap() == []
    clock.now += 2
    assert host.reap() == ["wide"]


def test_a_busy_model_is_never_unloaded(wide: Path) -> None:
    clock = Clock()
    host = _host({"wide": wide}, clock, keep_alive=KeepAlive(1.0))
    resident = host.load("wide")  # held by a request
    clock.now += 100
    assert host.reap() == [] and host.find("wide") is not None
    host.release(resident)
    clock.now += 2
    assert host.reap() == ["wide"]


def test_budget_evicts_the_least_recently_used(wide: Path, tmp_path: Path) -> None:
    copies = {name: Path(shutil.copytree(wide, tmp_path / name)) for name in ("a", "b", "c")}
    need = estimate_memory(ArtifactConfig.read(wide)).total_bytes
    clock = Clock()
    host = _host(copies, clock, budget=2 * need + need // 2)  # two fit, not three
    for name in ("a", "b"):
        host.release(host.load(name))
        clock.now += 1
    host.release(host.load("a"))  # a is now the most recently used
    clock.now += 1
    host.release(host.load("c"))
    assert sorted(r.name for r in host.residents()) == ["a", "c"]  # b, the least recently used, made room
    busy_a, busy_c = host.load("a"), host.load("c")
    with pytest.raises(MemoryBudgetError) as err:
        host.load("b")
    assert "busy" in str(err.value) and "a (" in str(err.value)
    host.release(busy_a)
    host.release(busy_c)
    with pytest.raises(ModelNotFoundError):
        host.load("nope")


def test_a_crashed_servers_lease_blocks_nothing(tmp_path: Path, home: Path) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    leases.leases_dir().mkdir(parents=True)
    stale = leases.leases_dir() / f"{pid}-0000.json"
    stale.write_text(json.dumps({"pid": pid, "started": "1", "model": "m", "folder": str(folder.resolve()),
                                 "expires_at": None}))
    assert leases.holder(folder) is None and not stale.exists()  # the stale lease is cleared on the way
    reused = leases.leases_dir() / f"{os.getpid()}-1111.json"  # our pid, but another process's start time
    reused.write_text(json.dumps({"pid": os.getpid(), "started": "1", "model": "m",
                                  "folder": str(folder.resolve()), "expires_at": None}))
    assert leases.holder(folder) is None
    leases.take("m", folder, None)
    assert leases.holder(folder).model == "m"
    leases.release(folder)
    assert leases.holder(folder) is None
