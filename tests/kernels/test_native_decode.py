"""The native decode step (edgellm/kernels/csrc/decoder/decode.c) against float64 transformers and torch's path.

The native step computes every matmul on int8 activations with one scale per block of 32
(``el_quantize_act``), so it is compared with a float64 transformers forward of the same
(dequantized) weights whose every nn.Linear input is block-quantized the same way, one step at a
time on the reference's own keys and values. What remains is float32 vs float64 arithmetic (~1e-7
relative per op, a few dozen ops deep: ``MATCH_TOL`` = 1e-4 has two orders of margin) and, now and
then, a rounding tie that this arithmetic flips: one activation moves by a whole quantization step
(amax/127), which moves the logits by up to ~1% in these models (measured: 1e-7 relative noise on
every input moves a 576-wide 2-layer model's logits by up to 0.96%). So most steps must match to
``MATCH_TOL`` and every step to ``FLIP_TOL``. For the same reason two correct implementations may
pick different greedy tokens where the top two logits nearly tie: greedy decoding must agree
wherever the top-2 margin exceeds ``TIE_MARGIN``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.kernels import native
from edgellm.kernels.decoder import NativeDecoder
from edgellm.kernels.threads import default_threads, physical_cores
from edgellm.quant.formats import FORMAT_SUFFIXES, dequantize
from edgellm.families.config import KV_KINDS
from edgellm.models.kv_cache import KVCache, quantize_q8
from edgellm.models.protocol import TORCH, choose
from edgellm.models.transformer import Transformer
from edgellm.runtime.engine import Engine
from edgellm.generation import GenerationParams
from tests.support.tiny import VOCAB, _save_tokenizer

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(native.load_library() is None, reason="no native kernel library on this machine")

MATCH_TOL = 1e-4  # native vs the float64 simulation of the same arithmetic (module doc)
FLIP_TOL = 0.03  # any step: room for a flipped quantization tie (module doc)
MATCHED_SHARE = 0.75  # steps that must match to MATCH_TOL
TIE_MARGIN = 0.5  # logits closer than this may order either way after a flipped tie
# A real model's native step (int8 activations) vs torch's (float): SmolLM2 rows differ by up to 3.2% relative on
# the VNNI kernels and 7.6% on AVX2's (measured at the steps where greedy tokens part); a wrong step is 50-100% off.
REAL_ROW_TOL = 0.15
STEPS = 40


def _make_model(folder: Path, arch: str, *, tied: bool) -> None:
    """A random 2-layer model with GQA (3 heads on 1 KV head), K and N not multiples of 64 (96, 160).

    Weights are scaled up from transformers' init (std 0.02) so logits have clear winners: with tiny
    weights every logit is ~0 and greedy tokens are decided by rounding noise.
    """
    torch.manual_seed(3)
    common = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=3, num_key_value_heads=1, head_dim=32, max_position_embeddings=128,
                  rms_norm_eps=1e-6, tie_word_embeddings=tied, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(rope_theta=10000.0, **common))
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(rope_theta=1000000.0, **common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif "norm" not in name:
                p.mul_(5.0)
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)


@pytest.fixture(scope="module", params=[("llama", True, "q4f16_1"), ("qwen2", False, "q4f16_1"),
                                        ("llama", False, "q8f16_1"), ("qwen2", True, "q4f16_1e8")],
                ids=lambda p: "-".join(str(x) for x in p))
def case(request, tmp_path_factory) -> tuple[Path, Engine]:
    arch, tied, quant = request.param
    root = tmp_path_factory.mktemp(f"{arch}-{quant}")
    _make_model(root / "hf", arch, tied=tied)
    return root, converted_engine(root, quant)


def converted_engine(root: Path, quant: str) -> Engine:
    """A one-thread engine on root/hf converted to `quant` (into root/art), on torch's prefill with native decode
    steps (models/torch_native.py): these tests compare its native decode steps with its torch forward
    (tests/test_native_model.py: the model on the native library alone)."""
    return Engine(open_artifact(convert(root / "hf", root / "art", quantization=quant, progress=False)), threads=1,
                  runtime="torch")


def native_decoder(engine: Engine, lib, pool) -> NativeDecoder:
    """A fresh native decoder over `engine`'s model description, on library `lib` and thread pool `pool`."""
    description = engine.model.description
    return NativeDecoder(lib, description.struct, description, pool)


