"""`edgellm compress` on tiny random models: pruned shapes valid in transformers and in our converter, pruning
checked against models rebuilt by hand, the distillation loss against a float64 KL, loss going down, checkpoints
that resume the same run exactly, a teacher cache that refuses damage, two data-parallel workers matching one, the
hidden-state loss against the layer map and a float64 reference, and quantization-aware tuning through the
converter's own quantizer and fitted grids."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

from edgellm.compress import distill, qat, teacher_cache
from edgellm.compress.corpus import sample_windows, token_windows
from edgellm.compress.importance import (angular_distances, block_influence, decoder_layers, mean_kl,
                                        next_token_log_probs)
from edgellm.compress.pipeline import CompressOptions, compress, prepare, work_dir
from edgellm.compress.prune import PrunePlan, apply_plan, merge_targets, plan_pruning
from edgellm.compress.source import CompressError, load_float_model
from edgellm.quant.formats import dequantize, q4_fields, quantize, row_blocks
from tests.support.tiny import VOCAB, _save_tokenizer

LAYERS = 4


def _tiny(folder: Path, arch: str = "llama", seed: int = 0) -> Path:
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6,
                  tie_word_embeddings=True, bos_token_id=VOCAB - 2, eos_token_id=VOCAB - 1)
    cfg = (transformers.LlamaConfig(rope_theta=50000.0, **common) if arch == "llama"
           else transformers.Qwen2Config(rope_theta=1e6, **common))
    model = (transformers.LlamaForCausalLM if arch == "llama" else transformers.Qwen2ForCausalLM)(cfg)
    model.save_pretrained(folder, safe_serialization=True)
    _save_tokenizer(folder)
    return folder


def _text(path: Path, seed: int, words: int = 3000) -> Path:
    """A sample of one Markov chain over the tiny vocabulary (structure for the student to learn); ``seed`` draws
    the sample, so held-out text is new text of the same kind."""
    nxt = np.random.default_rng(0).integers(1, VOCAB - 2, size=(VOCAB, 3))
    rng = np.random.default_rng(seed)
    w, out = 1, []
    for _ in range(words):
        w = int(nxt[w, rng.integers(0, 3)]) if rng.random() < 0.9 else int(rng.integers(1, VOCAB - 2))
        out.append(f"t{w}")
    path.write_text(" ".join(out))
    return path


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tiny(tmp_path_factory.mktemp("compress") / "hf")


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("texts")
    return _text(root / "train.txt", 1), _text(root / "heldout.txt", 2, words=600)


def _windows(tiny: Path, text: Path, n: int = 8, length: int = 32) -> torch.Tensor:
    return token_windows(load_float_model(tiny).tokenizer, [text.read_text()], length)[:n]


def test_dropping_layers_equals_the_model_rebuilt_without_them(tiny: Path, texts: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    src = load_float_model(tiny)
    windows = _windows(tiny, texts[0])
    pruned = apply_plan(load_float_model(tiny).model, PrunePlan(drop_layers=[1, 2]), windows)
    # the reference: a fresh 2-layer model of the same config, given layers 0 and 3's weights by name
    cfg = transformers.LlamaConfig.from_pretrained(tiny)
    cfg.num_hidden_layers = 2
    if isinstance(getattr(cfg, "layer_types", None), list):
        cfg.layer_types = cfg.layer_types[:2]
    ref = transformers.LlamaForCausalLM(cfg).eval()
    state = src.model.state_dict()
    mapping = {"model.layers.1.": "model.layers.3."}
    ref.load_state_dict({k: state[next((k.replace(a, b) for a, b in mapping.items() if k.startswith(a)), k)]
                         for k in ref.state_dict()})
    with torch.no_grad():
        assert torch.equal(pruned(windows).logits, ref(windows).logits)
    out = load_float_model(tiny)
    out.model = pruned
    out.save(tmp_path / "pruned")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned")
    assert reloaded.config.num_hidden_layers == 2
    with torch.no_grad():
        assert torch.equal(reloaded(windows).logits, ref(windows).logits)


@pytest.mark.parametrize("idle", [2, 3])  # 3: the last layer, whose output is compared before the final norm
def test_layer_ranking_drops_a_layer_that_does_nothing(tiny: Path, texts: tuple[Path, Path], idle: int) -> None:
    model = load_float_model(tiny).model
    layer = decoder_layers(model)[idle]  # outputs zero into the residual: the block is an identity
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.uniform_(0.5, 1.5)  # the final norm turns the stream (a random model's does not)
    windows = _windows(tiny, texts[0])
    scores = block_influence(model, windows)
    assert scores[idle] == pytest.approx(0.0, abs=1e-9)
    assert min(s for i, s in enumerate(scores) if i != idle) > 1e-4
    for rank in ("influence", "kl"):
        assert plan_pruning(model, windows, drop_layers=1, rank=rank).drop_layers == [idle]
    with pytest.raises(CompressError, match="can drop 0 to 3"):
        plan_pruning(model, windows, drop_layers=4)


def _angular_reference(model: torch.nn.Module, windows: torch.Tensor, block: int) -> list[float]:
    """Float64 numpy: the residual stream captured by hooks on the decoder layers (each one's input, and the last
    one's output), the mean over all tokens of arccos(cos) / pi between depths l and l + block."""
    layers = decoder_layers(model)
    states: list[list[np.ndarray]] = [[] for _ in range(len(layers) + 1)]
    handles = [m.register_forward_pre_hook(lambda _m, args, i=i: states[i].append(args[0][0].double().numpy()))
               for i, m in enumerate(layers)]
    handles.append(layers[-1].register_forward_hook(
        lambda _m, _a, out: states[-1].append((out[0] if isinstance(out, tuple) else out)[0].double().numpy())))
    with torch.no_grad():
        for w in windows:
            model(w[None])
    for h in handles:
        h.remove()
    flat = [np.concatenate(s) for s in states]
    out = []
    for start in range(len(layers) - block + 1):
        a, b = flat[start], flat[start + block]
        cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
        out.append(float(np.mean(np.arccos(np.clip(cos, -1, 1)) / np.pi)))
    return out


@pytest.mark.parametrize("block", [(1, 2), (2, 3)])
def test_angular_ranking_drops_the_block_that_does_nothing(tiny: Path, texts: tuple[Path, Path],
                                                           block: tuple[int, ...]) -> None:
    model = load_float_model(tiny).model
    with torch.no_grad():  # these layers add nothing to the residual stream: the block is an identity
        for i in block:
            decoder_layers(model)[i].self_attn.o_proj.weight.zero_()
            decoder_layers(model)[i].mlp.down_proj.weight.zero_()
    windows = _windows(tiny, texts[0], n=4)
    distances = angular_distances(model, windows, len(block))
    assert distances == pytest.approx(_angular_reference(model, windows, len(block)), rel=1e-6, abs=1e-9)
    start = block[0]
    assert distances[start] == pytest.approx(0.0, abs=1e-6)
    assert min(d for i, d in enumerate(distances) if i != start) > 1e-3
    plan = plan_pruning(model, windows, drop_layers=len(block), rank="angular")
    assert plan.drop_layers == list(block) and plan.scores["block_angular"] == distances
    with pytest.raises(CompressError, match="a block of 1 to 4 layers, not 5"):
        angular_distances(model, windows, 5)


def test_cli_dry_run_shows_the_angular_distances(tiny: Path, texts: tuple[Path, Path]) -> None:
    run = subprocess.run([sys.executable, "-m", "edgellm", "compress", str(tiny), "--corpus", str(texts[0]),
                          "--heldout", str(texts[1]), "--seq-len", "32", "--calib-windows", "4", "--drop-layers", "2",
                          "--rank", "angular", "--merge", "mean", "--dry-run"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    at = lines.index("angular distance of the block of 2 starting at each layer:")
    rows = [line.split() for line in lines[at + 1 : at + 4]]
    assert [r[0] for r in rows] == ["0..1", "1..2", "2..3"] and all(0 < float(r[1]) < 1 for r in rows)
    assert lines[0].startswith("drop layers") and lines[0].endswith("(merged: mean)")


def _merge_reference(state: dict[str, torch.Tensor], keep: int, dropped: list[int], rule: str,
                     name: str) -> np.ndarray:
    base = state[f"model.layers.{keep}.{name}"].double().numpy()
    others = [state[f"model.layers.{d}.{name}"].double().numpy() for d in dropped]
    if rule == "sum":
        return base + np.sum([o - base for o in others], axis=0)
    return (base + np.sum(others, axis=0)) / (1 + len(others))


@pytest.mark.parametrize("rule", ["sum", "mean"])
def test_merging_folds_the_dropped_layers_into_their_kept_neighbour_and_converts(
        rule: str, texts: tuple[Path, Path], tmp_path: Path) -> None:
    folder = _tiny(tmp_path / "hf", seed=3)
    src = load_float_model(folder)
    state = {k: v.clone() for k, v in src.model.state_dict().items()}
    windows = _windows(folder, texts[0], n=4)
    assert merge_targets(4, [1, 2]) == {0: [1, 2]} and merge_targets(4, [0, 3]) == {1: [0], 2: [3]}
    plan = plan_pruning(src.model, windows, drop_layers=2, rank="angular", merge=rule)
    plan.drop_layers = [0, 2]  # layer 0 goes into layer 1 (no kept layer below it), layer 2 into layer 1 as well
    apply_plan(src.model, plan, windows)
    merged = src.model.state_dict()
    for name in [k[len("model.layers.1."):] for k in state if k.startswith("model.layers.1.")]:
        expect = _merge_reference(state, 1, [0, 2], rule, name)
        np.testing.assert_allclose(merged[f"model.layers.0.{name}"].double().numpy(), expect, rtol=1e-6, atol=1e-7)
        assert torch.equal(merged[f"model.layers.1.{name}"], state[f"model.layers.3.{name}"])  # untouched
    src.save(tmp_path / "merged")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert reloaded.config.num_hidden_layers == 2
    with torch.no_grad():
        theirs = reloaded(windows[:1]).logits[0]
        assert torch.equal(theirs, src.model(windows[:1]).logits[0])
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    engine = Engine(open_artifact(convert(tmp_path / "merged", tmp_path / "art", quantization="q0f32",
                                          progress=False)), threads=1)
    ours = engine.logits(windows[0].tolist())
    engine.close()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_merged_run_reports_the_plain_drop_beside_it(tiny: Path, texts: tuple[Path, Path], tmp_path: Path) -> None:
    opts = CompressOptions(corpus=[texts[0]], heldout=[texts[1]], drop_layers=2, rank="angular", merge="mean",
                           seq_len=32, calib_windows=4)
    report = compress(tiny, tmp_path / "out", opts)
    teacher, _, plan, train_w, held_w = prepare(tiny, opts)
    plain = apply_plan(load_float_model(tiny).model, PrunePlan(drop_layers=plan.drop_layers), train_w[:4])
    reference = next_token_log_probs(teacher.model, held_w)
    assert report.kl_plain_drop == pytest.approx(mean_kl(reference, next_token_log_probs(plain, held_w)), rel=1e-6)
    assert report.kl_before != pytest.approx(report.kl_plain_drop, rel=1e-3)
    with pytest.raises(CompressError, match="--merge must be one of sum, mean"):
        plan_pruning(teacher.model, train_w[:2], drop_layers=1, merge="average")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_width_pruning_removes_what_contributes_nothing_and_converts(arch: str, texts: tuple[Path, Path],
                                                                     tmp_path: Path) -> None:
    folder = _tiny(tmp_path / "hf", arch)
    src = load_float_model(folder)
    model = src.model
    with torch.no_grad():  # channels 32..63 of every MLP and key-value group 1 add nothing to the output
        for layer in decoder_layers(model):
            layer.mlp.down_proj.weight[:, 32:64] = 0
            layer.self_attn.o_proj.weight[:, 32:64] = 0  # query heads 2 and 3 (group 1, head_dim 16)
    windows = _windows(folder, texts[0])
    with torch.no_grad():
        before = model(windows).logits
    plan = plan_pruning(model, windows, mlp_keep=96, kv_groups_keep=1)
    apply_plan(model, plan, windows)
    layer = decoder_layers(model)[0]
    assert layer.mlp.down_proj.weight.shape == (64, 96) and layer.self_attn.k_proj.weight.shape == (16, 64)
    assert model.config.num_attention_heads == 2 and model.config.num_key_value_heads == 1
    with torch.no_grad():
        torch.testing.assert_close(model(windows).logits, before, rtol=0, atol=2e-5)
    src.save(tmp_path / "pruned")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "pruned").eval()
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    engine = Engine(open_artifact(convert(tmp_path / "pruned", tmp_path / "art", quantization="q0f32",
                                          progress=False)), threads=1)
    ids = windows[0].tolist()
    ours = engine.logits(ids)
    engine.close()
    with torch.no_grad():
        theirs = reloaded(windows[:1]).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_width_arguments_are_checked(tiny: Path, texts: tuple[Path, Path]) -> None:
    model = load_float_model(tiny).model
    windows = _windows(tiny, texts[0], n=2)
    with pytest.raises(CompressError, match="multiple of 32"):
        plan_pruning(model, windows, mlp_keep=100)
    with pytest.raises(CompressError, match="kv-groups-keep must be 1..2"):
        plan_pruning(model, windows, kv_groups_keep=3)


def test_kd_loss_is_the_kl_of_the_coarsened_distributions() -> None:
    torch.manual_seed(1)
    student, teacher = torch.randn(2, 5, 50), torch.randn(2, 5, 50) * 2
    lp = torch.log_softmax(teacher.double(), -1)
    full = teacher_cache.TeacherTargets(lp.float().topk(50, -1).values, lp.topk(50, -1).indices)
    q = torch.log_softmax(student.double(), -1)
    reference = (lp.exp() * (lp - q)).sum(-1).mean()  # k = V: the exact KL, in float64
    assert float(distill.kd_loss(student, full)) == pytest.approx(float(reference), rel=1e-5)
    top = lp.topk(7, -1)
    part = teacher_cache.TeacherTargets(top.values.float(), top.indices)
    qt = q.gather(-1, top.indices)
    pt, qtail = top.values.exp().sum(-1), qt.exp().sum(-1)
    coarse = ((top.values.exp() * (top.values - qt)).sum(-1) + (1 - pt) * ((1 - pt).log() - (1 - qtail).log()))
    assert float(distill.kd_loss(student, part)) == pytest.approx(float(coarse.mean()), rel=1e-5)
    assert 0 <= float(distill.kd_loss(student, part)) <= float(reference)  # coarsening never adds divergence


def test_learning_rate_schedule() -> None:
    cfg = distill.TrainConfig(steps=110, lr=1e-3, warmup=10)
    assert distill.learning_rate(cfg, 0) == pytest.approx(1e-4) and distill.learning_rate(cfg, 9) == pytest.approx(1e-3)
    assert distill.learning_rate(cfg, 60) == pytest.approx(5e-4) and distill.learning_rate(cfg, 110) == pytest.approx(0)
    with pytest.raises(CompressError, match="multiple of accumulate"):
        distill.TrainConfig(steps=1, batch=6, accumulate=4)


def _opts(texts: tuple[Path, Path], **kw: object) -> CompressOptions:
    base: dict[str, object] = dict(corpus=[texts[0]], heldout=[texts[1]], seq_len=32, calib_windows=8, top_k=VOCAB)
    return CompressOptions(**(base | kw))  # type: ignore[arg-type]


def test_healing_recovers_the_pruning_loss_and_resumes_exactly(tiny: Path, texts: tuple[Path, Path],
                                                               tmp_path: Path) -> None:
    cfg = distill.TrainConfig(steps=40, batch=4, lr=3e-4, warmup=4, checkpoint_every=5)
    opts = _opts(texts, drop_layers=1, train=cfg)
    whole = compress(tiny, tmp_path / "whole", opts)
    assert whole.steps == 40 and whole.kl_after is not None and whole.kl_before > 0
    assert whole.kl_after < 0.75 * whole.kl_before  # on held-out text (measured: 0.0081 -> 0.0048)
    assert np.mean(whole.losses[-5:]) < np.mean(whole.losses[:5])
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "whole")
    assert reloaded.config.num_hidden_layers == LAYERS - 1
    report = json.loads((tmp_path / "whole.report.json").read_text())
    assert report["kl_after"] == pytest.approx(whole.kl_after)
    # interrupted after 17 steps (the checkpoint holds 15), then the same run again: the same curve, step for step
    first = compress(tiny, tmp_path / "cut", opts, stop_after=17)
    assert first.steps == 17 and not (tmp_path / "cut").exists()
    resumed = compress(tiny, tmp_path / "cut", opts)
    assert resumed.losses[:15] == first.losses[:15]
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    other = _opts(texts, drop_layers=1, train=distill.TrainConfig(steps=41, batch=4, lr=3e-4, warmup=4))
    with pytest.raises(CompressError, match="belongs to a run with other settings"):
        compress(tiny, tmp_path / "whole", other)


def test_freezing_the_lower_layers_trains_only_the_upper_ones(tiny: Path, texts: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    teacher = load_float_model(tiny).model
    student = load_float_model(tiny).model
    apply_plan(student, PrunePlan(drop_layers=[2]), _windows(tiny, texts[0]))
    windows = _windows(tiny, texts[0], n=8)
    targets = teacher_cache.compute(teacher, windows, VOCAB)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    cfg = distill.TrainConfig(steps=8, batch=4, lr=3e-3, warmup=1, freeze_below=2)
    log = distill.train(student, windows, targets, cfg, tmp_path / "run")
    after = student.state_dict()
    fixed = [k for k in before if k.startswith(("model.embed_tokens.", "lm_head.", "model.layers.0.",
                                                "model.layers.1."))]
    trained = [k for k in before if k.startswith("model.layers.2.") and k.endswith("proj.weight")]
    assert fixed and trained
    assert all(torch.equal(before[k], after[k]) for k in fixed)
    assert all(not torch.equal(before[k], after[k]) for k in trained)
    assert np.mean(log.losses[-2:]) < np.mean(log.losses[:2])
    with pytest.raises(CompressError, match="--freeze-below must be 0 to 2"):
        distill.train(student, windows, targets, distill.TrainConfig(steps=1, batch=4, freeze_below=3),
                      tmp_path / "other")


def test_teacher_cache_refuses_damage_and_mismatch(tiny: Path, texts: tuple[Path, Path], tmp_path: Path) -> None:
    teacher = load_float_model(tiny).model
    windows = _windows(tiny, texts[0], n=3)
    digest = teacher_cache.weights_digest(teacher)
    targets = teacher_cache.compute(teacher, windows, 8)
    folder = tmp_path / "cache"
    assert teacher_cache.load(folder, windows, digest, 8) is None
    teacher_cache.save(folder, targets, windows, digest)
    again = teacher_cache.load(folder, windows, digest, 8)
    assert again is not None and torch.equal(again.log_probs, targets.log_probs)
    with pytest.raises(CompressError, match="other windows or another --top-k"):
        teacher_cache.load(folder, windows, digest, 16)
    with pytest.raises(CompressError, match="another teacher"):
        teacher_cache.load(folder, windows, "0" * 64, 8)
    data = bytearray((folder / "log_probs.npy").read_bytes())
    data[-3] ^= 0x40
    (folder / "log_probs.npy").write_bytes(bytes(data))
    with pytest.raises(CompressError, match="fails its checksum"):
        teacher_cache.load(folder, windows, digest, 8)


def test_two_data_parallel_workers_match_one(tiny: Path, texts: tuple[Path, Path], tmp_path: Path) -> None:
    cfg = distill.TrainConfig(steps=6, batch=4, lr=3e-3, warmup=2, checkpoint_every=3)
    one = compress(tiny, tmp_path / "one", _opts(texts, drop_layers=1, train=cfg))
    two = compress(tiny, tmp_path / "two", _opts(texts, drop_layers=1, train=cfg, workers=2))
    np.testing.assert_allclose(two.losses, one.losses, rtol=1e-4)
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "one").state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "two").state_dict()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-4, atol=1e-5)


