"""The model on the native library alone (models/native_model.py) and the torch-free pieces it stands on: weights
read as numpy views of the shards, RoPE tables computed with numpy, a numpy KV cache, numpy log-probabilities,
and an engine process that never imports torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.artifact.tensors import map_shard, shard_arrays, shard_tensors
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams
from edgellm.kernels import native
from edgellm.models.kv_arrays import ArrayKVCache
from edgellm.models import protocol
from edgellm.models.native_model import NativeModel
from edgellm.models.protocol import NATIVE, TORCH_PREFILL_NATIVE_DECODE, choose
from edgellm.models.rope_tables import rope_tables
from edgellm.runtime.engine import Engine, _logprob
from edgellm.runtime.memory import estimate_memory
from tests.kernels.test_native_decode import _make_model
from tests.kernels.test_native_prefill import FLIP_TOL, INT8

transformers = pytest.importorskip("transformers")
needs_native_prefill = pytest.mark.skipif(native.prefill_matmul() is None,
                                          reason="no native prefill in this kernel library (scalar, or none)")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A converted random 2-layer Llama (q4f16_1, tied embeddings)."""
    root = tmp_path_factory.mktemp("native-model")
    _make_model(root / "hf", "llama", tied=True)
    return convert(root / "hf", root / "art", quantization="q4f16_1", progress=False)


# ---- weights as numpy views ------------------------------------------------------------------------------------
def test_shard_arrays_view_the_same_bytes_as_the_torch_tensors(tiny_llama: Path) -> None:
    art = open_artifact(tiny_llama)
    mm = map_shard(tiny_llama / art.shard_names[0])
    arrays, tensors = shard_arrays(mm, "shard"), shard_tensors(mm, "shard")
    assert arrays.keys() == tensors.keys() and arrays
    for name, t in tensors.items():
        a = arrays[name]
        assert a.shape == tuple(t.shape) and str(a.dtype) == str(t.dtype).removeprefix("torch.")
        assert a.ctypes.data == t.data_ptr()  # views of the one mapping: nothing copied, nothing counted twice
        np.testing.assert_array_equal(a, t.numpy())


def test_weights_as_arrays_hold_the_mappings(tiny_llama: Path) -> None:
    weights = open_artifact(tiny_llama).weights(arrays=True)
    assert weights.mappings and all(isinstance(a, np.ndarray) for a in weights.values())


# ---- RoPE tables ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0},
                                     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16}],
                         ids=["default", "linear", "llama3"])
def test_rope_tables_match_transformers(scaling: dict | None) -> None:
    """Against transformers' own rotary embedding (which computes in float32: hence the tolerance)."""
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=2, rope_theta=10000.0,
                                      rope_scaling=scaling, max_position_embeddings=64)
    rotary = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config)
    positions = torch.arange(64)[None]
    cos, sin = rotary(torch.zeros(1, 64, 64), positions)
    tables = rope_tables(64, 10000.0, scaling, 64, 64)
    np.testing.assert_allclose(tables.cos, cos[0].numpy(), atol=2e-5)
    np.testing.assert_allclose(tables.sin, sin[0].numpy(), atol=2e-5)
    assert tables.cos.dtype == np.float32 and tables.long is None


def test_longrope_keeps_two_tables_and_switches_past_the_original_context() -> None:
    scaling = {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
               "original_max_position_embeddings": 16}
    tables = rope_tables(8, 10000.0, scaling, 64, 64)
    assert tables.switch_at == 16 and tables.long is not None
    assert not np.allclose(tables.long[0], tables.cos)


# ---- the numpy KV cache ------------------------------------------------------------------------------------------
def test_array_cache_grows_in_blocks_and_keeps_what_it_holds() -> None:
    cache = ArrayKVCache(2, 1, 8, 100, block=16)
    assert cache.capacity == 16 and cache.keys.shape == (2, 1, 1, 16, 8) and cache.keys.dtype == np.float32
    cache.keys[..., :16, :] = np.arange(2 * 16 * 8, dtype=np.float32).reshape(2, 1, 1, 16, 8)
    before = cache.keys[..., :16, :].copy()
    cache.reserve(20)
    assert cache.capacity == 32 and cache.nbytes == 2 * 2 * 32 * 8 * 4
    np.testing.assert_array_equal(cache.keys[..., :16, :], before)
    cache.reserve(100)
    assert cache.capacity == 100
    with pytest.raises(ValueError, match="exceeds the context window"):
        cache.reserve(101)
    cache.release()
    assert cache.capacity == 0 and cache.nbytes == 0


