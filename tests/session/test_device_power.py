"""Power modes: threads, pauses every N tokens, and slowing down above a temperature (fake sensors)."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams, GenerationStats
from edgellm.session.power import MODES, Pacer, get_mode, read_temperature
from tests.support.tiny import tiny_engine


def sensors(root: Path, zone_mc: int, hwmon_mc: int) -> Path:
    zone = root / "class/thermal/thermal_zone0"
    hwmon = root / "class/hwmon/hwmon3"
    zone.mkdir(parents=True)
    hwmon.mkdir(parents=True)
    (zone / "temp").write_text(f"{zone_mc}\n")
    (hwmon / "temp1_input").write_text(f"{hwmon_mc}\n")
    (hwmon / "temp2_input").write_text("garbage\n")  # unreadable sensors are skipped
    return root


def test_temperature_is_the_hottest_sensor(tmp_path: Path) -> None:
    assert read_temperature(sensors(tmp_path / "a", 41000, 82500)) == 82.5
    assert read_temperature(tmp_path / "none") is None


def test_balanced_slows_down_only_when_hot(tmp_path: Path) -> None:
    balanced = MODES["balanced"]
    assert balanced.hot_c is not None
    hot = GenerationStats()
    pacer = Pacer(balanced, hot, sensors(tmp_path / "hot", 90000, 30000))
    for _ in range(20):
        pacer.after_token()
    assert hot.hot_tokens == 20 and hot.temperature_c == 90.0
    assert hot.paced_s == pytest.approx(20 * balanced.hot_pause_s)
    cool = GenerationStats()
    pacer = Pacer(balanced, cool, sensors(tmp_path / "cool", 40000, 30000))
    for _ in range(32):
        pacer.after_token()
    assert cool.hot_tokens == 0 and cool.temperature_c == 40.0
    assert cool.paced_s == pytest.approx(2 * balanced.pause_s)  # one pause every 16 tokens


def test_modes_set_threads_and_unknown_modes_are_refused() -> None:
    assert get_mode("saver").threads(8) == 4 and get_mode("saver").threads(1) == 1
    assert get_mode("performance").threads(8) == 8
    with pytest.raises(EdgeLLMError, match="unknown power mode 'turbo'; known modes: performance, balanced, saver"):
        get_mode("turbo")


def test_saver_paces_a_generation(tmp_path: Path) -> None:
    engine = tiny_engine(tmp_path, "llama", tied=True)
    from edgellm.runtime.engine import Engine

    saver = Engine(engine.artifact, power="saver")
    saver_mode = MODES["saver"]
    r = saver.generate("t1 t2", GenerationParams(max_tokens=9, ignore_eos=True))
    # a pause follows tokens 4 and 8; none follows the last token, where the stream ends
    assert len(r.token_ids) == 9 and r.stats.paced_s == pytest.approx(2 * saver_mode.pause_s)
    assert r.stats.as_dict()["paced_s"] == pytest.approx(0.04)
    plain = engine.generate("t1 t2", GenerationParams(max_tokens=8, ignore_eos=True))
    assert plain.stats.paced_s == 0 and plain.stats.hot_tokens == 0
