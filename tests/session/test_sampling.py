"""Sampling filters and logits processors (numpy) against transformers' own warpers (torch, here only), float64
references, and seeded empirical draws."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
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
from edgellm.session import sampling
from edgellm.session.sampling import (
    SamplingParameterError,
    apply_top_k,
    apply_top_p,
    categorical,
    filter_logits,
    logit_bias,
    make_logits_processors,
    make_sampler,
    presence_frequency_penalty,
    repetition_penalty,
)


def randn(seed: int, n: int, scale: float = 1.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def hf_filtered(logits: np.ndarray, temperature: float, top_k: int, top_p: float, min_p: float) -> np.ndarray:
    """Transformers' warpers in generate()'s order; returns the (V,) logits with removed tokens at -inf."""
    warpers = [TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p))
    if min_p > 0.0:
        warpers.append(MinPLogitsWarper(min_p))
    scores = torch.tensor(logits)[None]
    input_ids = torch.zeros((1, 1), dtype=torch.long)
    for warper in warpers:
        scores = warper(input_ids, scores)
    return scores[0].numpy()


def ours_full(logits: np.ndarray, **params: float) -> np.ndarray:
    """Our candidates scattered back into a (V,) vector with -inf elsewhere."""
    values, ids = filter_logits(logits, **params)
    if ids is None:
        return values
    assert len(set(ids.tolist())) == ids.size, "a token id twice among the candidates"
    full = np.full_like(logits, -np.inf, dtype=np.float32)
    full[ids] = values
    return full


def softmax64(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    e = np.exp(x - x.max())
    return e / e.sum()


def assert_same_distribution(ours: np.ndarray, ref: np.ndarray, atol: float = 1e-6) -> None:
    np.testing.assert_array_equal(np.isfinite(ours), np.isfinite(ref), err_msg="surviving token sets differ")
    np.testing.assert_allclose(softmax64(ours), softmax64(ref), atol=atol, rtol=1e-5)


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
    rng = np.random.default_rng(abs(hash((scale, *params.values()))) % 2**31)
    for _ in range(5):
        logits = (rng.standard_normal(3000) * scale).astype(np.float32)
        assert_same_distribution(ours_full(logits, **params), hf_filtered(logits, **params))


@pytest.mark.parametrize("params", CONFIGS[1:], ids=lambda p: "-".join(f"{k}={v}" for k, v in p.items()))
def test_filters_match_transformers_on_near_ties(params: dict) -> None:
    """Values one or two float32 steps apart (distinct, so every cut is well defined) around the cuts."""
    rng = np.random.default_rng(21)
    for _ in range(5):
        base = rng.standard_normal(150).astype(np.float32) * 2
        logits = np.repeat(base, 20)  # each value 20 times, then nudged apart by a few ulps
        for _ in range(int(rng.integers(1, 20))):
            logits = np.where(rng.random(logits.size) < 0.5, np.nextafter(logits, np.float32(np.inf)), logits)
        logits = rng.permutation(logits)
        if np.unique(logits).size < logits.size:
            continue
        assert_same_distribution(ours_full(logits, **params), hf_filtered(logits, **params))


def reference_order(logits: np.ndarray) -> list[int]:
    """Token ids by logit, highest first, equal logits by lower id: the documented order (and tie rule)."""
    return sorted(range(logits.size), key=lambda i: (-float(logits[i]), i))


@pytest.mark.parametrize("k", [1, 7, 40, 256, 999, 1000, 2000])
def test_top_k_with_ties_keeps_lower_ids_in_descending_order(k: int) -> None:
    rng = np.random.default_rng(k)
    logits = rng.integers(-8, 8, 1000).astype(np.float32) / 2  # 32 distinct values: ties everywhere
    logits[rng.integers(0, 1000, 50)] = -np.inf
    values, ids = apply_top_k(logits, k)
    expected = reference_order(logits)[:k]
    assert ids.tolist() == expected
    np.testing.assert_array_equal(values, logits[expected])
    kth = logits[expected[-1]]
    if k < 1000 and kth > -np.inf:  # transformers keeps every token tied with the k-th; ours: the lowest ids
        hf = np.isfinite(hf_filtered(logits, 1.0, k, 1.0, 0.0))
        assert hf[ids].all() and set(np.flatnonzero(logits > kth).tolist()) <= set(ids.tolist())


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.93])
def test_top_p_with_ties_matches_a_float64_reference(top_p: float) -> None:
    """Ties at the cut keep the lower ids; masses summed in float64 (transformers orders ties arbitrarily)."""
    rng = np.random.default_rng(int(top_p * 100))
    for wide in (False, True):
        n = 50_000 if wide else 3000
        logits = rng.integers(-20, 0, n).astype(np.float32) / (4 if wide else 0.5)
        order = reference_order(logits)
        probs = softmax64(logits)[order]
        above = np.concatenate([[0.0], np.cumsum(probs)[:-1]])
        assert np.abs(above - top_p).min() > 1e-9, "cut too close to call: change the seed"
        keep = int((above < top_p).sum())
        assert (keep > sampling._NUCLEUS_HEAD) == wide
        values, ids = filter_logits(logits, top_p=top_p)
        assert ids.tolist() == order[:keep]
        np.testing.assert_array_equal(values, logits[order[:keep]])
        # the same on candidates already sorted (after top-k)
        values, ids = apply_top_p(logits[order], np.array(order), top_p)
        assert ids.tolist() == order[:keep]


@pytest.mark.parametrize(
    "scale,top_p,wide", [(10.0, 0.9, False), (3.0, 0.9, True), (3.0, 0.99, True), (0.3, 0.9, True)]
)
def test_top_p_alone_on_a_large_vocab_matches_both_paths(scale: float, top_p: float, wide: bool) -> None:
    """Top-p alone looks in a small head first; a nucleus wider than it must fall back to the (pruned) sort."""
    logits = randn(1, 50_000, scale)
    ours = ours_full(logits, top_p=top_p)
    ref = hf_filtered(logits, 1.0, 0, top_p, 0.0)
    assert (int(np.isfinite(ref).sum()) > sampling._NUCLEUS_HEAD) == wide
    assert_same_distribution(ours, ref, atol=1e-7)


def test_top_p_matches_a_float64_reference() -> None:
    """Continuous logits: the kept prefix is the float64 one (transformers sums in float32)."""
    for seed in range(20):
        logits = randn(seed, 20_000, [0.3, 2.0, 6.0][seed % 3])
        top_p = [0.5, 0.9, 0.95, 0.99][seed % 4]
        order = np.argsort(-logits.astype(np.float64), kind="stable")
        probs = softmax64(logits)[order]
        keep = int(((np.cumsum(probs) - probs) < top_p).sum())
        _, ids = filter_logits(logits, top_p=top_p)
        assert ids.tolist() == order[:keep].tolist()


def test_no_full_sort_when_top_k_is_set_or_nucleus_is_narrow(monkeypatch: pytest.MonkeyPatch) -> None:
    def guarded(sort):  # sorting the candidates is fine, sorting (a large part of) the vocabulary is not
        def run(a, *args, **kwargs):
            assert np.size(a) < 10_000, f"sort of {np.size(a)} entries"
            return sort(a, *args, **kwargs)

        return run

    for name in ("sort", "argsort", "lexsort"):
        monkeypatch.setattr(np, name, guarded(getattr(np, name)))
    logits = randn(2, 150_000, 5)
    gen = np.random.default_rng(0)
    for params in (dict(temperature=0.8, top_k=40, top_p=0.9, min_p=0.05), dict(temperature=0.8, top_p=0.9),
                   dict(min_p=0.1), dict(temperature=0.7)):
        make_sampler(**params)(logits, gen)
    with pytest.raises(AssertionError, match="sort of"):  # the guard itself works
        make_sampler(top_k=150_000)(logits, gen)


def test_seeded_draws_follow_the_filtered_distribution() -> None:
    logits = randn(3, 60, 0.5)
    params = dict(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05)
    expected = softmax64(hf_filtered(logits, **params))
    sample = make_sampler(**params)
    gen = np.random.default_rng(1234)
    n = 20_000
    draws = np.array([sample(logits, gen) for _ in range(n)])
    freq = np.bincount(draws, minlength=60) / n
    assert set(draws.tolist()) <= set(np.flatnonzero(expected).tolist()), "drew a filtered-out token"
    assert np.abs(freq - expected).max() < 0.012
    assert_chi_square(freq, expected, n)


def assert_chi_square(freq: np.ndarray, expected: np.ndarray, n: int) -> None:
    support = expected > 0
    assert freq[~support].sum() == 0, "drew a token of probability 0"
    chi2 = float((n * (freq[support] - expected[support]) ** 2 / expected[support]).sum())
    dof = int(support.sum()) - 1
    assert dof >= 3, "too few tokens for the test to mean anything"
    assert chi2 < dof + 6 * math.sqrt(2 * dof), (chi2, dof)  # ~4 sigma above the chi-square mean


@pytest.mark.parametrize("n_vocab", [10, 3000, 10_000])  # one-level and two-level (blocked) cumulative sums
def test_categorical_follows_softmax(n_vocab: int) -> None:
    """Chi-square over 40k seeded draws; a CDF shifted by one token (or one block) fails it by far."""
    rng = np.random.default_rng(n_vocab)
    logits = np.full(n_vocab, -np.inf, dtype=np.float32)
    b = sampling._CDF_BLOCK  # the mass sits around block edges and the end, where an offset bug would show
    hot = sorted({0, 1, n_vocab - 1, n_vocab - 2, *(i for e in range(b, n_vocab, b) for i in (e - 1, e, e + 1))})
    hot = [i for i in hot if i < n_vocab][:40]
    logits[hot] = rng.standard_normal(len(hot)).astype(np.float32)
    if n_vocab > 100:
        logits[rng.integers(0, n_vocab, 500)] = rng.standard_normal(500).astype(np.float32) - 3
    expected = softmax64(logits)
    gen = np.random.default_rng(99)
    n = 40_000
    freq = np.bincount([categorical(logits, gen) for _ in range(n)], minlength=n_vocab) / n
    assert_chi_square(freq, expected, n)


class FixedDraw:
    """A generator whose uniform draw is chosen by the test."""

    def __init__(self, u: float) -> None:
        self.u = u

    def random(self) -> float:
        return self.u


@pytest.mark.parametrize("n_vocab", [100, 4096, 4097, 10_000, 151_936])
def test_categorical_is_the_inverse_cdf_of_its_draw(n_vocab: int) -> None:
    """Exactly the token whose float64 cumulative weight first exceeds u * total, for u anywhere (also just
    below each block's edge, where a two-level sum rounds differently), never one of probability 0."""
    rng = np.random.default_rng(n_vocab)
    logits = rng.standard_normal(n_vocab).astype(np.float32) * 2
    logits[rng.integers(0, n_vocab, n_vocab // 10)] = -np.inf
    logits[::sampling._CDF_BLOCK] = -np.inf  # the first token of every block
    logits[-3:] = -np.inf
    weights = np.exp((logits - logits.max()).astype(np.float64))
    cdf = np.cumsum(weights)
    us = [0.0, 1.0 - 2**-53, *rng.random(200).tolist()]
    for edge in range(sampling._CDF_BLOCK - 1, n_vocab - 1, sampling._CDF_BLOCK):
        u = min(cdf[edge] / cdf[-1], 1.0 - 2**-53)  # a generator's random() is below 1
        for _ in range(8):
            us.append(u)
            u = np.nextafter(u, 0.0)
    for u in us:
        token = categorical(logits, FixedDraw(u))
        assert 0 <= token < n_vocab and logits[token] > -np.inf, (u, token)
        reference = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        if abs(u * cdf[-1] - cdf[min(reference, n_vocab - 1)]) > 1e-9 * cdf[-1] and reference > 0 and abs(
            u * cdf[-1] - cdf[reference - 1]
        ) > 1e-9 * cdf[-1]:  # not within rounding of a step of the CDF
            assert token == reference, (u, token, reference)
    assert categorical(logits, FixedDraw(1.0 - 2**-53)) == int(np.flatnonzero(np.isfinite(logits))[-1])


def test_categorical_never_draws_past_a_block_whose_running_sum_rounds_low() -> None:
    """A block of one weight 1 and 1023 weights 2**-60: its running sum stays 1.0 while its total (summed
    pairwise) is a few ulps above; a draw between the two must stay in the block, not land on the next token."""
    b = sampling._CDF_BLOCK
    logits = np.full(5 * b, -np.inf, dtype=np.float32)
    logits[0] = logits[b + 1] = 0.0
    logits[1:b] = np.log(2.0**-60)
    total = float(np.exp(logits).sum(dtype=np.float64))
    u, drawn = 1.0 / total, set()
    for _ in range(64):
        drawn.add(categorical(logits, FixedDraw(u)))
        u = np.nextafter(u, 1.0)
    assert drawn <= {*range(b), b + 1} and len(drawn) > 1, drawn


def test_categorical_without_a_generator() -> None:
    logits = np.array([0.0, -np.inf, 1.0, -np.inf], dtype=np.float32)
    assert {categorical(logits) for _ in range(50)} == {0, 2}
    assert make_sampler(temperature=0.9)(logits, None) in (0, 2)


def test_same_seed_same_sequence() -> None:
    logits = randn(4, 32_000, 3)
    for params in (dict(temperature=1.0), dict(temperature=0.8, top_k=50, top_p=0.9, min_p=0.02),
                   dict(temperature=1.2, top_p=0.95)):
        sample = make_sampler(**params)

        def draws(seed: int) -> list[int]:
            gen = np.random.default_rng(seed)
            return [sample(logits, gen) for _ in range(50)]

        assert draws(7) == draws(7)
        assert draws(7) != draws(8)
        assert len(set(draws(7))) > 1


def test_unfiltered_sampling_matches_softmax_empirically() -> None:
    logits = randn(5, 10)
    sample = make_sampler(temperature=1.3)
    gen = np.random.default_rng(0)
    n = 20_000
    freq = np.bincount([sample(logits, gen) for _ in range(n)], minlength=10) / n
    expected = softmax64(logits.astype(np.float64) / 1.3)
    assert np.abs(freq - expected).max() < 0.012
    assert_chi_square(freq, expected, n)


def test_temperature_zero_is_argmax() -> None:
    rng = np.random.default_rng(0)
    for _ in range(20):
        logits = rng.standard_normal(1000).astype(np.float32)
        assert make_sampler(temperature=0.0)(logits, None) == int(logits.argmax())
        assert make_sampler(temperature=0.0, top_k=3, top_p=0.1, min_p=0.9)(logits, rng) == int(logits.argmax())
    ties = np.array([0.0, 2.0, -1.0, 2.0, 2.0], dtype=np.float32)  # the first maximum
    assert make_sampler(temperature=0.0)(ties, None) == 1
    assert make_sampler(temperature=0.0)(ties.astype(np.float64), None) == 1
    view = np.array([[5.0, 1.0], [0.0, 9.0], [3.0, 2.0]], dtype=np.float32)[:, 1]  # a strided view of a column
    assert make_sampler(temperature=0.0)(view, None) == 1
    assert isinstance(make_sampler(temperature=0.0)(view, None), int)


def test_samplers_return_python_ints_and_accept_other_float_dtypes() -> None:
    logits = randn(11, 500, 2)
    gen = np.random.default_rng(0)
    for params in (dict(), dict(top_k=5), dict(top_p=0.5), dict(min_p=0.3), dict(temperature=0.0)):
        assert type(make_sampler(**params)(logits, gen)) is int
    scores, _ = filter_logits(logits.astype(np.float64), temperature=0.5)
    assert scores.dtype == np.float32


def test_min_p_one_and_tiny_top_p_keep_only_the_top_token() -> None:
    logits = randn(6, 500)
    gen = np.random.default_rng(0)
    assert {make_sampler(min_p=1.0)(logits, gen) for _ in range(20)} == {int(logits.argmax())}
    assert {make_sampler(top_p=1e-6)(logits, gen) for _ in range(20)} == {int(logits.argmax())}


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.1), "min_p"),
    ],
)
def test_sampler_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParameterError) as info:
        make_sampler(**kwargs)
    value = next(iter(kwargs.values()))
    assert str(info.value).startswith(field + " must be ") and str(info.value).endswith(f", got {value!r}")
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError) and isinstance(info.value, EdgeLLMError)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0, got -1.0"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty must be > 0, got inf"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0"),
        (dict(logit_bias={5: 101.0}), "logit_bias[5] must be in [-100, 100], got 101.0"),
        (dict(logit_bias={-1: 1.0}), "logit_bias token id must be >= 0, got -1"),
        (dict(logit_bias={"x": 1.0}), "logit_bias must map token ids to numbers, got {'x': 1.0}"),
        (dict(logit_bias={3: "much"}), "logit_bias must map token ids to numbers, got {3: 'much'}"),
    ],
)
def test_processor_validation_names_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(SamplingParameterError) as info:
        make_logits_processors(**kwargs)
    assert str(info.value) == message


