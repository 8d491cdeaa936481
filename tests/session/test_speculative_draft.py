"""Speculative decoding with a draft model (session/speculative_draft.py, runtime/draft.py): greedy output identical to
plain decoding, the sampled tokens and whole replies distributed as the target's own (chi-square against a float64
computation), a draft identical to the target keeping every token, both caches rolled back past a refusal, and a
draft with another tokenizer refused. Tiny random models made by transformers, and the real SmolLM2."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgellm.artifact.reader import open_artifact
from edgellm.convert.pipeline import convert
from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams, GenerationResult
from edgellm.runtime.engine import Engine
from edgellm.session.sampling import filter_logits
from edgellm.session.speculative_draft import DraftRunner, accept_drafted, draw, probabilities
from tests.kernels.test_native_decode import _make_model
from tests.session.test_speculative import PROMPTS, chi_square_p
from tests.support.tiny import VOCAB

transformers = pytest.importorskip("transformers")


def pooled_p(observed: np.ndarray, expected: np.ndarray) -> float:
    """chi_square_p over the bins expecting at least 5 (chi-square's usual condition), the rest pooled in one bin
    (left out when it expects nothing)."""
    big = expected >= 5
    observed, expected = np.append(observed[big], observed[~big].sum()), np.append(expected[big], expected[~big].sum())
    if expected[-1] == 0:
        assert observed[-1] == 0
        observed, expected = observed[:-1], expected[:-1]
    return chi_square_p(observed, expected)


def greedy(spec: str | None, n: int = 24) -> GenerationParams:
    return GenerationParams(temperature=0.0, max_tokens=n, ignore_eos=True, top_logprobs=0, speculative=spec)


def _noisy_copy(src: Path, dst: Path, *, noise: float, seed: int) -> None:
    """The model at `src` with every weight matrix perturbed by relative Gaussian noise: a draft that agrees with
    it often, not always."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.mul_(1.0 + noise * torch.randn_like(p))
    model.save_pretrained(dst, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_bytes((src / name).read_bytes())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Artifact folders: the target, a noisy draft of it, and a draft whose tokenizer has two entries swapped."""
    root = tmp_path_factory.mktemp("draft")
    _make_model(root / "hf", "qwen2", tied=False)
    _noisy_copy(root / "hf", root / "hf-draft", noise=0.2, seed=7)
    _noisy_copy(root / "hf", root / "hf-other", noise=0.5, seed=8)
    tok = (root / "hf-other" / "tokenizer.json").read_text()
    (root / "hf-other" / "tokenizer.json").write_text(tok.replace('"t1"', '"tX"').replace('"t2"', '"t1"')
                                                      .replace('"tX"', '"t2"'))
    out = {}
    for name, hf in (("target", "hf"), ("draft", "hf-draft"), ("other", "hf-other")):
        out[name] = convert(root / hf, root / f"art-{name}", quantization="q4f16_1", progress=False)
    return out


def drafting(engine: Engine) -> Engine:
    """`engine` (loaded with a draft) with no default speculative decoding: requests name the draft, or run plain."""
    engine.speculative = None
    return engine


def spec_of(engine: Engine) -> str:
    assert engine.draft is not None
    return f"draft:{engine.draft.name}"


@pytest.fixture(scope="module")
def target(models: dict[str, Path]) -> Engine:
    return drafting(Engine(open_artifact(models["target"]), threads=1, speculative=f"draft:{models['draft']}"))


@pytest.fixture(scope="module")
def twin(models: dict[str, Path]) -> Engine:
    """The target drafting with itself."""
    return drafting(Engine(open_artifact(models["target"]), threads=1, speculative=f"draft:{models['target']}"))


def run(engine: Engine, ids: list[int], params: GenerationParams) -> tuple[list[tuple[int, float]], object]:
    engine.reset()
    result = engine.generate(ids, params)
    return [(lp.token_id, lp.logprob) for lp in result.logprobs], result.stats


@pytest.mark.parametrize("prompt", range(len(PROMPTS)))
def test_greedy_output_is_plain_greedy_output(target: Engine, prompt: int) -> None:
    ids = PROMPTS[prompt]
    plain, _ = run(target, ids, greedy(None))
    spec, stats = run(target, ids, greedy(spec_of(target)))
    assert spec == plain  # tokens and their log-probabilities, bit for bit
    assert 0 < stats.accepted_tokens < stats.draft_tokens


@pytest.mark.parametrize("sampled", [False, True])
def test_a_draft_identical_to_the_target_keeps_every_token(twin: Engine, sampled: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every drafted token that is checked is kept (those after the reply's last token are never checked)."""
    checked: list[bool] = []
    accept = DraftRunner.accept

    def recording(self, logits, index, drafted, generator):
        choice = accept(self, logits, index, drafted, generator)
        checked.append(choice == drafted)
        return choice

    monkeypatch.setattr(DraftRunner, "accept", recording)
    params = (GenerationParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True, top_logprobs=0,
                               speculative=spec_of(twin)) if sampled else greedy(spec_of(twin)))
    for ids in PROMPTS:
        run(twin, ids, params)
    assert len(checked) > 40 and all(checked)


def test_both_caches_are_rolled_back_past_a_refusal(target: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """After each reply the target's cache holds the prompt and the reply but its last token; before each draft the
    draft's cache holds exactly the target's sequence (a refused token and the drafts after it dropped); the replies
    are still plain greedy's."""
    sync = DraftRunner._sync
    synced = 0

    def checked(self, *, chunked):
        nonlocal synced
        logits = sync(self, chunked=chunked)
        assert self.fed == self.history
        synced += 1
        return logits

    refused = 0
    accept = DraftRunner.accept

    def counting(self, logits, index, drafted, generator):
        nonlocal refused
        choice = accept(self, logits, index, drafted, generator)
        refused += choice != drafted
        return choice

    monkeypatch.setattr(DraftRunner, "_sync", checked)
    monkeypatch.setattr(DraftRunner, "accept", counting)
    for ids in PROMPTS + PROMPTS[::-1]:
        plain, _ = run(target, ids, greedy(None))
        spec, _ = run(target, ids, greedy(spec_of(target)))
        assert spec == plain
        assert target.session.cached_ids == (ids + [t for t, _ in spec])[:-1]
    assert refused > 0 and synced > 20


def test_greedy_output_through_a_context_shift(models: dict[str, Path]) -> None:
    """A window that fills twice: the draft follows the shifted sequence, and the output is plain greedy's."""
    engine = drafting(Engine(open_artifact(models["target"]), threads=1, context_window=40,
                             speculative=f"draft:{models['draft']}"))
    shift = {"context_shift": "reencode", "max_tokens": 60}
    plain, _ = run(engine, PROMPTS[0], GenerationParams(temperature=0.0, ignore_eos=True, top_logprobs=0, **shift))
    spec, stats = run(engine, PROMPTS[0], GenerationParams(temperature=0.0, ignore_eos=True, top_logprobs=0,
                                                           speculative=spec_of(engine), **shift))
    assert spec == plain and len(spec) == 60
    assert stats.context_shifts >= 2 and stats.accepted_tokens > 0


def test_seeded_sampled_replies_repeat(target: Engine) -> None:
    params = GenerationParams(temperature=0.9, top_k=40, seed=5, max_tokens=24, ignore_eos=True, top_logprobs=0,
                              speculative=spec_of(target))
    first, stats = run(target, PROMPTS[1], params)
    again, _ = run(target, PROMPTS[1], params)
    assert first == again and stats.draft_tokens > 0


def test_a_draft_with_another_tokenizer_is_refused(models: dict[str, Path]) -> None:
    with pytest.raises(EdgeLLMError, match=r"another tokenizer than the target \(their id → token tables differ\)"):
        Engine(open_artifact(models["target"]), threads=1, speculative=f"draft:{models['other']}")


def test_a_request_naming_another_draft_is_refused(target: Engine, models: dict[str, Path]) -> None:
    with pytest.raises(EdgeLLMError, match="draft model 'elsewhere' is not loaded"):
        target.generate(PROMPTS[0], GenerationParams(max_tokens=4, speculative="draft:elsewhere"))
    with pytest.raises(EdgeLLMError, match="unknown speculative decoding 'draft:'"):
        target.generate(PROMPTS[0], GenerationParams(max_tokens=4, speculative="draft:"))


def test_the_memory_estimate_counts_the_draft(target: Engine, models: dict[str, Path]) -> None:
    alone = Engine(open_artifact(models["target"]), threads=1)
    assert target.memory.draft_bytes > 0
    assert target.memory.total_bytes == alone.memory.total_bytes + target.memory.draft_bytes
    assert "draft model" in target.memory.describe()


def test_batched_sequences_draft_each_with_their_own_cache(target: Engine) -> None:
    """Several sequences at once (runtime/batching.py): each slot drafts from a draft cache of its own; every greedy
    reply is the plain one."""
    from edgellm.runtime.batched import Request, RequestOutcome, generate_many

    plain = {i: run(target, ids, greedy(None))[0] for i, ids in enumerate(PROMPTS)}
    out: dict[int, RequestOutcome] = {}
    generate_many(target, [Request(ids, greedy(spec_of(target))) for ids in PROMPTS],
                  lambda i, outcome: out.__setitem__(i, outcome), parallel=3)
    assert sorted(out) == list(range(len(PROMPTS)))
    for i, result in out.items():
        assert isinstance(result, GenerationResult)
        assert [(lp.token_id, lp.logprob) for lp in result.logprobs] == plain[i]
        assert result.stats.draft_tokens > 0


def test_the_cli_option(models: dict[str, Path]) -> None:
    from tests.cli.test_cli import assert_one_line_error, edgellm

    args = ["run", str(models["target"]), "--raw", "t10 t20 t30 t40 t50", "--temperature", "0", "-n", "8"]
    proc = edgellm(*args, "--speculative", f"draft:{models['draft']}", "--stats")
    assert proc.returncode == 0, proc.stderr
    assert "accepted" in proc.stderr and "draft model" in proc.stderr  # the drafts, and the estimate with the draft
    assert_one_line_error(edgellm(*args, "--speculative", f"draft:{models['other']}"), "has another tokenizer")
    proc = edgellm(*args, "--speculative", "draft")
    assert proc.returncode == 2 and "unknown speculative decoding 'draft'; known: lookup, draft:MODEL" in proc.stderr


def test_the_planner_counts_the_draft(target: Engine, models: dict[str, Path]) -> None:
    """A budget that holds the target alone but not the target and its draft: Engine.load refuses, naming the
    draft's share."""
    from edgellm.errors import MemoryBudgetError

    alone = Engine(open_artifact(models["target"]), threads=1).memory.total_bytes
    budget = alone + target.memory.draft_bytes // 2
    Engine.load(models["target"], memory_budget=budget, progress=False, threads=1).close()
    with pytest.raises(MemoryBudgetError, match="less the draft model's"):
        Engine.load(models["target"], memory_budget=budget, progress=False, threads=1,
                    speculative=f"draft:{models['draft']}")


# ---- the acceptance rule ---------------------------------------------------------------------------------------
def _distributions(target: Engine, prompt: list[int], options: dict) -> tuple[np.ndarray, np.ndarray]:
    """p (the target's) and q (the draft's) filtered next-token distributions after `prompt`, float64."""
    p_logits = target.session.logits(prompt)[-1]
    draft = target.session.draft
    assert draft is not None
    draft.fed = []
    q_logits = draft.draft.model.run(prompt, 0, draft.cache)
    return probabilities(p_logits, **options), probabilities(q_logits, **options)


@pytest.mark.parametrize("options", [{"temperature": 1.0}, {"temperature": 0.7, "top_k": 12, "top_p": 0.95}])
def test_one_verified_token_follows_the_targets_distribution(target: Engine, options: dict) -> None:
    """d drawn from q, kept or replaced by the rule: over 20,000 seeds the token is distributed as p (chi-square
    against p in float64), though q differs from p."""
    p, q = _distributions(target, PROMPTS[0], options)
    assert 0.1 < 0.5 * np.abs(p - q).sum() < 0.9  # the draft is neither the target nor unrelated to it
    n = 20000
    counts = np.zeros(p.size)
    for seed in range(n):
        g = np.random.default_rng(seed)
        counts[accept_drafted(p, q, draw(q, g), g)] += 1
    assert counts[p == 0].sum() == 0  # never a token the target's filters removed
    assert pooled_p(counts, n * p) > 1e-4


def test_whole_replies_follow_the_targets_joint_distribution(target: Engine) -> None:
    """Three-token replies (top-3 sampling, so 27 possible) over 3,000 seeds against the target's joint distribution
    computed in float64 from its own decode-step logits: p(a) p(b | a) p(c | a b)."""
    options = {"temperature": 1.0, "top_k": 3}
    prompt = PROMPTS[1]
    session = target.session

    def step_p(prefix: list[int]) -> np.ndarray:
        return probabilities(session.logits(prefix, step_from=len(prompt))[-1], **options)

    joint: dict[tuple[int, ...], float] = {}
    first = step_p(prompt)
    for a in np.flatnonzero(first):
        second = step_p(prompt + [int(a)])
        for b in np.flatnonzero(second):
            third = step_p(prompt + [int(a), int(b)])
            for c in np.flatnonzero(third):
                joint[(int(a), int(b), int(c))] = first[a] * second[b] * third[c]
    n = 3000
    counts = dict.fromkeys(joint, 0)
    drafted = accepted = 0
    for seed in range(n):
        target.reset()
        result = target.generate(prompt, GenerationParams(max_tokens=3, ignore_eos=True, seed=seed,
                                                          speculative=spec_of(target), **options))
        counts[tuple(result.token_ids)] += 1  # a KeyError: a reply the target could not produce
        drafted += result.stats.draft_tokens
        accepted += result.stats.accepted_tokens
    assert 0 < accepted < drafted
    keys = sorted(joint)
    observed = np.array([counts[k] for k in keys], dtype=np.float64)
    expected = n * np.array([joint[k] for k in keys])
    assert pooled_p(observed, expected) > 1e-4


def test_greedy_keeps_a_draft_only_at_the_targets_argmax(target: Engine) -> None:
    draft = target.session.draft
    assert draft is not None
    draft.sampling = {"temperature": 0.0}
    logits = np.array([0.1, 2.0, 1.9, -1.0], dtype=np.float32)
    g = np.random.default_rng(0)
    assert draft.accept(logits, 0, 1, g) == 1
    assert draft.accept(logits, 0, 2, g) == 1


def test_probabilities_are_the_filtered_softmax() -> None:
    logits = np.array([1.0, 3.0, 2.0, 0.0], dtype=np.float32)
    p = probabilities(logits, temperature=0.5, top_k=2)
    want = np.exp(np.array([3.0, 2.0], dtype=np.float64) / 0.5)
    assert np.allclose(p, [0, want[0] / want.sum(), want[1] / want.sum(), 0], rtol=1e-6)
    scores, ids = filter_logits(logits, temperature=0.5, top_k=2)
    assert ids is not None and set(ids.tolist()) == set(np.flatnonzero(p).tolist())


# ---- the real model ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2() -> Engine:
    return drafting(Engine.load("smollm2-135m:q8f16_1", progress=False, speculative="draft:smollm2-135m:q4f16_1"))


def test_smollm2_greedy_output_is_plain_output(smollm2: Engine) -> None:
    from edgellm.eval.tasks import load_dataset, messages

    items = load_dataset()
    prompts = [smollm2.render(messages(items[0])),
               smollm2.render([{"role": "user", "content": "Write a haiku about the sea."}])]
    for prompt in prompts:
        plain = smollm2.generate(prompt, GenerationParams(temperature=0.0, max_tokens=48))
        spec = smollm2.generate(prompt, GenerationParams(temperature=0.0, max_tokens=48,
                                                         speculative=spec_of(smollm2)))
        assert spec.text == plain.text and spec.token_ids == plain.token_ids
        assert spec.stats.draft_tokens > 0