# ---- log-probabilities ---------------------------------------------------------------------------------------
def test_logprob_matches_torch_log_softmax() -> None:
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(1000) * 5).astype(np.float32)
    logits[[7, 9]] = logits.max() + 1  # a tie at the top: the lower id first
    got = _logprob(logits, 3, 5)
    ref = torch.log_softmax(torch.from_numpy(logits), dim=-1)
    assert got.token_id == 3 and got.logprob == pytest.approx(float(ref[3]), abs=1e-5)
    assert [i for i, _ in got.top] == [7, 9, *torch.topk(ref, 5).indices.tolist()[2:]]
    for token, value in got.top:
        assert value == pytest.approx(float(ref[token]), abs=1e-5)
    assert _logprob(logits, 3, 0).top == ()
    assert len(_logprob(logits[:4], 0, 10).top) == 4  # more asked for than the vocabulary holds


# ---- the engine on the native model --------------------------------------------------------------------------
@pytest.fixture
def same_prefill_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch's path multiplies prefill with the GEMM the native prefill uses: el_gemm_bf16 already, or, where the
    library prefills with el_gemm_i8 or el_gemm_f32 (no AVX512-BF16), that one in its place (torch's bf16 GEMM would
    round differently and could flip a near-tie)."""
    if native.prefill_matmul() in ("int8", "f32"):
        from edgellm.quant import dispatch
        from tests.kernels.test_native_prefill import _gemm_native

        monkeypatch.setattr(dispatch, "_takes_gemm_bf16", lambda threads: True)
        monkeypatch.setattr(dispatch, "_gemm_bf16", _gemm_native)


@needs_native_prefill
def test_engine_runs_the_native_model_and_greedy_tokens_match_torch(tiny_llama: Path, same_prefill_matmul: None) -> None:
    native_engine = Engine(open_artifact(tiny_llama), threads=1)
    torch_engine = Engine(open_artifact(tiny_llama), threads=1, runtime="torch")
    assert isinstance(native_engine.model, NativeModel) and native_engine.choice.implementation == NATIVE
    assert torch_engine.choice == choose(torch_engine.config, "torch")
    assert (torch_engine.choice.implementation, torch_engine.choice.reason) == (TORCH_PREFILL_NATIVE_DECODE,
                                                                                "asked for")
    params = GenerationParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    prompt = [5, 17, 42, 99, 3, 200, 7, 64, 128, 31, 11]
    assert native_engine.generate(prompt, params).token_ids == torch_engine.generate(prompt, params).token_ids


@needs_native_prefill
def test_native_logits_match_torch_for_every_position(tiny_llama: Path, same_prefill_matmul: None) -> None:
    """Prefill chunks and decode steps, native vs torch's path (the same prefill GEMM, float32 elsewhere): within 1e-3
    relative, or with el_gemm_i8's int8 inputs, whose roundings flip between the two paths' float32 values, within
    test_native_prefill's FLIP_TOL (measured 1.2e-2)."""
    ids = list(range(3, 60, 2))
    got = Engine(open_artifact(tiny_llama), threads=1).logits(ids, step_from=20)
    ref = Engine(open_artifact(tiny_llama), threads=1, runtime="torch").logits(ids, step_from=20)
    assert got.shape == ref.shape == (len(ids), ref.shape[1])
    err = ((got.double() - ref.double()).norm(dim=-1) / ref.double().norm(dim=-1)).max().item()
    assert err < (FLIP_TOL if INT8 else 1e-3)


def test_runtime_choice_is_checked(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EdgeLLMError, match="runtime 'fast'"):
        Engine(open_artifact(tiny_llama), runtime="fast")
    monkeypatch.setattr(protocol, "native_unsupported", lambda *a, **k: "a reason")
    with pytest.raises(EdgeLLMError, match="cannot run on the native library alone: a reason"):
        Engine(open_artifact(tiny_llama), runtime="native")
    assert Engine(open_artifact(tiny_llama), threads=1).choice.reason == "a reason"


