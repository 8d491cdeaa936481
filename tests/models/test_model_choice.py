"""models/protocol.py: the one decision of which implementation runs an artifact (`choose`, every branch with its
reason, on tiny random models and stated kernel libraries), models/load.py building what it chose, and the Model
protocol's batched decode over `run`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.artifact.config import ArtifactConfig
from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.kernels import native
from edgellm.models.load import load_model
from edgellm.models.native_description import native_unsupported
from edgellm.models.native_model import NativeModel
from edgellm.quant.layout import EL_FORMAT_CODES
from edgellm.models.protocol import (
    NATIVE,
    TORCH,
    TORCH_PREFILL_NATIVE_DECODE,
    Choice,
    KernelState,
    choose,
    decode_batch_by_run,
)
from edgellm.models.torch_native import TorchPrefillNativeDecode
from edgellm.models.transformer import Transformer
from edgellm.runtime.engine import Engine
from tests.support.tiny import make_tiny

pytest.importorskip("transformers")
needs_native = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")

AVX2_BF16 = KernelState("avx2", "best for this CPU", "bf16")
AVX2_F32 = KernelState("avx2", "best for this CPU", "f32")
SCALAR = KernelState("scalar", "no SIMD", None)
NO_LIBRARY = KernelState(native.TORCH, "EDGELLM_KERNEL=torch", None)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A random 2-layer Qwen2 converted twice: q4f16_1 (the native decoder takes it) and q0f32 (it does not)."""
    root = tmp_path_factory.mktemp("choice")
    make_tiny(root / "hf", "qwen2", tied=False)
    return {quant: convert(root / "hf", root / quant, quantization=quant, progress=False)
            for quant in ("q4f16_1", "q0f32")}


@pytest.fixture(scope="module")
def q4(tiny: dict[str, Path]) -> ArtifactConfig:
    return open_artifact(tiny["q4f16_1"]).config


def test_native_where_the_library_prefills(q4: ArtifactConfig) -> None:
    for runtime in (None, "native"):
        assert choose(q4, runtime, kernel=AVX2_BF16) == Choice(NATIVE, "native prefill (bf16 GEMM) and decode",
                                                               "native avx2")
    assert choose(q4, kernel=AVX2_F32).reason == "native prefill (f32 GEMM) and decode"


def test_without_a_native_prefill_only_runtime_native_goes_token_by_token(q4: ArtifactConfig) -> None:
    auto = choose(q4, kernel=SCALAR)
    assert auto.implementation == TORCH_PREFILL_NATIVE_DECODE and auto.decode == "native scalar"
    assert auto.reason.startswith("no native prefill in this kernel library (the scalar variant")
    asked = choose(q4, "native", kernel=SCALAR)
    assert (asked.implementation, asked.prefill, asked.decode) == (NATIVE, "token by token", "native scalar")
    assert asked.reason.startswith("asked for; no native prefill")


def test_runtime_torch_keeps_native_decode_steps_where_they_run(q4: ArtifactConfig) -> None:
    for kernel in (AVX2_BF16, SCALAR):
        assert choose(q4, "torch", kernel=kernel) == Choice(TORCH_PREFILL_NATIVE_DECODE, "asked for",
                                                            f"native {kernel.variant}")


def test_what_the_native_decoder_cannot_describe_runs_on_torch(tiny: dict[str, Path]) -> None:
    f32 = open_artifact(tiny["q0f32"]).config
    why = f"weight format f32: native decode takes {'/'.join(EL_FORMAT_CODES)}"
    assert choose(f32, kernel=AVX2_BF16) == Choice(TORCH, why, f"torch ({why})")
    assert choose(f32, "torch", kernel=AVX2_BF16) == Choice(TORCH, "asked for", f"torch ({why})")
    with pytest.raises(EdgeLLMError, match=f"cannot run on the native library alone: {why}"):
        choose(f32, "native", kernel=AVX2_BF16)


