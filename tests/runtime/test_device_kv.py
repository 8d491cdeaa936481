"""The KV cache: half and 8-bit keys/values against float32, and a cache grown in blocks against a full-size one."""

from __future__ import annotations

import pytest
import torch

from edgellm.errors import EdgeLLMError
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from edgellm.models.kv_cache import KVCache, bytes_per_token, quantize_q8
from tests.support.tiny import VOCAB, tiny_engine

LONG = [int(t) for t in torch.randint(0, VOCAB - 2, (240,), generator=torch.Generator().manual_seed(1))]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Engine:
    return tiny_engine(tmp_path_factory.mktemp("kv"), "llama", tied=True)


def test_q8_rounding_is_within_half_a_step() -> None:
    x = torch.randn(3, 4, 17, 64, dtype=torch.float64) * torch.logspace(-3, 2, 17).view(1, 1, 17, 1)
    q, scale = quantize_q8(x.float())
    assert q.dtype == torch.int8 and scale.shape == (3, 4, 17, 1)
    err = (q.double() * scale.double() - x).abs()
    assert (err <= scale.double() / 2 * (1 + 1e-5) + 1e-12).all()
    zeros_q, zeros_scale = quantize_q8(torch.zeros(2, 5))
    assert not zeros_q.any() and (zeros_scale == 1).all()  # an all-zero row keeps a usable scale


def test_growing_cache_gives_the_full_size_cache_logits(engine: Engine) -> None:
    model = engine.model
    ids = torch.tensor([LONG[:200]])
    full = model.new_cache(256, block=0)
    growing = model.new_cache(256, block=16)
    assert full.capacity == 256 and growing.capacity == 16
    reference = model(ids, 0, full, all_logits=True)
    chunks = [model(ids[:, s : s + 24], s, growing, all_logits=True) for s in range(0, 200, 24)]
    assert growing.capacity == 256 and growing.keys.is_contiguous()  # 16 → 32 → 64 → 128 → 256
    torch.testing.assert_close(torch.cat(chunks, dim=1), reference, rtol=1e-5, atol=1e-5)
    step = model(torch.tensor([[5]]), 200, growing)[0, -1]
    torch.testing.assert_close(step, model(torch.tensor([[5]]), 200, full)[0, -1], rtol=1e-5, atol=1e-5)


def test_growth_doubles_in_blocks_and_stops_at_the_window() -> None:
    cache = KVCache(2, 2, 8, 100, block=16)
    sizes = []
    for end in (1, 17, 33, 40, 70, 100):
        cache.reserve(end)
        sizes.append(cache.capacity)
    assert sizes == [16, 32, 64, 64, 100, 100]
    assert cache.nbytes == 100 * bytes_per_token(2, 2, 8)
    with pytest.raises(ValueError, match="exceeds the context window 100"):
        cache.reserve(101)


def test_q8_cache_memory_is_about_a_quarter() -> None:
    f32 = KVCache.bytes_needed(30, 3, 64, 4096)
    q8 = KVCache.bytes_needed(30, 3, 64, 4096, kind="q8")
    assert q8 / f32 == pytest.approx((64 + 4) / (64 * 4))
    cache = KVCache(30, 3, 64, 4096, kind="q8", block=0)
    assert cache.nbytes == q8 and cache.keys.dtype == torch.int8


def test_f16_cache_memory_is_half() -> None:
    f32 = KVCache.bytes_needed(30, 3, 64, 4096)
    assert KVCache.bytes_needed(30, 3, 64, 4096, kind="f16") * 2 == f32
    cache = KVCache(30, 3, 64, 4096, kind="f16", block=0)
    assert cache.nbytes * 2 == f32 and cache.keys.dtype == torch.float16


def test_f16_logits_close_to_f32_and_greedy_agrees(engine: Engine) -> None:
    """Halves keep 11 significant bits: logits within 0.5% of their spread, greedy tokens the same."""
    f32 = Engine(engine.artifact, kv_cache="f32", threads=1)
    f16 = Engine(engine.artifact, kv_cache="f16", threads=1)
    assert f16.cache.kind == "f16" and f16.cache.read(0, 0)[0].dtype == torch.float32
    ref, got = f32.logits(LONG), f16.logits(LONG)
    assert (got - ref).abs().max().item() < 0.005 * ref.std().item()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean().item() >= 0.99
    p = GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert f16.generate(LONG[:100], p).token_ids == f32.generate(LONG[:100], p).token_ids
    assert f16.memory.kv_cache_bytes * 2 == f32.memory.kv_cache_bytes


def test_q8_logits_close_to_f32_and_greedy_agrees(engine: Engine) -> None:
    q8 = Engine(engine.artifact, kv_cache="q8", threads=1)
    engine = Engine(engine.artifact, kv_cache="f32", threads=1)
    assert q8.cache.kind == "q8" and engine.cache.kind == "f32"
    ref, got = engine.logits(LONG), q8.logits(LONG)
    # Tolerance: 2% of the logits' spread; int8 keeps each key/value within 1/254 of its row's largest entry.
    spread = ref.std().item()
    assert (got - ref).abs().max().item() < 0.02 * spread
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.95, f"greedy top-1 agreement {agree:.3f} over {len(LONG)} positions"
    p = GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    assert q8.generate(LONG[:100], p).token_ids[:4] == engine.generate(LONG[:100], p).token_ids[:4]
    assert q8.memory.kv_cache_bytes < engine.memory.kv_cache_bytes / 3


def test_unknown_kv_kind_is_refused(engine: Engine) -> None:
    with pytest.raises(EdgeLLMError, match="unknown KV cache kind 'q4'; known kinds: f32, f16, q8"):
        Engine(engine.artifact, kv_cache="q4", threads=1)


def test_the_artifact_config_sets_the_default_kv_kind(tmp_path) -> None:
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from tests.support.tiny import make_tiny

    make_tiny(tmp_path / "hf", "llama", tied=True)
    art = open_artifact(convert(tmp_path / "hf", tmp_path / "art", quantization="q0f32", kv_cache="q8",
                                progress=False))
    assert art.config.kv_cache == "q8"
    default = open_artifact(convert(tmp_path / "hf", tmp_path / "default", quantization="q8f16_1", progress=False))
    assert default.config.kv_cache == "f16" and Engine(default, threads=1).cache.kind == "f16"  # llama.cpp's too
    reference = open_artifact(convert(tmp_path / "hf", tmp_path / "ref", quantization="q0f32", progress=False))
    assert reference.config.kv_cache == "f32"  # the all-float32 scheme stays the reference
    assert Engine(art, threads=1).cache.kind == "q8" and Engine(art, threads=1, kv_cache="f32").cache.kind == "f32"
    with pytest.raises(EdgeLLMError, match="unknown KV cache kind 'int4'"):
        convert(tmp_path / "hf", tmp_path / "bad", kv_cache="int4", progress=False)