def test_stateless_factories_validate_too() -> None:
    with pytest.raises(SamplingParameterError, match="^repetition_penalty "):
        repetition_penalty(float("nan"))
    with pytest.raises(SamplingParameterError, match="^presence_penalty "):
        presence_frequency_penalty(-2.1, 0.0)
    with pytest.raises(SamplingParameterError, match="^frequency_penalty "):
        presence_frequency_penalty(0.0, 2.1)


def test_repetition_penalty_matches_transformers() -> None:
    rng = np.random.default_rng(8)
    for penalty in (1.3, 0.7):
        logits = rng.standard_normal(1000).astype(np.float32) * 4
        ids = rng.integers(0, 1000, 300).tolist()  # repeats included
        ours = repetition_penalty(penalty)(ids, logits)
        ref = RepetitionPenaltyLogitsProcessor(penalty)(torch.tensor([ids]), torch.tensor(logits)[None])[0]
        assert ours.dtype == np.float32
        np.testing.assert_array_equal(ours, ref.numpy())
    assert repetition_penalty(1.3)([], logits) is logits


def test_request_repetition_penalty_follows_the_growing_history() -> None:
    """The per-request processor (distinct ids kept incrementally) equals the stateless one on prompt +
    generated at every step, and starts over for another prompt or a shorter generated list."""
    rng = np.random.default_rng(12)
    (process,) = make_logits_processors(repetition_penalty=1.4)
    for prompt in (rng.integers(0, 300, 80).tolist(), [], [5, 5, 7]):
        generated: list[int] = []
        for _ in range(40):
            logits = rng.standard_normal(300).astype(np.float32) * 3
            before = logits.copy()
            ours = process(prompt, generated, logits)
            np.testing.assert_array_equal(ours, repetition_penalty(1.4)([*prompt, *generated], logits))
            np.testing.assert_array_equal(logits, before, err_msg="processors must not modify their input")
            generated.append(int(rng.integers(0, 300)))
        logits = rng.standard_normal(300).astype(np.float32)
        np.testing.assert_array_equal(
            process(prompt, generated[:3], logits), repetition_penalty(1.4)([*prompt, *generated[:3]], logits)
        )