def test_what_keeps_a_model_on_torch_is_said(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = open_artifact(tiny_llama).config
    assert "float32" in choose(config, None, torch.float16).reason
    monkeypatch.setattr(native, "prefill_matmul", lambda: None)
    assert "no native prefill" in choose(config).reason


def test_memory_estimate_counts_the_mapped_weights_once(tiny_llama: Path) -> None:
    """On the native model the weights are the shards' bytes as stored (the tied LM head reads the table)."""
    art = open_artifact(tiny_llama)
    if choose(art.config).implementation != NATIVE:
        pytest.skip("this machine runs the model on torch")
    shards = sum(a.nbytes for a in art.weights(arrays=True).values())
    assert estimate_memory(art.config).weights_bytes == shards


@needs_native_prefill
def test_an_engine_process_never_imports_torch(tiny_llama: Path) -> None:
    """Load, generate (sampled, penalized, with log-probabilities) and evaluate nothing else: torch stays out."""
    script = f"""
import json, sys
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
engine = Engine.load({str(tiny_llama)!r}, threads=1, progress=False)
out = engine.generate([5, 17, 42, 99], GenerationParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=1,
                      repetition_penalty=1.1, top_logprobs=2, ignore_eos=True))
print(json.dumps({{"torch": "torch" in sys.modules, "tokens": len(out.token_ids),
                  "runs": engine.choice.implementation}}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"torch": False, "tokens": 12, "runs": "native"}


# ---- token-by-token prefill, where the library has no native prefill (the scalar variant) ---------------------------
def test_without_a_native_prefill_only_runtime_native_takes_the_native_model(tiny_llama: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Auto stays on torch (prefill at decode speed is not a default); runtime="native" prompts token by token
    through the decode step: the same computation as steps fed one at a time, bit for bit."""
    monkeypatch.setattr(native, "prefill_matmul", lambda: None)
    assert "no native prefill" in Engine(open_artifact(tiny_llama), threads=1).choice.reason
    engine = Engine(open_artifact(tiny_llama), threads=1, runtime="native")
    assert engine.choice.implementation == NATIVE and engine.model.prefill == "token by token"
    ids = [5, 17, 42, 99, 3, 200, 7, 64]
    every = engine.logits(ids)  # the prompt as one chunk: token by token inside
    assert torch.equal(every, engine.logits(ids, step_from=1))  # one token per call, as generation steps
    params = GenerationParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert engine.generate(ids, params).token_ids[0] == int(every[-1].argmax())


@pytest.mark.parametrize(("variant", "runtime", "prefill"), [("avx2", None, "native"), ("avxvnni", None, "native"),
                                                         ("scalar", "native", "token by token")])
def test_libraries_without_the_bf16_gemm_never_import_torch(tiny_llama: Path, variant: str, runtime: str | None,
                                                             prefill: str) -> None:
    """On a library without the bf16 GEMM (the avx2 variant, as an AVX2-only laptop has) the default engine runs the
    native model and prefills natively with the float32 GEMM; on the scalar library, asked for runtime native, it
    prompts token by token. Either way torch is never imported, and the first greedy token is this process's."""
    if variant not in native.variant_names() or native.verdict(variant) is not None:
        pytest.skip(f"this CPU does not run the {variant} library")
    script = f"""
import json, sys
from edgellm.kernels import native
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
engine = Engine.load({str(tiny_llama)!r}, threads=1, progress=False, runtime={runtime!r})
out = engine.generate([5, 17, 42, 99, 3, 200], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True))
print(json.dumps({{"torch": "torch" in sys.modules, "tokens": out.token_ids, "prefill": engine.model.prefill,
                  "runs": engine.choice.implementation, "matmul": native.prefill_matmul()}}))
"""
    env = {**os.environ, native.ENV_VAR: variant}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    expected = Engine(open_artifact(tiny_llama), threads=1).generate(
        [5, 17, 42, 99, 3, 200], GenerationParams(max_tokens=6, temperature=0.0, ignore_eos=True)).token_ids
    # this process runs the best library here (its own GEMMs: bf16 / int8 / f32): later tokens may break a near-tie
    # the other way (seen on a Zen 4 core: avx2 against avx512-bf16 at the sixth token), the first one is the prefill's
    assert len(got["tokens"]) == len(expected)
    got["tokens"], expected = got["tokens"][:1], expected[:1]
    assert got == {"torch": False, "tokens": expected, "prefill": prefill, "runs": "native",
                   "matmul": None if variant == "scalar" else "f32" if variant.startswith("neon") else "int8"}


def test_info_says_what_runs_the_model(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from edgellm.cli import main

    assert main(["info", str(tiny_llama), "--runtime", "torch"]) == 0
    assert "runs on             torch (asked for)" in capsys.readouterr().out
    assert main(["info", str(tiny_llama), "--runtime", "native", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["runs_on"].startswith("the native library alone")
    assert info["prefill_matmul"] == {"bf16": "native bf16 GEMM (AVX512-BF16)",
                                      "int8": "native int8 GEMM (el_gemm_i8: inputs quantized per 32 as the decode "
                                              "step's; float32 el_gemm_f32 for q8, q2_k, q3_k, iq4_nl; "
                                              "EDGELLM_PREFILL_GEMM=f32 for float32 throughout)",
                                      "f32": "native float32 GEMM (el_gemm_f32)",
                                      None: "none: the prompt goes through the decode step token by token"}[
        native.prefill_matmul()]


def test_info_on_a_library_with_the_float_gemm(tiny_llama: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the library prefills with el_gemm_f32 (an AVX2 CPU), the default runs the native model and says so."""
    from edgellm.cli import main

    monkeypatch.setattr(native, "prefill_matmul", lambda: "f32")
    assert main(["info", str(tiny_llama), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["runs_on"].startswith("the native library alone")
    assert info["prefill_matmul"] == "native float32 GEMM (el_gemm_f32)"
