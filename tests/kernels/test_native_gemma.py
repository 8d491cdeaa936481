"""The native decode step on Gemma 3, Gemma 2 and Qwen3 (csrc/decoder/decode.c's family flags) against float64
transformers and torch's path.

Tiny random models made by transformers: Gemma 3 with two sliding layers (window ``WINDOW``, shorter than
the ``STEPS`` positions decoded, RoPE base of their own) around a full one, sandwich (1 + w) norms, q/k
norms, GELU, √d embedding scale, an attention scale from ``query_pre_attn_scalar`` and, in one case,
soft-capped logits; Gemma 2 (the same sliding layers on one RoPE base, soft-capped attention scores and
logits); Qwen3 for q/k norms on the Llama layout. The Llama/Qwen2 tests of
tests/test_native_decode.py (tolerances explained there) run here on these models too: they are
imported below and take this module's ``case`` fixture.
"""

from __future__ import annotations

import ctypes
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from edgellm.kernels import abi, native
from edgellm.families.config import FULL, SLIDING
from edgellm.models.native_description import native_unsupported
from edgellm.runtime.engine import Engine
from tests.kernels.test_native_decode import (  # noqa: F401 - the shared tests, collected here with this module's case
    FLIP_TOL,
    REAL_ROW_TOL,
    STEPS,
    _assert_greedy_agrees,
    _relative_error,
    _steps,
    _torch_steps,
    converted_engine,
    native_decoder,
    test_engine_decodes_natively,
    test_every_thread_count_gives_the_same_result,
    test_greedy_tokens_match_torch_path,
    test_info_names_the_decode_step,
    test_logits_match_float64_reference,
    test_logits_step_from_scores_the_decode_path,
    test_narrow_cache_greedy_tokens_match_torch_path,
    test_narrow_cache_steps_run_natively_and_match_torch,
    test_step_outside_the_cache_is_refused,
)
from tests.support.tiny import VOCAB, _save_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")

WINDOW = 8  # the sliding layers' window: STEPS (40) positions cross it many times
ATTN_SOFTCAP = 5.0  # Gemma 2's cap on attention scores: low enough to bend this model's scores
GLOBAL_THETA, LOCAL_THETA = 1_000_000.0, 100.0


def _make_model(folder: Path, arch: str, *, softcap: float | None) -> None:
    """A random 3-layer model, GQA 3 heads on 1 KV head, K and N not multiples of 64 (96, 160).

    Weights are scaled up from transformers' init (as in test_native_decode) and the norm weights made
    random (Gemma's are stored around 0 and scale by 1 + w), so that every norm matters."""
    torch.manual_seed(3)
    common = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=3,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                  rms_norm_eps=1e-6, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    gemma = dict(tie_word_embeddings=True, pad_token_id=0, sliding_window=WINDOW, layer_types=[SLIDING, FULL, SLIDING],
                 query_pre_attn_scalar=24, final_logit_softcapping=softcap)
    norm_mean = 0.0
    if arch == "gemma3":
        rope = {SLIDING: {"rope_type": "default", "rope_theta": LOCAL_THETA},
                FULL: {"rope_type": "default", "rope_theta": GLOBAL_THETA}}
        model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**common, **gemma, rope_parameters=rope))
    elif arch == "gemma2":
        model = transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
            **common, **gemma, attn_logit_softcapping=ATTN_SOFTCAP,
            rope_parameters={"rope_type": "default", "rope_theta": GLOBAL_THETA}))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, tie_word_embeddings=False,
                                                                      rope_theta=GLOBAL_THETA))
        norm_mean = 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(norm_mean, 0.3)
            else:
                p.mul_(5.0)
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)


@pytest.fixture(scope="module", params=[("gemma3", None, "q8f16_1"), ("gemma3", 30.0, "q4f16_1"),
                                        ("gemma2", 30.0, "q8f16_1"), ("qwen3", None, "q4f16_1")],
                ids=lambda p: "-".join(str(x) for x in p if x is not None))