def test_a_narrow_kv_dtype_and_no_library_run_on_torch(q4: ArtifactConfig) -> None:
    half = choose(q4, None, torch.bfloat16, kernel=AVX2_BF16)
    assert half == Choice(TORCH, "the native decode step attends in float32, not torch.bfloat16",
                          "torch (the native decode step attends in float32, not torch.bfloat16)")
    assert choose(q4, kernel=NO_LIBRARY) == Choice(TORCH, "EDGELLM_KERNEL=torch", "torch (EDGELLM_KERNEL=torch)")
    with pytest.raises(EdgeLLMError, match="alone: EDGELLM_KERNEL=torch"):
        choose(q4, "native", kernel=NO_LIBRARY)


def test_an_unknown_runtime_is_refused(q4: ArtifactConfig) -> None:
    with pytest.raises(EdgeLLMError, match="runtime 'fast': choose one of native, torch"):
        choose(q4, "fast", kernel=AVX2_BF16)


def _with(config: ArtifactConfig, **model: object) -> ArtifactConfig:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **model))


@pytest.mark.parametrize(("change", "reason"), [
    ({"architecture": "phi3"}, "architecture phi3 has no native decode yet"),
    ({"rope_scaling": {"rope_type": "longrope"}}, "LongRoPE switches tables by position"),
    ({"hidden_size": 72}, "hidden size 72 not a multiple of 32"),
    ({"intermediate_size": 100}, "intermediate size 100 not a multiple of 32"),
    ({"head_dim": 12, "num_attention_heads": 8}, "head dim 12 not a multiple of 8 up to 512"),
    ({"head_dim": 640, "num_attention_heads": 1, "num_key_value_heads": 1},
     "head dim 640 not a multiple of 8 up to 512"),
    ({"num_attention_heads": 66, "num_key_value_heads": 1, "head_dim": 16},
     "more than 64 query heads per KV head"),
])
def test_each_limit_of_the_native_decoder_is_named(q4: ArtifactConfig, change: dict[str, object],
                                                   reason: str) -> None:
    assert native_unsupported(q4) is None
    changed = _with(q4, **change)
    assert (native_unsupported(changed) or "").startswith(reason)
    assert choose(changed, kernel=AVX2_BF16).reason.startswith(reason)


def test_an_embedding_without_native_rows_is_named(q4: ArtifactConfig) -> None:
    formats = dict(q4.quantization.formats, **{"model.embed_tokens": "f16"})
    changed = dataclasses.replace(q4, quantization=dataclasses.replace(q4.quantization, formats=formats))
    assert native_unsupported(changed) == "embedding format f16 has no native row lookup"


# ---- building what was chosen -------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize(("implementation", "kind"), [(NATIVE, NativeModel), (TORCH, Transformer),
                                                      (TORCH_PREFILL_NATIVE_DECODE, TorchPrefillNativeDecode)])
def test_load_model_builds_the_chosen_implementation(tiny: dict[str, Path], implementation: str, kind: type) -> None:
    """Each implementation over the same weights: the class chosen, and the logits of a prefill chunk and a decode
    step within the 8-bit activations' reach of torch's whole prefill (tests/test_native_decode.py holds each path
    to transformers' float64 forward)."""
    art = open_artifact(tiny["q4f16_1"])
    choice = Choice(implementation, "a test", "native")
    if implementation == NATIVE and native.prefill_matmul() is None:
        choice = dataclasses.replace(choice, prefill="token by token")
    weights = art.weights(arrays=implementation == NATIVE)
    model = load_model(choice, art.config, weights, threads=1, window=32)
    assert type(model) is kind
    ids = [5, 17, 42, 99, 3]
    cache = model.new_cache(32)
    steps = np.concatenate([model.run(ids[:4], 0, cache, all_logits=True), model.run(ids[4:], 4, cache,
                                                                                    all_logits=True)])
    reference = load_model(Choice(TORCH, "reference", "torch"), art.config, art.weights(), threads=1, window=32)
    ref_cache = reference.new_cache(32)
    want = reference.run(ids, 0, ref_cache, all_logits=True)
    err = np.linalg.norm(steps - want, axis=-1) / np.linalg.norm(want, axis=-1)
    assert err.max() < 5e-2, err
    assert (model.streamed_spans() == []) == (implementation == TORCH)
    assert model.describe().startswith("native" if implementation != TORCH else "torch")


