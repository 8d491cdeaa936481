"""Metric functions against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from edgellm.eval import metrics
from edgellm.eval.normalize import clock, iso_date, normalize, number, same

REF = torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.6, 0.3]], dtype=torch.float64).log()
CAND = torch.tensor([[0.25, 0.5, 0.25], [0.1, 0.6, 0.3]], dtype=torch.float64).log()
TARGETS = torch.tensor([0, 2])


def test_kl_hand_computed() -> None:
    kl = metrics.kl_per_position(REF, CAND)
    # 0.5 ln(0.5/0.25) + 0.25 ln(0.25/0.5) + 0.25 ln(1) = 0.25 ln 2; the second row is identical
    assert kl[0].item() == pytest.approx(0.25 * math.log(2), abs=1e-9)
    assert kl[1].item() == pytest.approx(0.0, abs=1e-9)


def test_kl_direction_on_an_asymmetric_pair() -> None:
    p, q = [0.9, 0.05, 0.05], [0.4, 0.4, 0.2]  # KL(p || q) != KL(q || p) here (the pair above is symmetric)
    ref, cand = (torch.tensor([d], dtype=torch.float64).log() for d in (p, q))
    forward = sum(a * math.log(a / b) for a, b in zip(p, q))
    backward = sum(b * math.log(b / a) for a, b in zip(p, q))
    assert abs(forward - backward) > 0.2
    assert metrics.kl_per_position(ref, cand).item() == pytest.approx(forward, abs=1e-12)


def test_perplexity_top1_delta_p_hand_computed() -> None:
    # reference: p(target) = 0.5 and 0.3 → PPL = exp(-(ln .5 + ln .3)/2) = 1/sqrt(0.15)
    assert metrics.perplexity(REF, TARGETS) == pytest.approx(1 / math.sqrt(0.15), rel=1e-9)
    assert metrics.perplexity(CAND, TARGETS) == pytest.approx(1 / math.sqrt(0.25 * 0.3), rel=1e-9)
    assert metrics.top1_agreement(REF, CAND) == 0.5  # argmax 0 vs 1 in row one, 1 vs 1 in row two
    assert metrics.delta_p(REF, CAND, TARGETS).tolist() == pytest.approx([-0.25, 0.0], abs=1e-9)


def test_position_stats_summarize_and_summaries_concatenate() -> None:
    g = metrics.summarize([metrics.position_stats(REF, CAND, TARGETS)])
    assert g.tokens == 2
    assert g.ppl_ratio == pytest.approx(math.sqrt(0.15) / math.sqrt(0.075), rel=1e-9)  # = sqrt(2)
    assert g.kl_mean == pytest.approx(0.125 * math.log(2), abs=1e-9)
    assert g.kl_max == pytest.approx(0.25 * math.log(2), abs=1e-9)
    # p99 of [0, a] with linear interpolation = 0.99 a
    assert g.kl_p99 == pytest.approx(0.99 * 0.25 * math.log(2), abs=1e-9)
    assert g.delta_p_mean == pytest.approx(-0.125, abs=1e-9)
    assert g.delta_p_rms == pytest.approx(math.sqrt(0.25**2 / 2), abs=1e-9)
    split = metrics.summarize([metrics.position_stats(REF[:1], CAND[:1], TARGETS[:1]),
                               metrics.position_stats(REF[1:], CAND[1:], TARGETS[1:])])
    assert split == g
    itself = metrics.summarize([metrics.position_stats(REF, REF, TARGETS)])
    assert (itself.kl_max, itself.top1_agreement, itself.ppl_ratio, itself.delta_p_rms) == (0.0, 1.0, 1.0, 0.0)
    with pytest.raises(ValueError, match="shape mismatch"):
        metrics.position_stats(REF, CAND[:1], TARGETS)


def test_percentile_matches_linear_interpolation() -> None:
    values = torch.arange(101, dtype=torch.float64)  # 0..100
    assert metrics.percentile(values, 99) == pytest.approx(99.0)
    assert metrics.percentile(torch.tensor([1.0, 2.0]), 50) == pytest.approx(1.5)


def test_normalisation_of_numbers_dates_times_text() -> None:
    assert number("$1,250.00") == 1250.0 and number("35元") == 35.0 and number("none") is None
    assert iso_date("March 7, 2025") == iso_date("2025年3月7日") == iso_date("2025/3/7") == "2025-03-07"
    assert iso_date("7 Mar 2025") == "2025-03-07" and iso_date("2025-02-30") is None
    assert clock("2:45 PM") == "14:45" and clock("下午3点半") == "15:30" and clock("6:30") == "06:30"
    assert clock("Room 4B") is None
    assert same("  Blue   Bottle coffee.", "Blue Bottle Coffee", {"type": "string"})
    assert same(["Bob", "alice"], ["Alice", "Bob"], {"type": "array", "items": {"type": "string"}})
    assert same("10", 10, {"type": "integer"}) and not same("11", 10, {"type": "integer"})
    assert normalize("yes", {"type": "boolean"}) is True
    assert not same(None, "x", {"type": "string"})
