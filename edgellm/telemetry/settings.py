"""Telemetry settings in ``$EDGELLM_HOME/telemetry/settings.json``; off unless the user turned it on."""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from edgellm.errors import EdgeLLMError
from edgellm.paths import edgellm_home

LEVELS = ("basic", "full")  # basic: which model, device, outcome; full: + token counts, latencies, memory


@dataclass(frozen=True)
class Settings:
    enabled: bool = False
    sample_rate: float = 1.0  # fraction of generations recorded
    level: str = "full"
    max_db_mib: float = 16.0  # the database is trimmed (oldest events first) above this size

    def validated(self) -> Settings:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise EdgeLLMError(f"sample rate must be between 0 and 1, not {self.sample_rate}")
        if self.level not in LEVELS:
            raise EdgeLLMError(f"telemetry level must be one of {', '.join(LEVELS)}, not {self.level!r}")
        if self.max_db_mib <= 0:
            raise EdgeLLMError("the database size cap must be positive")
        return self


def telemetry_dir() -> Path:
    return edgellm_home() / "telemetry"


def _settings_file() -> Path:
    return telemetry_dir() / "settings.json"


def load_settings() -> Settings:
    """The saved settings; ``EDGELLM_TELEMETRY=0`` turns recording off whatever they say."""
    try:
        raw = json.loads(_settings_file().read_text(encoding="utf-8"))
        known = {k: raw[k] for k in Settings.__dataclass_fields__ if k in raw}
        settings = Settings(**known).validated()
    except (FileNotFoundError, json.JSONDecodeError, TypeError, EdgeLLMError, AttributeError):
        settings = Settings()
    if os.environ.get("EDGELLM_TELEMETRY", "").strip() == "0":
        settings = replace(settings, enabled=False)
    return settings


def save_settings(settings: Settings) -> Settings:
    settings.validated()
    path = _settings_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".settings.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(asdict(settings), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return settings
