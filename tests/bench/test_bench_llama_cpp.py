"""edgellm vs llama.cpp in one `edgellm bench` run (needs the optional `compare` extra)."""

from __future__ import annotations

import pytest

pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra `compare`: "
                                        "pip install -e '.[compare]', compiles for ~25 min on two cores)")

from edgellm.bench.runner import BenchConfig, headline, run_bench  # noqa: E402


def test_side_by_side_alternating_with_ratios(smollm2_gguf) -> None:
    config = BenchConfig(models=["smollm2-135m"], threads=[1], backends=["edgellm", "llama.cpp"], prompt_tokens=16,
                         gen_tokens=6, warmup=1, runs=3, depths=[0, 16])
    report = run_bench(config, say=lambda m: None)
    cells = report["cells"]
    assert [(c["backend"], c["depth"]) for c in cells] == [("edgellm", 0), ("llama.cpp", 0), ("edgellm", 16),
                                                            ("llama.cpp", 16)]
    llama = cells[1]
    assert llama["artifact"]["path"] == str(smollm2_gguf) and llama["artifact"]["format"] == "GGUF (source file)"
    for cell in cells:
        assert len(cell["samples"]) == 4 and sum(s["counted"] for s in cell["samples"]) == 3
        assert all(len(s["token_times_s"]) == 6 for s in cell["samples"])
        assert all(s["depth_tokens"] == cell["depth"] for s in cell["samples"])
    # Alternation: in every iteration the two backends' runs are back to back, and who goes first rotates.
    firsts = []
    for native, other in zip(cells[0]["samples"], cells[1]["samples"]):
        assert abs(native["seq"] - other["seq"]) == 1
        firsts.append(native["seq"] < other["seq"])
    assert True in firsts and False in firsts
    comps = report["comparisons"]
    assert [c["edgellm"] for c in comps] == [cells[0]["label"], cells[2]["label"]]
    a, b = headline(cells[0]), headline(cells[1])
    for metric, ratio in comps[0]["ratios"].items():
        assert ratio == pytest.approx(a[metric] / b[metric])