def case(request, tmp_path_factory) -> tuple[Path, Engine]:
    arch, softcap, quant = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{quant}")
    _make_model(root / "hf", arch, softcap=softcap)
    return root, converted_engine(root, quant)


def _variants() -> list[str]:
    return [v for v in native.variant_names() if native.verdict(v) is None]


@pytest.mark.parametrize("variant", _variants())
def test_every_kernel_variant_matches_float64_reference(case, variant: str) -> None:
    """Each variant this CPU runs (what EDGELLM_KERNEL forces), its library loaded directly."""
    _, engine = case
    lib = abi.declare(ctypes.CDLL(str(native.library_path(variant))))
    decoder = engine.model.native
    engine.model.native = native_decoder(engine, lib, None)
    try:
        test_logits_match_float64_reference(case)
    finally:
        engine.model.native.close()
        engine.model.native = decoder


def torch_without_each_feature(model, run: Callable[[], torch.Tensor]) -> list[torch.Tensor]:
    """`run()` on torch's path with, in turn, the sliding window, Gemma 3's local RoPE table on the sliding layers
    and the attention soft-cap taken away (those the model has): what a native path missing one of them gives."""
    windows = [layer.attn.window for layer in model.layers]
    assert sorted(set(windows), key=str) == [WINDOW, None]
    for layer in model.layers:
        layer.attn.window = None
    try:
        wrongs = [run()]
    finally:
        for layer, window in zip(model.layers, windows, strict=True):
            layer.attn.window = window
    if model.local_rope is not None:
        model.local_rope, local = model.rope, model.local_rope
        try:
            wrongs.append(run())
        finally:
            model.local_rope = local
    if model.config.attn_logit_softcapping is not None:
        for layer in model.layers:
            layer.attn.softcap = None
        try:
            wrongs.append(run())
        finally:
            for layer in model.layers:
                layer.attn.softcap = model.config.attn_logit_softcapping
    return wrongs


def test_window_local_rope_and_softcap_are_exercised(case) -> None:
    """The steps follow torch's path past the window; torch's path without the window, with the global
    RoPE table on the sliding layers (Gemma 3) or without soft-capped scores (Gemma 2) is far from both (so
    the other tests would see either mistake)."""
    _, engine = case
    model = engine.model.torch
    if not model.config.sliding_window:
        pytest.skip("no sliding layers")
    ids = torch.randint(0, VOCAB - 2, (STEPS,), generator=torch.Generator().manual_seed(13)).tolist()
    native_logits, _ = _steps(engine, ids)
    torch_logits, _ = _torch_steps(engine, ids)
    late = slice(WINDOW + 1, None)
    close = _relative_error(native_logits[late], torch_logits[late].double())
    assert close <= FLIP_TOL
    wrongs = torch_without_each_feature(model, lambda: _torch_steps(engine, ids)[0])
    for wrong in wrongs:
        assert _relative_error(native_logits[late], wrong[late].double()) > 10 * max(close, 1e-3)


def test_what_stays_on_torch_says_why(case) -> None:
    _, engine = case
    phi3 = dataclasses.replace(engine.config, model=dataclasses.replace(engine.config.model, architecture="phi3"))
    assert native_unsupported(phi3, torch.float32) == "architecture phi3 has no native decode yet"
    assert "attends in float32" in native_unsupported(engine.config, torch.bfloat16)


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["f32", "q8"])
def test_gemma3_270m_native_matches_torch_greedy(kv: str) -> None:
    engine = Engine.load("gemma3-270m", quantization="q8f16_1", progress=False, threads=1, kv_cache=kv,
                         runtime="torch")
    assert engine.decode_path.startswith("native ")
    _assert_greedy_agrees(engine, engine.encode("The capital of France is"), 24, REAL_ROW_TOL)