def _step(engine: Engine, token: int, pos: int, cache) -> torch.Tensor:
    """The logits (1, V) of one token through the engine's model (the native step where it runs)."""
    return torch.from_numpy(engine.model.run([token], pos, cache, all_logits=True))


def _quantize_blocks(x: torch.Tensor) -> torch.Tensor:
    """x rounded as el_quantize_act does: per block of 32, q = rint(x * 127 / amax) (float32), x ~ q * amax / 127."""
    blocks = x.unflatten(-1, (-1, 32))
    amax = blocks.abs().amax(-1, keepdim=True).float()
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks.float() * inv).clamp(-127, 127).double()
    return (q * (amax / 127.0).double()).flatten(-2)


def _reference(root: Path, engine: Engine, ids: list[int], *, quantize_inputs: bool) -> tuple[torch.Tensor, list]:
    """float64 transformers forward with the artifact's weights, dequantized: logits (T, V) and the
    keys/values of every layer, [(keys, values)] each (1, kv_heads, T, head_dim).

    ``quantize_inputs``: every nn.Linear input block-quantized first, as the native kernels do.
    """
    model = transformers.AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float64).eval()
    weights = engine.artifact.weights()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for prefix, fmt in engine.config.quantization.formats.items():
            parts = {s: weights[f"{prefix}.{s}"] for s in FORMAT_SUFFIXES[fmt]}
            params[f"{prefix}.weight"].copy_(dequantize(parts, fmt).double())
        if quantize_inputs:
            for module in model.modules():
                if isinstance(module, torch.nn.Linear):
                    module.register_forward_pre_hook(lambda _, args: (_quantize_blocks(args[0]),))
        # a cache without a config keeps every position of every layer, sliding ones included (as edgellm's)
        out = model(torch.tensor([ids]), use_cache=True, past_key_values=transformers.DynamicCache())
    return out.logits[0], [(layer.keys, layer.values) for layer in out.past_key_values.layers]


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got.double() - expected).norm(dim=-1) / expected.norm(dim=-1)).max().item()


def _steps(engine: Engine, ids: list[int], kind: str = "f32") -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every single-token step from position 0 (T, V), and the keys the `kind` cache then holds."""
    cache = engine.model.new_cache(64, kind=kind)
    logits = torch.cat([_step(engine, t, i, cache) for i, t in enumerate(ids)])
    return logits, cache.keys[:, :, :, : len(ids)].clone()


def _greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    # the raw argmax torch is compared with: no penalty, whatever the model's defaults say
    return engine.generate(prompt, GenerationParams(max_tokens=n, temperature=0.0, repetition_penalty=1.0,
                                                    ignore_eos=True)).token_ids


def test_engine_decodes_natively(case) -> None:
    _, engine = case
    assert engine.model.native is not None
    assert engine.decode_path.startswith("native ")


def test_logits_match_float64_reference(case) -> None:
    root, engine = case
    ids = torch.randint(0, VOCAB - 2, (STEPS,), generator=torch.Generator().manual_seed(5)).tolist()
    expected, kv = _reference(root, engine, ids, quantize_inputs=True)
    cache = engine.model.new_cache(64)
    errors = []
    for pos, token in enumerate(ids):
        for layer, (keys, values) in enumerate(kv):  # the reference's past, so every step stands alone
            cache.keys[layer, :, :, :pos] = keys[:, :, :pos]
            cache.values[layer, :, :, :pos] = values[:, :, :pos]
        errors.append(_relative_error(torch.from_numpy(engine.model.native.step(token, pos, cache))[None],
                                      expected[pos : pos + 1]))
    matched = sum(e <= MATCH_TOL for e in errors) / len(errors)
    assert matched >= MATCHED_SHARE, f"only {matched:.0%} of steps match to {MATCH_TOL:.0e}: {errors}"
    assert max(errors) <= FLIP_TOL, f"a step is off by {max(errors):.4f} relative (bound {FLIP_TOL})"
    scheme = _relative_error(_steps(engine, ids)[0], _reference(root, engine, ids, quantize_inputs=False)[0])
    print(f"activation quantization moves the logits by {scheme:.4f} relative")


def _torch_steps(engine: Engine, ids: list[int], kind: str = "f32") -> tuple[torch.Tensor, KVCache]:
    """Logits of every single-token step on torch's path over a fresh `kind` cache, and the cache."""
    decoder, engine.model.native = engine.model.native, None
    try:
        cache = engine.model.new_cache(64, kind=kind)
        return torch.cat([_step(engine, t, i, cache) for i, t in enumerate(ids)]), cache
    finally:
        engine.model.native = decoder


