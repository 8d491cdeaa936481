"""Sampling filters and logits processors against transformers' own warpers, and seeded empirical draws."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from edgellm.errors import EdgeLLMError
from edgellm.runtime import sampling
from edgellm.runtime.sampling import (
    SamplingParameterError,
    filter_logits,
    logit_bias,
    make_logits_processors,
    make_sampler,
    presence_frequency_penalty,
    repetition_penalty,
)


def hf_filtered(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Transformers' warpers in generate()'s order; returns the (V,) logits with removed tokens at -inf."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    scores = logits[None].clone()
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(input_ids, scores)
    return scores[0]


def ours_full(logits: torch.Tensor, **params: float) -> torch.Tensor:
    """Our candidates scattered back into a (V,) vector with -inf elsewhere."""
    values, ids = filter_logits(logits, **params)
    if ids is None:
        return values
    full = torch.full_like(logits, -math.inf)
    full[ids] = values
    return full


CONFIGS = [
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    dict(temperature=0.7, top_k=40, top_p=1.0, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=0.9, min_p=0.0),
    dict(temperature=1.3, top_k=0, top_p=0.5, min_p=0.0),
    dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.1),
    dict(temperature=0.8, top_k=50, top_p=0.95, min_p=0.0),
    dict(temperature=0.6, top_k=100, top_p=0.8, min_p=0.05),
    dict(temperature=1.5, top_k=0, top_p=0.99, min_p=0.02),
    dict(temperature=1.0, top_k=5000, top_p=1.0, min_p=0.0),  # top_k larger than the vocabulary
]


@pytest.mark.parametrize("params", CONFIGS, ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])  # flat to peaked distributions
def test_filters_match_transformers(params: dict, scale: float) -> None:
    gen = torch.Generator().manual_seed(hash((scale, *params.values())) % 2**31)
    for _ in range(5):
        logits = torch.randn(3000, generator=gen) * scale
        ours = ours_full(logits, **params)
        ref = hf_filtered(logits, **params)
        assert torch.equal(torch.isfinite(ours), torch.isfinite(ref)), "surviving token sets differ"
        torch.testing.assert_close(torch.softmax(ours, 0), torch.softmax(ref, 0), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "scale,top_p,wide", [(10.0, 0.9, False), (3.0, 0.9, True), (3.0, 0.99, True), (0.3, 0.9, True)]
)
def test_top_p_alone_on_a_large_vocab_matches_both_paths(scale: float, top_p: float, wide: bool) -> None:
    """Top-p alone looks in a small head first; a nucleus wider than it must fall back to the (pruned) sort."""
    logits = torch.randn(50_000, generator=torch.Generator().manual_seed(1)) * scale
    ours = ours_full(logits, top_p=top_p)
    ref = hf_filtered(logits, 1.0, 0, top_p, 0.0)
    kept = int(torch.isfinite(ref).sum())
    assert (kept > sampling._NUCLEUS_HEAD) == wide
    assert torch.equal(torch.isfinite(ours), torch.isfinite(ref))
    torch.testing.assert_close(torch.softmax(ours, 0), torch.softmax(ref, 0), atol=1e-7, rtol=1e-5)


def test_no_full_sort_when_top_k_is_set_or_nucleus_is_narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_sort(*args: object, **kwargs: object) -> None:
        raise AssertionError("full vocabulary sort")

    monkeypatch.setattr(torch, "sort", no_sort)
    logits = torch.randn(150_000, generator=torch.Generator().manual_seed(2)) * 5
    make_sampler(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05)(logits, None)
    make_sampler(temperature=0.8, top_p=0.9)(logits, None)
    make_sampler(min_p=0.1)(logits, None)


def test_seeded_draws_follow_the_filtered_distribution() -> None:
    logits = torch.randn(60, generator=torch.Generator().manual_seed(3)) * 2
    params = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)
    expected = torch.softmax(hf_filtered(logits, **params), 0)
    sample = make_sampler(**params)
    gen = torch.Generator().manual_seed(1234)
    n = 20_000
    draws = torch.tensor([sample(logits, gen) for _ in range(n)])
    freq = torch.bincount(draws, minlength=60).double() / n
    assert set(draws.tolist()) <= set(torch.nonzero(expected).squeeze(1).tolist()), "drew a filtered-out token"
    assert (freq - expected.double()).abs().max() < 0.012
    support = expected > 0
    chi2 = float((n * (freq - expected) ** 2 / expected)[support].sum())
    dof = int(support.sum()) - 1
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)  # ~4 sigma above the chi-square mean


def test_same_seed_same_sequence() -> None:
    logits = torch.randn(32_000, generator=torch.Generator().manual_seed(4)) * 3
    for params in (dict(temperature=1.0), dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02)):
        sample = make_sampler(**params)

        def draws(seed: int) -> list[int]:
            gen = torch.Generator().manual_seed(seed)
            return [sample(logits, gen) for _ in range(50)]

        assert draws(7) == draws(7)
        assert draws(7) != draws(8)
        assert len(set(draws(7))) > 1


def test_unfiltered_sampling_matches_softmax_empirically() -> None:
    logits = torch.randn(10, generator=torch.Generator().manual_seed(5))
    sample = make_sampler(temperature=1.3)
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    freq = torch.bincount(torch.tensor([sample(logits, gen) for _ in range(n)]), minlength=10).double() / n
    assert (freq - torch.softmax(logits.double() / 1.3, 0)).abs().max() < 0.012


def test_temperature_zero_is_argmax() -> None:
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(1000, generator=gen)
        assert make_sampler(temperature=0.0)(logits, None) == int(logits.argmax())
        assert make_sampler(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)(logits, gen) == int(logits.argmax())
    ties = torch.tensor([0.0, 2.0, -1.0, 2.0, 2.0])  # the first maximum, as torch.argmax picks it
    assert make_sampler(temperature=0.0)(ties, None) == 1 == int(ties.argmax())
    assert make_sampler(temperature=0.0)(ties.double(), None) == 1  # not float32: torch's own argmax
    view = torch.tensor([[5.0, 1.0], [0.0, 9.0], [3.0, 2.0]])[:, 1]  # a strided view of a logits row
    assert make_sampler(temperature=0.0)(view, None) == 1


def test_min_p_one_and_tiny_top_p_keep_only_the_top_token() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(6))
    gen = torch.Generator().manual_seed(0)
    assert {make_sampler(min_p=1.0)(logits, gen) for _ in range(20)} == {int(logits.argmax())}
    assert {make_sampler(top_p=1e-6)(logits, gen) for _ in range(20)} == {int(logits.argmax())}


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
    ],
)
def test_sampler_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParameterError) as info:
        make_sampler(**kwargs)
    assert str(info.value).startswith(field + " ") and "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, EdgeLLMError)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(logit_bias={5: 101.0}), "logit_bias[5]"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token id"),
        (dict(logit_bias={"x": 1.0}), "logit_bias"),
    ],
)
def test_processor_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParameterError, match="^" + field.replace("[", r"\[").replace("]", r"\]")):
        make_logits_processors(**kwargs)


def test_repetition_penalty_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(8)
    for penalty in (1.3, 0.7):
        logits = torch.randn(1000, generator=gen) * 4
        ids = torch.randint(0, 1000, (300,), generator=gen).tolist()  # repeats included
        ours = repetition_penalty(penalty)(ids, logits)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), logits[None].clone())[0]
        assert torch.equal(ours, ref)
    assert torch.equal(repetition_penalty(1.3)([], logits), logits)


def test_request_repetition_penalty_follows_the_growing_history() -> None:
    """The per-request processor (distinct ids kept incrementally) equals the stateless one on prompt +
    generated at every step, and starts over for another prompt or a shorter generated list."""
    gen = torch.Generator().manual_seed(12)
    (process,) = make_logits_processors(repetition_penalty=1.4)
    for prompt in (torch.randint(0, 300, (80,), generator=gen).tolist(), [], [5, 5, 7]):
        generated: list[int] = []
        for _ in range(40):
            logits = torch.randn(300, generator=gen) * 3
            before = logits.clone()
            assert torch.equal(process(prompt, generated, logits), repetition_penalty(1.4)([*prompt, *generated], logits))
            assert torch.equal(logits, before), "processors must not modify their input"
            generated.append(int(torch.randint(0, 300, (1,), generator=gen)))
        logits = torch.randn(300, generator=gen)
        assert torch.equal(process(prompt, generated[:3], logits), repetition_penalty(1.4)([*prompt, *generated[:3]], logits))


def test_presence_frequency_penalty_is_openai_formula() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(200, generator=gen)
    generated = torch.randint(0, 50, (120,), generator=gen).tolist()
    ours = presence_frequency_penalty(0.5, 0.3)(generated, logits)
    expected = logits.clone()
    for token in range(200):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
        count = generated.count(token)
        expected[token] -= count * 0.3 + (count > 0) * 0.5
    torch.testing.assert_close(ours, expected)
    assert torch.equal(presence_frequency_penalty(0.5, 0.3)([], logits), logits)


def test_logit_bias_adds_and_checks_the_vocabulary() -> None:
    logits = torch.zeros(10)
    out = logit_bias({3: 5.0, "7": -100})([], logits)
    assert out.tolist() == [0, 0, 0, 5.0, 0, 0, 0, -100.0, 0, 0]
    assert torch.equal(logits, torch.zeros(10)), "processors must not modify their input"
    with pytest.raises(SamplingParameterError, match="outside the vocabulary"):
        logit_bias({10: 1.0})([], logits)


def test_make_logits_processors_order_and_inputs() -> None:
    assert make_logits_processors() == []
    prompt, generated = [1, 2, 2], [2, 4, 4]
    logits = torch.tensor([1.0, 2.0, -2.0, 3.0, 4.0, 5.0])
    processors = make_logits_processors(
        repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={0: -3.0}
    )
    out = logits
    for process in processors:
        out = process(prompt, generated, out)
    # bias: token 0 -> -2.0; repetition over prompt+generated {1, 2, 4}: 1 -> 1.0, 2 -> -4.0, 4 -> 2.0;
    # presence/frequency over generated only {2: 1, 4: 2}: 2 -> -5.5, 4 -> 0.0 (token 1 from the prompt untouched)
    assert out.tolist() == [-2.0, 1.0, -5.5, 3.0, 0.0, 5.0]