def test_presence_frequency_penalty_is_openai_formula() -> None:
    rng = np.random.default_rng(9)
    logits = rng.standard_normal(200).astype(np.float32)
    generated = rng.integers(0, 50, 120).tolist()
    for presence, frequency in ((0.5, 0.3), (-1.0, 2.0), (0.0, -0.7)):
        ours = presence_frequency_penalty(presence, frequency)(generated, logits)
        expected = logits.astype(np.float64)
        for token in range(200):  # mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence
            count = generated.count(token)
            expected[token] -= count * frequency + (count > 0) * presence
        assert ours.dtype == np.float32
        np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-5)
    assert presence_frequency_penalty(0.5, 0.3)([], logits) is logits


def test_logit_bias_adds_and_checks_the_vocabulary() -> None:
    logits = np.zeros(10, dtype=np.float32)
    out = logit_bias({3: 5.0, "7": -100})([], logits)
    assert out.tolist() == [0, 0, 0, 5.0, 0, 0, 0, -100.0, 0, 0] and out.dtype == np.float32
    np.testing.assert_array_equal(logits, np.zeros(10), err_msg="processors must not modify their input")
    np.testing.assert_array_equal(logit_bias({})([], logits), logits)
    for token in (10, 2**40, 2**64):
        with pytest.raises(SamplingParameterError, match=f"^logit_bias token id {token} is outside the vocabulary"):
            logit_bias({token: 1.0, 2: 1.0})([], logits)