def _assert_greedy_agrees(engine: Engine, prompt: list[int], n: int, row_tol: float = FLIP_TOL) -> None:
    """Native greedy tokens are torch's (teacher-forced, one token at a time, over the same kind of KV
    cache as the engine's) except at near-ties: where torch's top two are within TIE_MARGIN, or within twice the
    largest logit difference between the two paths' own steps there — the int8 arithmetic of a kernel variant
    (AVX2's saturating pair sums, VNNI's exact ones) may move a logit that far — as long as that difference
    stays within `row_tol` of the row (a wrong native step is far outside it)."""
    tokens = _greedy(engine, prompt, n)
    assert len(tokens) == n
    ids = prompt + tokens[:-1]
    logits, _ = _torch_steps(engine, ids, engine.cache.kind)
    native_logits, _ = _steps(engine, ids, engine.cache.kind)
    rows = zip(tokens, logits[len(prompt) - 1 :], native_logits[len(prompt) - 1 :])
    for step, (token, row, mine) in enumerate(rows):
        best = int(row.argmax())
        if token == best:
            continue
        gap, deviation = float(row[best] - row[token]), float((mine - row).abs().max())
        assert gap <= max(TIE_MARGIN, 2 * deviation), (
            f"step {step}: native chose {token}, torch {best} by a margin of {gap:.3f} (paths differ by {deviation:.3f})")
        assert _relative_error(mine[None], row[None].double()) <= row_tol


def _twin(engine: Engine, kind: str) -> Engine:
    """`engine`'s artifact with the `kind` KV cache, decoding natively."""
    twin = Engine(engine.artifact, kv_cache=kind, threads=1, runtime="torch")
    assert twin.decode_path.startswith("native ") and twin.model.native.accepts(twin.cache)
    return twin


def test_greedy_tokens_match_torch_path(case) -> None:
    _assert_greedy_agrees(case[1], [3, 14, 15, 92, 65], STEPS)


@pytest.mark.parametrize("threads", [2, 3, 4, 2 * (os.cpu_count() or 1) + 1])
def test_every_thread_count_gives_the_same_result(case, threads: int) -> None:
    """Rows are split, never a dot product, so any thread count computes the same bits (over either KV
    cache kind); more threads than cores (the last case) must still finish, with workers descheduled mid-job."""
    _, engine = case
    ids = list(range(10, 10 + 24))
    one = {kind: _steps(engine, ids, kind) for kind in KV_KINDS}
    decoder = engine.model.native
    engine.model.native = native_decoder(engine, native.load_library(), native.pool(threads))
    try:
        assert engine.model.native.threads == threads
        many = {kind: _steps(engine, ids, kind) for kind in KV_KINDS}
    finally:
        engine.model.native.close()
        engine.model.native = decoder
    for kind in one:
        assert torch.equal(one[kind][0], many[kind][0]) and torch.equal(one[kind][1], many[kind][1]), kind


# ------------------------------------------------------------------------ the half and 8-bit KV caches