def test_fake_quant_is_the_converters_rounding_and_tuning_helps(tiny: Path, texts: tuple[Path, Path],
                                                                tmp_path: Path) -> None:
    model = load_float_model(tiny).model
    windows = _windows(tiny, texts[0], n=2)
    expected = {n: dequantize(quantize(p.detach(), "q4"), "q4") for n, p in model.named_parameters() if p.dim() == 2}
    assert qat.attach(model, "q4f16_1") == LAYERS * 7 + 2  # 7 linears a layer, the embedding and the head...
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.parametrizations.weight.original is embedding.parametrizations.weight.original  # ...still one weight
    q_proj = decoder_layers(model)[0].self_attn.q_proj
    assert torch.equal(q_proj.weight, expected["model.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(model.get_output_embeddings().weight, expected["model.embed_tokens.weight"])
    loss = model(windows).logits.square().mean()
    loss.backward()  # straight through: the float weight gets the gradient
    assert q_proj.parametrizations.weight.original.grad is not None
    qat.detach(model)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    # tuned for q4f16_1: once converted at q4f16_1, closer to the float model than the untuned conversion
    cfg = distill.TrainConfig(steps=12, batch=4, lr=1e-5, warmup=2)  # measured: KL 0.00036 -> 0.00031
    report = compress(tiny, tmp_path / "qat", _opts(texts, qat="q4f16_1", qat_tune="weights", train=cfg))
    assert report.kl_after is not None and report.kl_after < report.kl_before
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    held = _windows(tiny, texts[1], n=4)
    reference = next_token_log_probs(load_float_model(tiny).model, held)

    def converted_kl(folder: Path, name: str) -> float:
        engine = Engine(open_artifact(convert(folder, tmp_path / name, quantization="q4f16_1", progress=False)),
                        threads=1)
        lp = torch.stack([torch.log_softmax(engine.logits(w.tolist()).float(), -1) for w in held])
        engine.close()
        return mean_kl(reference, lp)

    untuned, tuned = converted_kl(tiny, "plain-q4"), converted_kl(tmp_path / "qat", "tuned-q4")
    assert tuned < untuned, (tuned, untuned)


def test_cli_dry_run_errors_and_kill_then_resume(tiny: Path, texts: tuple[Path, Path], tmp_path: Path) -> None:
    base = [sys.executable, "-m", "edgellm", "compress", str(tiny), "--corpus", str(texts[0]),
            "--heldout", str(texts[1]), "--seq-len", "32", "--calib-windows", "4", "--top-k", "8"]
    dry = subprocess.run([*base, "--drop-layers", "1", "--dry-run", "--json"], capture_output=True, text=True,
                         timeout=300)
    assert dry.returncode == 0, dry.stderr
    info = json.loads(dry.stdout)
    assert len(info["plan"]["drop_layers"]) == 1 and info["predicted_decode_speedup"] > 1.0
    bad = subprocess.run([*base, "--drop-layers", "9", "--dry-run"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 1 and bad.stderr.strip().splitlines() == [
        "edgellm: error: can drop 0 to 3 of the model's 4 layers, not 9"]
    no_out = subprocess.run(base, capture_output=True, text=True, timeout=300)
    assert no_out.returncode == 1 and "needs --output" in no_out.stderr and "Traceback" not in no_out.stderr
    out = tmp_path / "student"
    train = [*base, "--drop-layers", "1", "-o", str(out), "--steps", "400", "--batch", "2", "--lr", "1e-3",
             "--checkpoint-every", "2", "--json"]
    proc = subprocess.Popen(train, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = work_dir(out) / "checkpoint" / "log.json"
    deadline = time.monotonic() + 300
    while not (log.is_file() and json.loads(log.read_text())["step"] >= 4):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    cut = json.loads(log.read_text())
    assert 4 <= cut["step"] < 400 and not out.exists()
    done = subprocess.run(train, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["steps"] == 400 and report["losses"][: cut["step"]] == cut["losses"]


def test_window_sample_is_seeded_spread_and_in_corpus_order() -> None:
    windows = torch.arange(400).view(100, 4)
    a = sample_windows(windows, 10, seed=3)
    assert torch.equal(a, sample_windows(windows, 10, seed=3)) and len(a) == 10
    firsts = a[:, 0] // 4
    assert torch.equal(firsts, firsts.sort().values) and len(set(firsts.tolist())) == 10
    assert int(firsts.max()) >= 50  # drawn over the whole corpus, not its first windows
    assert not torch.equal(a, sample_windows(windows, 10, seed=4))
    assert sample_windows(windows, None, 0) is windows and sample_windows(windows, 500, 0) is windows
    with pytest.raises(CompressError, match="--max-windows must be at least 1"):
        sample_windows(windows, 0, 0)


def test_hidden_state_loss_matches_each_kept_layer_to_the_depth_it_came_from(tiny: Path,
                                                                              texts: tuple[Path, Path]) -> None:
    teacher = load_float_model(tiny).model
    layer = decoder_layers(teacher)[1]  # an identity block: dropping it leaves every later hidden state the same
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    windows = _windows(tiny, texts[0], n=2)
    student = apply_plan(load_float_model(tiny).model, PrunePlan(drop_layers=[1]), windows)
    hidden = distill.HiddenTeacher(teacher, [0, 2, 3])
    with torch.no_grad():
        hs = student(windows, output_hidden_states=True).hidden_states
        ht = teacher(windows, output_hidden_states=True).hidden_states
    assert float(distill.hidden_loss(hs, ht, hidden.pairs())) < 1e-10
    assert hidden.pairs() == [(1, 1), (2, 3)]
    # against a float64 reference: the mean over pairs of the positions' relative squared error
    noisy = tuple(h + 0.1 * torch.randn_like(h) for h in hs)
    ref = np.mean([(((noisy[a].double() - ht[b].double()) ** 2).sum(-1) / (ht[b].double() ** 2).sum(-1)).mean()
                   for a, b in hidden.pairs()])
    assert float(distill.hidden_loss(noisy, ht, hidden.pairs())) == pytest.approx(float(ref), rel=1e-5)


def test_hidden_state_loss_trains_and_is_checked(tiny: Path, texts: tuple[Path, Path], tmp_path: Path) -> None:
    teacher = load_float_model(tiny).model
    windows = _windows(tiny, texts[0], n=8)
    targets = teacher_cache.compute(teacher, windows, VOCAB)
    hidden = distill.HiddenTeacher(teacher, [0, 2, 3])

    def mismatch(student: transformers.PreTrainedModel) -> float:
        with torch.no_grad():
            hs = student(windows, output_hidden_states=True).hidden_states
            ht = teacher(windows, output_hidden_states=True).hidden_states
        return float(distill.hidden_loss(hs, ht, hidden.pairs()))

    results = {}
    for weight in (0.0, 1.0):
        student = apply_plan(load_float_model(tiny).model, PrunePlan(drop_layers=[1]), windows)
        before = mismatch(student)
        cfg = distill.TrainConfig(steps=16, batch=4, lr=1e-3, warmup=2, hidden_weight=weight)
        log = distill.train(student, windows, targets, cfg, tmp_path / f"run-{weight}", hidden=hidden)
        results[weight] = mismatch(student)
        assert np.mean(log.losses[-4:]) < np.mean(log.losses[:4])
    assert results[1.0] < 0.5 * before and results[1.0] < results[0.0]
    with pytest.raises(CompressError, match="needs the teacher"):
        distill.train(student, windows, targets, distill.TrainConfig(steps=1, batch=4, hidden_weight=1.0),
                      tmp_path / "no-teacher")
    with pytest.raises(CompressError, match="the layer map names 4 layers"):
        distill.train(student, windows, targets, distill.TrainConfig(steps=1, batch=4, hidden_weight=1.0),
                      tmp_path / "bad-map", hidden=distill.HiddenTeacher(teacher, [0, 1, 2, 3]))
    with pytest.raises(CompressError, match="hidden_weight must be >= 0"):
        distill.TrainConfig(steps=1, hidden_weight=-1.0)
    opts = _opts(texts, drop_layers=1, train=distill.TrainConfig(steps=2, batch=4, hidden_weight=1.0), workers=2)
    with pytest.raises(CompressError, match="one worker only"):
        compress(tiny, tmp_path / "two", opts)


def test_heldout_kl_fits_a_tuned_models_grid_once_for_all_windows(tiny: Path, texts: tuple[Path, Path],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from edgellm.compress import pipeline

    teacher, student = load_float_model(tiny).model, load_float_model(tiny).model
    held = _windows(tiny, texts[1], n=4)
    reference = next_token_log_probs(teacher, held)
    plain = load_float_model(tiny).model
    with torch.no_grad():  # the reference: the converter's weights written in by hand
        for m in plain.modules():
            if isinstance(m, torch.nn.Linear) or isinstance(m, torch.nn.Embedding):
                m.weight.copy_(dequantize(quantize(m.weight, "q4"), "q4"))
    weights = qat.attach(student, "q4f16_1")
    calls = []
    real = qat._fit
    monkeypatch.setattr(qat, "_fit", lambda w, fmt: calls.append(fmt) or real(w, fmt))
    kl = pipeline._heldout_kl(reference, student, held)
    assert len(calls) == weights  # the converter's search once per weight, not once per window
    assert kl == pytest.approx(mean_kl(reference, next_token_log_probs(plain, held)), rel=1e-5)
    qat.refit(student)
    pipeline._heldout_kl(reference, student, held)
    assert len(calls) == 2 * weights


@pytest.mark.parametrize("fmt", ["q4", "q8"])
def test_rounding_on_a_fitted_grid_is_the_converters_until_the_weight_moves(fmt: str) -> None:
    torch.manual_seed(0)
    w = torch.randn(64, 96) * 0.05
    stored = dequantize(quantize(w, fmt), fmt)
    fake = qat.FakeQuant(fmt)
    assert torch.equal(fake.quantized(w), stored)  # the first use fits, as the converter does
    assert torch.equal(fake.quantized(w), stored)  # later uses round on that grid: the same for the same weight
    grid = fake.grid
    assert grid is not None
    moved = w + 1e-3 * torch.randn_like(w)
    on_grid = fake.quantized(moved)  # the old grid: each weight at its nearest level q * scale (+ min)
    scale = grid[0].expand(64, 3, 32).reshape(64, 96).double()
    low = torch.zeros_like(scale) if grid[1] is None else grid[1].expand(64, 3, 32).reshape(64, 96).double()
    q = torch.arange(0, 16) if fmt == "q4" else torch.arange(-127, 128)
    levels = low[..., None] + scale[..., None] * q.double()  # float64 reference: the nearest of all levels
    nearest = levels.gather(-1, (levels - moved.double()[..., None]).abs().argmin(-1, keepdim=True))[..., 0]
    torch.testing.assert_close(on_grid.double(), nearest, rtol=0, atol=1e-6)
    assert not torch.equal(on_grid, stored)
    model_refit = torch.nn.Linear(96, 64, bias=False)
    with torch.no_grad():
        model_refit.weight.copy_(moved)
    parametrize = torch.nn.utils.parametrize
    parametrize.register_parametrization(model_refit, "weight", fake, unsafe=True)
    qat.refit(model_refit)  # a fresh fit: exactly the converter's weight for the moved one
    assert torch.equal(model_refit.weight, dequantize(quantize(moved, fmt), fmt))


def test_quantization_aware_tuning_refits_and_resumes_on_the_same_grids(tiny: Path, texts: tuple[Path, Path],
                                                                       tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = distill.TrainConfig(steps=10, batch=4, lr=1e-2, warmup=2, checkpoint_every=4, refit_every=2)
    opts = _opts(texts, qat="q4f16_1", qat_tune="weights", train=cfg)
    fits = []
    real = qat._fit
    monkeypatch.setattr(qat, "_fit", lambda w, fmt: fits.append(fmt) or real(w, fmt))
    whole = compress(tiny, tmp_path / "whole", opts)
    # every weight fitted for the KL before, at steps 0, 2, 4, 6, 8, and for the KL after
    assert len(fits) == (LAYERS * 7 + 2) * 7
    first = compress(tiny, tmp_path / "cut", opts, stop_after=7)  # the checkpoint holds step 4
    resumed = compress(tiny, tmp_path / "cut", opts)
    assert resumed.losses[:4] == first.losses[:4]
    np.testing.assert_allclose(resumed.losses, whole.losses, rtol=1e-5)
    assert whole.kl_after is not None and resumed.kl_after == pytest.approx(whole.kl_after, rel=1e-5)
    odd = _opts(texts, qat="q4f16_1", qat_tune="weights",
                train=distill.TrainConfig(steps=4, batch=4, checkpoint_every=5, refit_every=2))
    with pytest.raises(CompressError, match="must be a multiple of --qat-refit"):
        compress(tiny, tmp_path / "odd", odd)
    with pytest.raises(CompressError, match="one worker only"):
        compress(tiny, tmp_path / "two", _opts(texts, qat="q4f16_1", train=cfg, workers=2))
    with pytest.raises(CompressError, match="refit_every must be >= 1"):
        distill.TrainConfig(steps=1, refit_every=0)


@pytest.mark.parametrize("scheme", ["q4f16_1", "q4f16_1e8"])
def test_tuning_the_grid_starts_at_the_converters_weights_and_trains_only_scales_mins_and_floats(
        tiny: Path, texts: tuple[Path, Path], scheme: str) -> None:
    model = load_float_model(tiny).model
    original = {n: p.detach().clone() for n, p in model.named_parameters() if p.dim() == 2}
    fmt = {"linear": "q4", "embedding": "q4" if scheme == "q4f16_1" else "q8"}
    assert qat.attach(model, scheme, "grid") == LAYERS * 7 + 2
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    assert head.parametrizations.weight[0] is embedding.parametrizations.weight[0]  # one grid for the tied weight
    q_proj = decoder_layers(model)[0].self_attn.q_proj
    w = original["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(q_proj.weight, dequantize(quantize(w, "q4"), "q4"))  # untrained: the converter's weight
    e = original["model.embed_tokens.weight"]
    assert torch.equal(head.weight, dequantize(quantize(e, fmt["embedding"]), fmt["embedding"]))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(n.endswith(("scale_delta", "min_delta")) or "norm" in n for n in trainable), trainable
    assert any("norm" in n for n in trainable)
    grid = q_proj.parametrizations.weight[0]
    model(_windows(tiny, texts[0], n=2)).logits.square().mean().backward()
    assert grid.scale_delta.grad is not None and grid.scale_delta.grad.abs().sum() > 0
    assert q_proj.parametrizations.weight.original.grad is None  # the codes' source weight does not train
    torch.manual_seed(1)
    with torch.no_grad():  # as training would: every group's scale and min move by up to a few percent of a step
        for p in model.parameters():
            if p.requires_grad and p.dim() == 3:
                p.add_(0.03 * torch.randn_like(p))
    tuned_q, tuned_head = q_proj.weight.detach().clone(), head.weight.detach().clone()
    qat.detach(model)
    assert head.weight is embedding.weight and torch.equal(head.weight, tuned_head)
    assert torch.equal(q_proj.weight, tuned_q) and q_proj.weight.requires_grad
    # the codes stayed the converter's, on every group's new scale and min
    def codes(x: torch.Tensor) -> torch.Tensor:
        return q4_fields(row_blocks(quantize(x, "q4")["qweight"], "q4"))[2]

    assert torch.equal(codes(tuned_q), codes(w)) and not torch.equal(tuned_q, dequantize(quantize(w, "q4"), "q4"))
    # the converter finds the tuned grid again: converting gives the tuned weights back bit for bit
    differ, total = qat.conversion_mismatches(model, scheme)
    assert total == sum(p.numel() // 32 for n, p in original.items() if "lm_head" not in n) and differ == 0
    assert torch.equal(dequantize(quantize(q_proj.weight.detach(), "q4"), "q4"), tuned_q)
    with torch.no_grad():  # a weight off its grid is counted
        q_proj.weight[0, :32] += 1e-3 * torch.arange(32)
    assert qat.conversion_mismatches(model, scheme)[0] == 1


def test_tuning_the_grid_helps_converts_as_tuned_and_resumes(tiny: Path, texts: tuple[Path, Path],
                                                              tmp_path: Path) -> None:
    from edgellm.artifact.reader import open_artifact
    from edgellm.convert.pipeline import convert
    from edgellm.runtime.engine import Engine

    cfg = distill.TrainConfig(steps=24, batch=4, lr=1e-3, warmup=2, checkpoint_every=8)  # measured: KL 0.93x
    opts = _opts(texts, qat="q4f16_1", train=cfg)
    report = compress(tiny, tmp_path / "grid", opts)
    assert report.qat_tune == "grid" and report.kl_after is not None and report.kl_after < report.kl_before
    assert report.qat_groups and report.qat_groups_converted_otherwise == 0
    assert report.parameters_after == report.parameters_before  # the same model: its grids are not parameters
    held = _windows(tiny, texts[1], n=4)
    float_model, tuned = load_float_model(tiny).model, load_float_model(tmp_path / "grid").model
    reference = next_token_log_probs(float_model, held)

    def converted(folder: Path, name: str) -> torch.Tensor:
        engine = Engine(open_artifact(convert(folder, tmp_path / name, quantization="q4f16_1", progress=False)),
                        threads=1)
        lp = torch.stack([torch.log_softmax(engine.logits(w.tolist()).float(), -1) for w in held])
        engine.close()
        return lp

    tuned_lp = converted(tmp_path / "grid", "tuned-q4")
    # the artifact stores the folder's weights as they are: every tuned weight, bit for bit ...
    stored = open_artifact(tmp_path / "tuned-q4").weights()
    for name, p in tuned.named_parameters():
        q = name.removesuffix(".weight") + ".qweight"
        held_as = dequantize({"qweight": stored[q]}, "q4") if q in stored else stored[name]
        assert torch.equal(held_as, p.detach()), name
    # ... and it is closer to the float model than the plain conversion of the same size
    assert mean_kl(reference, tuned_lp) < mean_kl(reference, converted(tiny, "plain-q4"))
    first = compress(tiny, tmp_path / "cut", opts, stop_after=12)  # the checkpoint holds step 8
    resumed = compress(tiny, tmp_path / "cut", opts)
    assert resumed.losses[:8] == first.losses[:8]
    np.testing.assert_allclose(resumed.losses, report.losses, rtol=1e-5)
    with pytest.raises(CompressError, match="unknown tuning mode"):
        compress(tiny, tmp_path / "odd", _opts(texts, qat="q4f16_1", qat_tune="codes", train=cfg))


def test_cli_refuses_a_refit_interval_for_the_grid(tiny: Path, texts: tuple[Path, Path], tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "edgellm", "compress", str(tiny), "--corpus", str(texts[0]),
                          "--heldout", str(texts[1]), "-o", str(tmp_path / "x"), "--qat", "q4f16_1", "--steps", "2",
                          "--qat-refit", "5"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 1 and run.stderr.strip().splitlines() == [
        "edgellm: error: --qat-refit is for --qat ... --qat-tune weights (tuning the grid fits nothing anew)"]