def test_negative_history_ids_are_an_error_not_the_end_of_the_vocabulary() -> None:
    logits = np.zeros(10, dtype=np.float32)
    for process in (repetition_penalty(1.5), presence_frequency_penalty(1.0, 0.0)):
        with pytest.raises(IndexError):
            process([1, -1], logits)
    (process,) = make_logits_processors(repetition_penalty=1.5)
    with pytest.raises(IndexError):
        process([], [2, -3], logits)


PROCESSORS = {
    "repetition": lambda: make_logits_processors(repetition_penalty=1.3)[0],
    "presence/frequency": lambda: make_logits_processors(presence_penalty=0.4, frequency_penalty=0.6)[0],
    "logit_bias": lambda: make_logits_processors(logit_bias={1: 3.0, 4: -2.0})[0],
}


@pytest.mark.parametrize("name", PROCESSORS)
def test_processors_return_a_new_array(name: str) -> None:
    logits = randn(10, 50, 2)
    before = logits.copy()
    out = PROCESSORS[name]()([1, 2, 3], [4, 4, 1], logits)
    np.testing.assert_array_equal(logits, before, err_msg="processors must not modify their input")
    assert out is not logits and not np.array_equal(out, logits)


def test_make_logits_processors_order_and_inputs() -> None:
    assert make_logits_processors() == []
    prompt, generated = [1, 2, 2], [2, 4, 4]
    logits = np.array([1.0, 2.0, -2.0, 3.0, 4.0, 5.0], dtype=np.float32)
    processors = make_logits_processors(
        repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={0: -3.0, 4: 1.0}
    )
    out = logits
    for process in processors:
        out = process(prompt, generated, out)
    # bias: token 0 -> -2.0, 4 -> 5.0; repetition over prompt+generated {1, 2, 4}: 1 -> 1.0, 2 -> -4.0, 4 -> 2.5;
    # presence/frequency over generated only {2: 1, 4: 2}: 2 -> -5.5, 4 -> 0.5 (token 1 from the prompt untouched)
    assert out.tolist() == [-2.0, 1.0, -5.5, 3.0, 0.5, 5.0]


def test_importing_sampling_does_not_import_torch() -> None:
    code = "import sys, edgellm.session.sampling; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)