@pytest.mark.parametrize("kind", ["f16", "q8"])
def test_narrow_cache_steps_run_natively_and_match_torch(case, kind: str) -> None:
    """The native step reads and writes the f16 / q8 cache in place. Given torch's path's past over the
    same kind (every step stands alone, as a key one rounding step off would otherwise carry into every
    later step), its logits are that path's (which reads the halves or int8 keys/values as floats, with
    the same int8 activations in every matmul) to MATCH_TOL on most steps and FLIP_TOL on all, and the
    halves / int8 keys/values and scales it writes are torch's: the keys/values in float differ by float32
    rounding (torch's RoPE and bias adds vs C's), so the stored values are the same but at a rounding tie
    (one step off), and the scales agree to MATCH_TOL but at steps where an activation tie flipped (no more of them than
    MATCHED_SHARE allows the logits). The rounding
    itself is checked bit for bit below."""
    _, engine = case
    ids = torch.randint(0, VOCAB - 2, (STEPS,), generator=torch.Generator().manual_seed(7)).tolist()
    expected, reference = _torch_steps(engine, ids, kind)
    cache = engine.model.new_cache(64, kind=kind)
    assert engine.model.native.accepts(cache)
    names = ("keys", "values") + (("key_scales", "value_scales") if kind == "q8" else ())
    errors, written = [], {name: [] for name in names}
    for pos, token in enumerate(ids):
        for name in written:
            getattr(cache, name)[..., :pos, :] = getattr(reference, name)[..., :pos, :]
        errors.append(_relative_error(_step(engine, token, pos, cache), expected[pos : pos + 1]))
        for name in written:
            written[name].append(getattr(cache, name)[..., pos, :].clone())
    matched = sum(e <= MATCH_TOL for e in errors) / len(errors)
    assert matched >= MATCHED_SHARE, f"only {matched:.0%} of steps match to {MATCH_TOL:.0e}: {errors}"
    assert max(errors) <= FLIP_TOL, f"a step is off by {max(errors):.4f} relative (bound {FLIP_TOL})"
    got = {name: torch.stack(rows, dim=-2) for name, rows in written.items()}  # (layers, 1, kv_heads, T, ·)
    want = {name: getattr(reference, name)[..., : len(ids), :] for name in written}
    for name in ("keys", "values"):
        if kind == "f16":  # a flipped activation tie moves a whole row by up to FLIP_TOL: many halves apart
            assert _relative_error(got[name].float(), want[name].double()) <= FLIP_TOL
            assert (got[name] == want[name]).float().mean() >= 0.95
        else:
            assert (got[name].int() - want[name].int()).abs().max() <= 1
            assert (got[name] == want[name]).float().mean() >= 0.99
    for name in names[2:]:  # a step whose activations flipped a tie may move the scales of every later layer
        relative = (got[name] - want[name]).abs() / want[name]  # (layers, 1, kv_heads, T, 1)
        steps_off = (relative > MATCH_TOL).flatten(0, 2).any(0).float().mean()
        assert relative.max() <= FLIP_TOL and steps_off <= 1 - MATCHED_SHARE, (name, steps_off)


@pytest.mark.parametrize("kind", ["f16", "q8"])
def test_narrow_cache_greedy_tokens_match_torch_path(case, kind: str) -> None:
    """Greedy decoding through an engine over an f16 / q8 cache: native tokens are torch's path's."""
    _assert_greedy_agrees(_twin(case[1], kind), [3, 14, 15, 92, 65], STEPS)


def test_native_half_rounding_is_torch_half_bit_for_bit(case) -> None:
    """el_float_to_half, which the step writes new f16 positions with, against torch's .half(): every
    magnitude from float subnormals to overflow, exact ties in the normal and subnormal half ranges,
    the largest half and the first value that rounds to infinity, zeros, infinities and NaN."""
    lib = native.load_library()  # el_float_to_half declared by kernels/abi.py
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(20000, generator=gen) * torch.logspace(-45, 6, 20000)
    ulp_ties = (torch.randint(1024, 2048, (500,), generator=gen).double() + 0.5) * 2.0 ** -10  # normal ties
    sub_ties = (torch.randint(0, 1024, (500,), generator=gen).double() + 0.5) * 2.0 ** -24  # subnormal ties
    special = torch.tensor([65504.0, 65519.99, 65520.0, 1e6, float("inf"), -float("inf"), 2.0 ** -25,
                            2.0 ** -25 * 1.001, -0.0, 0.0, 1e-45, 2.0 ** -14, float("nan"), -float("nan")])
    x = torch.cat([rows, ulp_ties.float(), -sub_ties.float(), special])
    got = torch.tensor([lib.el_float_to_half(v) for v in x.tolist()], dtype=torch.int32)
    assert torch.equal(got, x.half().view(torch.int16).int() & 0xFFFF)