@needs_native
def test_the_mixed_path_prefills_on_torch_and_steps_natively(tiny: dict[str, Path]) -> None:
    """Prompts go through torch on its threads, single tokens through the native step with torch left one thread
    (its spinning OpenMP workers would otherwise compete with the step's): each the bits of that path alone."""
    art = open_artifact(tiny["q4f16_1"])
    threads = torch.get_num_threads()
    model = load_model(Choice(TORCH_PREFILL_NATIVE_DECODE, "a test", "native"), art.config, art.weights(),
                       threads=2, window=32)
    assert isinstance(model, TorchPrefillNativeDecode) and model.native is not None
    try:
        mixed, alone = model.new_cache(32), model.new_cache(32)
        prefill = model.run([5, 17, 42], 0, mixed, all_logits=True)
        assert torch.get_num_threads() == 2
        assert np.array_equal(prefill, model.torch.run([5, 17, 42], 0, alone, all_logits=True))
        step = model.run([7], 3, mixed)
        assert torch.get_num_threads() == 1
        assert np.array_equal(step.view(np.uint32), model.native.step(7, 3, alone).view(np.uint32))
        with pytest.raises(ValueError, match="exceed the context window"):
            model.run([7], 32, mixed)
    finally:
        torch.set_num_threads(threads)


def test_load_model_refuses_an_unknown_implementation(q4: ArtifactConfig) -> None:
    with pytest.raises(ValueError, match="no model implementation 'gpu'"):
        load_model(Choice("gpu", "a test", "gpu"), q4, {}, threads=1, window=8)


@needs_native
@pytest.mark.parametrize("runtime", [None, "native", "torch"])
def test_the_engine_runs_what_choose_picks(tiny: dict[str, Path], runtime: str | None) -> None:
    engine = Engine(open_artifact(tiny["q4f16_1"]), threads=1, runtime=runtime)
    assert engine.choice == choose(engine.config, runtime)
    kinds = {NATIVE: NativeModel, TORCH: Transformer, TORCH_PREFILL_NATIVE_DECODE: TorchPrefillNativeDecode}
    assert type(engine.model) is kinds[engine.choice.implementation]


def test_torch_refuses_a_cache_it_cannot_read(tiny: dict[str, Path]) -> None:
    from edgellm.models.kv_arrays import ArrayKVCache

    art = open_artifact(tiny["q0f32"])
    model = Transformer(art.config, art.weights())
    with pytest.raises(TypeError, match="reads a KVCache, not ArrayKVCache"):
        model.run([1], 0, ArrayKVCache(2, 2, 16, 8))


# ---- decode_batch over run ----------------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("implementation", [NATIVE, TORCH, TORCH_PREFILL_NATIVE_DECODE])
def test_decode_batch_rows_are_single_steps(tiny: dict[str, Path], implementation: str) -> None:
    """Rows of different caches, and rows sharing one cache at consecutive positions (speculative verification):
    each row's logits are the bits its own single-token step gives."""
    art = open_artifact(tiny["q4f16_1"])
    choice = Choice(implementation, "a test", "native",
                    prefill="token by token" if native.prefill_matmul() is None else "native")
    model = load_model(choice, art.config, art.weights(arrays=implementation == NATIVE), threads=1, window=32)
    prompts = ([5, 17, 42], [99, 3])
    caches, solo = [model.new_cache(32) for _ in prompts], [model.new_cache(32) for _ in prompts]
    for prompt, cache, alone in zip(prompts, caches, solo, strict=True):
        model.run(prompt, 0, cache)
        model.run(prompt, 0, alone)
    got = model.decode_batch([7, 8, 9], [3, 4, 2], [caches[0], caches[0], caches[1]])
    want = np.stack([model.run([7], 3, solo[0]), model.run([8], 4, solo[0]), model.run([9], 2, solo[1])])
    assert got.shape == (3, art.config.model.vocab_size) and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_decode_batch_refuses_rows_that_do_not_line_up(tiny: dict[str, Path]) -> None:
    art = open_artifact(tiny["q0f32"])
    model = Transformer(art.config, art.weights())
    cache = model.new_cache(8)
    with pytest.raises(ValueError, match="2 tokens, 1 positions, 1 caches"):
        decode_batch_by_run(model, [1, 2], [0], [cache])
    with pytest.raises(ValueError, match="no rows"):
        model.decode_batch([], [], [])
