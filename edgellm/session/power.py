"""Power modes (D2): threads and pacing for a device that runs on a battery or gets hot.

- ``performance``: every core, no pauses.
- ``balanced``: every core, a short pause every 16 tokens; where the platform exposes a temperature
  (Linux thermal zones or hwmon sensors) it slows down above `hot_c` and says so in the stats.
- ``saver``: half the cores and a pause every 4 tokens: less power, cooler, slower.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationStats

SENSOR_GLOBS = ("class/thermal/thermal_zone*/temp", "class/hwmon/hwmon*/temp*_input")  # millidegrees Celsius
THERMAL_CHECK_EVERY = 8  # tokens between temperature reads


@dataclass(frozen=True)
class PowerMode:
    name: str
    thread_share: float  # of the cores this process may use
    pause_every: int  # tokens between pauses (0: never)
    pause_s: float
    hot_c: float | None = None  # above this temperature, pause `hot_pause_s` after every token
    hot_pause_s: float = 0.0

    def threads(self, cores: int) -> int:
        return max(1, round(cores * self.thread_share))


MODES: dict[str, PowerMode] = {m.name: m for m in (
    PowerMode("performance", 1.0, 0, 0.0),
    PowerMode("balanced", 1.0, 16, 0.005, hot_c=75.0, hot_pause_s=0.03),
    PowerMode("saver", 0.5, 4, 0.02),
)}


def get_mode(name: str) -> PowerMode:
    try:
        return MODES[name]
    except KeyError:
        raise EdgeLLMError(f"unknown power mode {name!r}; known modes: {', '.join(MODES)}") from None


def read_temperature(root: Path = Path("/sys")) -> float | None:
    """The hottest sensor in degrees Celsius, or None where the platform exposes none."""
    hottest = None
    for pattern in SENSOR_GLOBS:
        for path in root.glob(pattern):
            try:
                value = int(path.read_text().strip()) / 1000.0
            except (OSError, ValueError):
                continue
            hottest = value if hottest is None else max(hottest, value)
    return hottest


class Pacer:
    """Called after every token of a request: sleeps as the mode says and records it in the stats."""

    def __init__(self, mode: PowerMode, stats: GenerationStats, sensors: Path = Path("/sys")) -> None:
        self.mode = mode
        self.stats = stats
        self.sensors = sensors
        self.tokens = 0
        self.hot = False

    def after_token(self) -> None:
        self.tokens += 1
        mode, stats = self.mode, self.stats
        if mode.hot_c is not None and self.tokens % THERMAL_CHECK_EVERY == 1:
            temperature = read_temperature(self.sensors)
            if temperature is not None:
                stats.temperature_c = max(stats.temperature_c or temperature, temperature)
            self.hot = temperature is not None and temperature > mode.hot_c
        pause = 0.0
        if self.hot:
            pause = mode.hot_pause_s
            stats.hot_tokens += 1
        elif mode.pause_every and self.tokens % mode.pause_every == 0:
            pause = mode.pause_s
        if pause:
            time.sleep(pause)
            stats.paced_s += pause