def test_native_kv_quantization_is_quantize_q8_bit_for_bit(case) -> None:
    """el_kv_quantize, which the step writes new positions with, against kv_cache.quantize_q8 on rows of
    every magnitude, exact rounding ties (amax 127: scale 1, halves round to even), zeros and subnormals."""
    lib = native.load_library()  # its signatures were declared when the fixture's decoder was made
    hd = 64
    gen = torch.Generator().manual_seed(11)
    rows = torch.randn(400, hd, generator=gen) * torch.logspace(-30, 30, 400).unsqueeze(1)
    ties = torch.randint(-126, 126, (50, hd), generator=gen).float() + 0.5
    ties[:, 0] = 127.0
    special = torch.zeros(3, hd)
    special[1, :5] = 1e-40  # subnormal
    special[2, 7] = -3.0
    x = torch.cat([rows, ties, special]).contiguous()
    want_q, want_scale = quantize_q8(x)
    got_q = torch.empty(x.shape, dtype=torch.int8)
    got_scale = torch.empty(x.shape[0], 1)
    for i in range(x.shape[0]):
        lib.el_kv_quantize(x[i].data_ptr(), hd, got_q[i].data_ptr(), got_scale[i].data_ptr())
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_scale, want_scale)


def test_step_outside_the_cache_is_refused(case) -> None:
    _, engine = case
    cache = engine.model.new_cache(4)
    with pytest.raises(ValueError, match="position 4"):
        engine.model.native.step(1, 4, cache)
    with pytest.raises(ValueError, match="token"):
        engine.model.native.step(VOCAB, 0, cache)


def test_unsupported_models_keep_torch(tmp_path: Path) -> None:
    _make_model(tmp_path / "hf", "llama", tied=True)
    art = open_artifact(convert(tmp_path / "hf", tmp_path / "art", quantization="q0f16", progress=False))
    engine = Engine(art, threads=1)
    assert isinstance(engine.model, Transformer) and engine.choice.implementation == TORCH
    assert engine.decode_path == ("torch (weight format f16: native decode takes q4/q8/q4_0/q5_0/q5_1/q2_k/q3_k/q4_k/"
                                  "q5_k/q6_k/iq4_nl)")
    q4 = open_artifact(convert(tmp_path / "hf", tmp_path / "q4", quantization="q4f16_1", progress=False))
    half_kv = Engine(q4, threads=1, kv_dtype=torch.bfloat16)
    assert isinstance(half_kv.model, Transformer) and "attends in float32" in half_kv.decode_path


def test_torch_forced_by_environment(tmp_path: Path, monkeypatch) -> None:
    _make_model(tmp_path / "hf", "qwen2", tied=False)
    art = open_artifact(convert(tmp_path / "hf", tmp_path / "art", quantization="q4f16_1", progress=False))
    monkeypatch.setenv(native.ENV_VAR, "torch")
    for cached in (native.active_kernel, native.load_library):
        cached.cache_clear()
    try:
        engine = Engine(art, threads=1)
        assert isinstance(engine.model, Transformer)
        assert engine.decode_path == f"torch ({native.ENV_VAR}=torch)"
        assert len(_greedy(engine, [1, 2, 3], 8)) == 8
    finally:
        monkeypatch.delenv(native.ENV_VAR)
        for cached in (native.active_kernel, native.load_library):
            cached.cache_clear()


def test_choose_reports_why_not(case) -> None:
    _, engine = case
    choice = choose(engine.config, "torch", torch.float16)
    assert choice.implementation == TORCH and choice.decode.startswith("torch (") and "float32" in choice.decode


# ---------------------------------------------------------------------------------- thread policy


def _topology(root: Path, cores: list[tuple[int, int]]) -> Path:
    """A fake /sys/devices/system/cpu: logical cpu i on (package, core) cores[i]."""
    for cpu, (package, core) in enumerate(cores):
        d = root / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text(f"{package}\n")
        (d / "core_id").write_text(f"{core}\n")
    return root


