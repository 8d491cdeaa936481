"""The memory planner: a table of budgets reaching each step of the degradation chain, and the refusal."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from edgellm.artifact.config import ArtifactConfig
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError, MemoryBudgetError
from edgellm.runtime.engine import Engine
from edgellm.runtime.memory import estimate_memory
from edgellm.runtime.planner import available_memory, default_budget, plan_memory, with_scheme
from tests.support.tiny import make_tiny


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("planner")
    make_tiny(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "art", quantization="q0f32", progress=False)


@pytest.fixture(scope="module")
def config(artifact: Path) -> ArtifactConfig:
    return ArtifactConfig.read(artifact)


def small_model(config: ArtifactConfig) -> ArtifactConfig:
    """A one-layer model of the same family: what the chain's last step switches to."""
    return with_scheme(dataclasses.replace(config, model=dataclasses.replace(config.model, num_hidden_layers=1)),
                       "q4f16_1")


def total(cfg: ArtifactConfig, window: int, kv: str = "f32") -> int:
    return estimate_memory(cfg, window, kv_cache=kv).total_bytes


def plan(config: ArtifactConfig, budget: int, degrade: bool = True):
    return plan_memory(config, "tiny", budget=budget, degrade=degrade, recompile_from="tiny-catalog",
                       smaller_models=[("small", small_model(config))], min_context=64)


def test_each_step_of_the_chain_is_reached(config: ArtifactConfig) -> None:
    assert config.context_window == 256
    floor_f32 = total(config, 64)
    q8_fits = [c for c in (256, 128, 64) if total(config, c, "q8") < floor_f32]
    assert q8_fits, "q8 KV must save memory over the shortest float32 context"
    q4 = with_scheme(config, "q4f16_1")
    small = small_model(config)
    assert total(q4, 64, "q8") < total(config, 64, "q8") and total(small, 64, "q8") < total(q4, 64, "q8")
    table = [  # (budget, step, context, kv, model)
        (total(config, 256), "requested", 256, "f32", "tiny"),
        (total(config, 128), "context", 128, "f32", "tiny"),
        (total(config, 64), "context", 64, "f32", "tiny"),
        (total(config, q8_fits[0], "q8"), "kv", q8_fits[0], "q8", "tiny"),
        (total(q4, 64, "q8"), "scheme", None, "q8", "tiny-catalog"),
        (total(small, 64, "q8"), "model", 64, "q8", "small"),
    ]
    for budget, step, context, kv, model in table:
        chosen = plan(config, budget).chosen
        assert chosen is not None and chosen.step == step, (budget, step)
        assert chosen.total_bytes <= budget and chosen.kv_cache == kv and chosen.model == model
        if context is not None:
            assert chosen.context_window == context
    scheme = plan(config, total(q4, 64, "q8")).chosen
    assert scheme is not None and scheme.quantization != "q0f32"
    assert scheme.estimate.weights_bytes < estimate_memory(config, 256).weights_bytes


def test_the_message_names_the_need_the_budget_and_the_step_taken(config: ArtifactConfig) -> None:
    budget = total(config, 128)
    p = plan(config, budget)
    assert p.degraded and p.message().startswith(
        f"memory: {total(config, 256) / 2**20:.0f} MiB needed > {budget / 2**20:.0f} MiB budget (--memory-budget); "
        "using context 128: ")
    assert "(taken)" in "\n".join(p.chain()) and p.as_dict()["chosen"]["context_window"] == 128
    fits = plan(config, total(config, 256))
    assert not fits.degraded and fits.chosen is fits.requested and "<=" in fits.message()


def test_without_degrade_the_refusal_lists_what_would_fit(config: ArtifactConfig) -> None:
    p = plan(config, total(config, 64), degrade=False)
    assert p.chosen is None
    text = p.message()
    assert "would fit: context 64 (--context-window 64)" in text and "--kv-cache q8" in text
    assert "-q q" in text and "small" in text and text.endswith("pass --degrade to take the first")
    nothing = plan(config, 1)
    assert nothing.chosen is None and nothing.message().endswith("no step of the degradation chain fits")


def test_engine_load_degrades_or_refuses(artifact: Path, config: ArtifactConfig) -> None:
    budget = total(config, 256, "q8")  # the tiny window is under the planner's 512-token floor: q8 KV is the step
    engine = Engine.load(artifact, memory_budget=budget, degrade=True, threads=1, progress=False)
    assert engine.kv_cache == "q8" and engine.cache.kind == "q8" and engine.context_window == 256
    assert engine.plan is not None and engine.plan.degraded and engine.plan.chosen.step == "kv"
    with pytest.raises(MemoryBudgetError, match=r"would fit: q8 KV \(--kv-cache q8\).*pass --degrade"):
        Engine.load(artifact, memory_budget=budget, threads=1, progress=False)
    with pytest.raises(EdgeLLMError, match=r"context window 1000 is outside 1\.\.256"):
        Engine.load(artifact, context_window=1000, memory_budget=1, degrade=True, progress=False)
    roomy = Engine.load(artifact, memory_budget=total(config, 256), threads=1, progress=False)
    assert roomy.kv_cache == "f32" and roomy.plan is not None and not roomy.plan.degraded