def test_default_threads_counts_physical_cores_and_load(tmp_path: Path) -> None:
    smt = _topology(tmp_path / "smt", [(0, 0), (0, 1), (0, 0), (0, 1)])  # 2 cores, 2 threads each
    assert physical_cores({0, 1, 2, 3}, smt) == 2
    assert physical_cores({0, 2}, smt) == 1
    assert default_threads(0.0, {0, 1, 2, 3}, smt) == 2
    assert default_threads(0.7, {0, 1, 2, 3}, smt) == 1  # one core about busy
    assert default_threads(20.0, {0, 1, 2, 3}, smt) == 1  # never below one
    four = _topology(tmp_path / "four", [(0, 0), (0, 1), (1, 0), (1, 1)])
    assert default_threads(1.2, {0, 1, 2, 3}, four) == 3
    assert physical_cores({0, 1}, tmp_path / "missing") == 2  # unreadable topology: logical CPUs


# ---------------------------------------------------------------------------------- the real model


@pytest.mark.parametrize("prompt", ["The capital of France is", "def fibonacci(n):", "List three colors:"])
def test_smollm2_native_matches_torch_greedy(smollm2_engine: Engine, prompt: str) -> None:
    assert smollm2_engine.model.native is not None
    _assert_greedy_agrees(smollm2_engine, smollm2_engine.encode(prompt), 24, REAL_ROW_TOL)


@pytest.mark.parametrize("kind", KV_KINDS)
def test_smollm2_native_cache_kinds_match_torch_greedy(smollm2_engine: Engine, kind: str) -> None:
    twin = _twin(smollm2_engine, kind)
    _assert_greedy_agrees(twin, twin.encode("def fibonacci(n):"), 24, REAL_ROW_TOL)


@pytest.fixture(scope="module")
def smollm2_engine() -> Engine:
    return Engine.load("smollm2-135m", quantization="q4f16_1", progress=False, threads=1, runtime="torch")


def test_info_names_the_decode_step(case, capsys) -> None:
    from edgellm.cli import main

    _, engine = case
    assert main(["info", str(engine.artifact.folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_step"] == f"native {native.active_kernel()[0]}"


def test_two_decoders_share_a_pool_from_two_threads(case) -> None:
    """Two engines of one process get the same pool for the same thread count; their steps interleave."""
    import threading

    _, engine = case
    ids = list(range(20, 44))
    expected, _ = _steps(engine, ids)
    decoders = [native_decoder(engine, native.load_library(), native.pool(2)) for _ in range(2)]
    results: list[torch.Tensor | None] = [None, None]

    def run(i: int) -> None:
        cache = engine.model.new_cache(64)
        results[i] = torch.stack([torch.from_numpy(decoders[i].step(t, pos, cache)) for pos, t in enumerate(ids)])

    workers = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    for d in decoders:
        d.close()
    assert all(torch.equal(r, expected) for r in results)


def test_logits_step_from_scores_the_decode_path(case) -> None:
    """Engine.logits(ids, step_from=k) (what `eval quality --path decode` scores): rows before k come from
    the prefill chunks, bit for bit as without step_from; rows from k on are native single-token steps
    (within a few % of steps taken from position 0, whose keys/values for positions < k differ by the
    prefill's bf16 vs the steps' int8 activations; and not the prefill's own rows)."""
    _, engine = case
    ids = torch.randint(0, VOCAB - 2, (STEPS,), generator=torch.Generator().manual_seed(9)).tolist()
    k = min(engine.prefill_chunk, STEPS // 2)
    engine.prefill_chunk = k  # chunks end at k either way
    prefill, decode = engine.logits(ids), engine.logits(ids, step_from=k)
    assert torch.equal(prefill[:k], decode[:k])
    steps, _ = _steps(engine, ids)
    assert _relative_error(decode[k:], steps[k:].double()) < 0.1
    assert not torch.equal(decode[k:], prefill[k:])
    with pytest.raises(Exception, match="path must be one of prefill, decode"):
        from edgellm.eval.quality import Scorer, evaluate_quality
        scorer = Scorer("x", "q", 0, engine.logits, VOCAB, engine=engine)
        evaluate_quality(scorer, [scorer], [], path="bogus")