def test_default_budget_is_the_available_memory_less_a_margin() -> None:
    available = available_memory()
    if available is None:
        pytest.skip("this platform reports no available memory")
    budget, source = default_budget()
    assert budget is not None and 0 <= budget < available[0] and "margin" in source


def test_the_tokenizer_estimate_is_what_tokenizers_holds() -> None:
    """The estimate's tokenizer share against the resident memory a parsed tokenizer.json adds, measured in a fresh
    process (SmolLM2's 49,152 entries), within a quarter."""
    import json
    import subprocess
    import sys

    from edgellm.artifact.reader import open_artifact
    from edgellm.resolve import resolve_model

    art = open_artifact(resolve_model("smollm2-135m", progress=False), verify=False)
    script = f"""
from edgellm.session.allocator import return_freed_memory
from edgellm.tokenizer import Tokenizer
def rss():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) * 1024
return_freed_memory()
before = rss()
tokenizer = Tokenizer.from_file({str(art.tokenizer_path)!r})
return_freed_memory()
print(rss() - before)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    measured = int(done.stdout.split()[-1])
    estimate = estimate_memory(art.config).tokenizer_bytes
    assert estimate == 300 * art.config.model.vocab_size
    assert 0.75 * measured <= estimate <= 1.25 * measured, (estimate, measured)
    assert json.dumps(estimate_memory(art.config).as_dict())  # the info --json field is plain data


_MEASURE_PLAN = """
import json, sys
from edgellm.generation import GenerationParams
from edgellm.session.allocator import return_freed_memory
from edgellm.runtime.engine import Engine

def rss(field):
    return int(open("/proc/self/status").read().split(field + ":")[1].split()[0]) * 1024

path, budget, window = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
return_freed_memory()
before = rss("VmRSS")
engine = Engine.load(path, memory_budget=budget, degrade=True, threads=1, context_window=window, progress=False,
                     huge_pages="off")
prompt = [(7 * i) % 4000 + 100 for i in range(engine.context_window - 9)]
engine.generate(prompt, GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True))
chosen = engine.plan.chosen
print(json.dumps({"peak": rss("VmHWM") - before, "planned": chosen.total_bytes, "step": chosen.step,
                  "kv": chosen.kv_cache, "window": engine.context_window}))
"""


@pytest.mark.parametrize("step", ["requested", "context", "kv"])
def test_the_chosen_plan_holds_in_measured_memory(smollm2_gguf: Path, step: str) -> None:
    """The planner's promise, judged by the process's own peak resident memory (not by the estimate it uses): SmolLM2
    loaded under a budget that forces a step, its window filled, never takes more than the plan said — and the plan
    is not padded either (the measured peak is at least half of it)."""
    import json
    import subprocess
    import sys

    from edgellm.resolve import resolve_model

    path = resolve_model("smollm2-135m", progress=False)
    cfg = ArtifactConfig.read(path)
    window = 2048
    kv = cfg.kv_cache
    budget = {"requested": total(cfg, window, kv), "context": total(cfg, window // 2, kv),
              "kv": total(cfg, 512, "q8")}[step] + 2**20
    done = subprocess.run([sys.executable, "-c", _MEASURE_PLAN, str(path), str(budget), str(window)],
                          capture_output=True, text=True, timeout=600, check=True)
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["step"] == step and got["planned"] <= budget
    assert got["peak"] <= got["planned"], got
    assert got["peak"] >= got["planned"] / 2, got


def test_predicting_an_uncompiled_gguf_loads_no_torch(smollm2_gguf: Path) -> None:
    """A budgeted load with `degrade` predicts the other catalog models from their pulled GGUFs' headers where none is
    compiled at its default scheme; that must not import the converter's torch (~200 MB of resident memory the plan
    does not count: the measured-peak test above failed by that much once other sources were pulled)."""
    import subprocess
    import sys

    code = ("import sys; from pathlib import Path; from edgellm.runtime.planner import _gguf_config; "
            f"cfg = _gguf_config(Path({str(smollm2_gguf)!r}), 'smollm2-135m', 'source'); "
            "print(sorted(set(cfg.quantization.formats.values())), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.split() == ["['q4',", "'q8']", "False"], done.stdout
