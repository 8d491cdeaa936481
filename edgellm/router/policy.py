"""The routing policy file (TOML): remote endpoints, ordered rules and fallbacks, validated field by field.

```toml
default = "local"                 # where a request goes when no rule matches: "local" or a remote's name

[[remote]]
name = "cloud"
base_url = "https://api.example.com/v1"
model = "gpt-4o-mini"
api_key_env = "CLOUD_API_KEY"     # the key is read from this environment variable, never from the file
timeout_s = 60
json_schema = true                # false: requests with a json_schema response_format stay local

[[rule]]
name = "long documents"
route = "cloud"
prompt_tokens_over = 2000         # every condition given must hold (AND); a rule with none always matches

[fallback]
local_error = "cloud"             # local engine failed, overloaded or not loaded -> this remote ("none": no)
local_timeout = "cloud"           # local too slow -> this remote
local_timeout_s = 20              # time to the first token (streams) or to the whole reply
remote_error = "local"            # remote unreachable / erroring -> "local" or "error"
remote_rejects_schema = "local"   # remote refuses response_format json_schema -> "local" or "error"
```

A request marked private (header ``X-Edgellm-Privacy: local`` or ``metadata.privacy = "local"``) never
leaves the device, whatever the rules and fallbacks say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from edgellm.errors import EdgeLLMError
from edgellm.router.redact import redact
from edgellm.tomlfile import load_toml

LOCAL = "local"
DEVICE_TIERS = ("low", "mid", "high")
POWER_MODES = ("performance", "balanced", "saver")


class PolicyError(EdgeLLMError):
    """A routing policy file that cannot be read or has a bad field."""


@dataclass(frozen=True)
class Remote:
    """An OpenAI-compatible endpoint requests may be sent to."""

    name: str
    base_url: str
    model: str
    api_key_env: str | None = None
    timeout_s: float = 60.0
    json_schema: bool = True


@dataclass(frozen=True)
class Rule:
    """Route to `route` when every condition that is set holds."""

    name: str
    route: str
    prompt_tokens_over: int | None = None
    prompt_tokens_at_most: int | None = None
    max_tokens_over: int | None = None
    task: tuple[str, ...] = ()
    device_tier: tuple[str, ...] = ()
    free_memory_below_mib: int | None = None
    power_mode: tuple[str, ...] = ()
    queue_depth_over: int | None = None


@dataclass(frozen=True)
class Fallback:
    local_error: str | None = None
    local_timeout: str | None = None
    local_timeout_s: float | None = None
    remote_error: str = LOCAL  # "local" or "error"
    remote_rejects_schema: str = LOCAL  # "local" or "error"


@dataclass(frozen=True)
class Policy:
    remotes: dict[str, Remote]
    rules: tuple[Rule, ...] = ()
    default: str = LOCAL
    fallback: Fallback = field(default_factory=Fallback)


# ---------------------------------------------------------------------------------------------- parsing

_TOP = {"default", "remote", "rule", "fallback"}


class _Fields:
    """Reads one table, naming the table in every error, and refuses fields it was not asked about."""

    def __init__(self, where: str, table: Any) -> None:
        if not isinstance(table, dict):
            raise PolicyError(f"{where} must be a table, not {type(table).__name__}")
        self.where = where
        self.table = table
        self.used: set[str] = set()

    def _get(self, key: str, kinds: tuple[type, ...], what: str) -> Any:
        self.used.add(key)
        value = self.table.get(key)
        if value is None:
            return None
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            raise PolicyError(f"{self.where}: {key} must be {what}, not {value!r}")
        return value

    def text(self, key: str, *, required: bool = False) -> str | None:
        value = self._get(key, (str,), "a string")
        if required and not value:
            raise PolicyError(f"{self.where}: {key} is required")
        return value

    def count(self, key: str) -> int | None:
        value = self._get(key, (int,), "a whole number >= 0")
        if value is not None and value < 0:
            raise PolicyError(f"{self.where}: {key} must be a whole number >= 0, not {value!r}")
        return value

    def seconds(self, key: str) -> float | None:
        value = self._get(key, (int, float), "a number of seconds > 0")
        if value is not None and not (value > 0 and math.isfinite(value)):
            raise PolicyError(f"{self.where}: {key} must be a number of seconds > 0, not {value!r}")
        return None if value is None else float(value)

    def flag(self, key: str) -> bool | None:
        return self._get(key, (bool,), "true or false")

    def choices(self, key: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
        value = self._get(key, (str, list), f"one of {', '.join(allowed)} or a list of them")
        items = [value] if isinstance(value, str) else list(value or [])
        for item in items:
            if item not in allowed:
                raise PolicyError(f"{self.where}: {key} has {item!r}; expected one of {', '.join(allowed)}")
        return tuple(items)

    def words(self, key: str) -> tuple[str, ...]:
        value = self._get(key, (str, list), "a string or a list of strings")
        items = [value] if isinstance(value, str) else list(value or [])
        if not all(isinstance(item, str) and item for item in items):
            raise PolicyError(f"{self.where}: {key} must be non-empty strings")
        return tuple(items)

    def done(self) -> None:
        unknown = sorted(set(self.table) - self.used)
        if unknown:
            raise PolicyError(f"{self.where}: unknown field {unknown[0]!r}")


def _remote(i: int, table: Any) -> Remote:
    f = _Fields(f"remote {i + 1}", table)
    name = f.text("name", required=True)
    f.where = f"remote {name!r}"
    base_url = f.text("base_url", required=True)
    url = urlparse(base_url or "")
    if url.scheme not in ("http", "https") or not url.netloc:
        raise PolicyError(f"{f.where}: base_url must be an http(s) URL, not {redact(base_url or '')!r}")
    remote = Remote(
        name=name or "",
        base_url=(base_url or "").rstrip("/"),
        model=f.text("model", required=True) or "",
        api_key_env=f.text("api_key_env"),
        timeout_s=f.seconds("timeout_s") or 60.0,
        json_schema=f.flag("json_schema") is not False,
    )
    f.done()
    if name == LOCAL:
        raise PolicyError(f"{f.where}: the name {LOCAL!r} is reserved for the device's own engine")
    return remote


def _rule(i: int, table: Any, targets: set[str]) -> Rule:
    f = _Fields(f"rule {i + 1}", table)
    name = f.text("name") or f"rule {i + 1}"
    f.where = f"rule {i + 1} ({name})" if name != f"rule {i + 1}" else name
    route = f.text("route", required=True)
    if route not in targets:
        raise PolicyError(f"{f.where}: route {route!r} is neither 'local' nor a remote ({', '.join(sorted(targets))})")
    rule = Rule(
        name=name,
        route=route or LOCAL,
        prompt_tokens_over=f.count("prompt_tokens_over"),
        prompt_tokens_at_most=f.count("prompt_tokens_at_most"),
        max_tokens_over=f.count("max_tokens_over"),
        task=f.words("task"),
        device_tier=f.choices("device_tier", DEVICE_TIERS),
        free_memory_below_mib=f.count("free_memory_below_mib"),
        power_mode=f.choices("power_mode", POWER_MODES),
        queue_depth_over=f.count("queue_depth_over"),
    )
    f.done()
    return rule


def _fallback(table: Any, remotes: dict[str, Remote]) -> Fallback:
    f = _Fields("fallback", table)

    def to_remote(key: str) -> str | None:
        value = f.text(key)
        if value in (None, "none"):
            return None
        if value not in remotes:
            raise PolicyError(f"fallback: {key} {value!r} is not a remote ({', '.join(sorted(remotes)) or 'none defined'})")
        return value

    def either(key: str) -> str:
        value = f.text(key) or LOCAL
        if value not in (LOCAL, "error"):
            raise PolicyError(f"fallback: {key} must be 'local' or 'error', not {value!r}")
        return value

    result = Fallback(
        local_error=to_remote("local_error"),
        local_timeout=to_remote("local_timeout"),
        local_timeout_s=f.seconds("local_timeout_s"),
        remote_error=either("remote_error"),
        remote_rejects_schema=either("remote_rejects_schema"),
    )
    f.done()
    if result.local_timeout and result.local_timeout_s is None:
        raise PolicyError("fallback: local_timeout needs local_timeout_s")
    return result


def parse_policy(raw: dict[str, Any]) -> Policy:
    """A validated Policy from the file's parsed TOML; PolicyError names the first bad field."""
    unknown = sorted(set(raw) - _TOP)
    if unknown:
        raise PolicyError(f"unknown top-level field {unknown[0]!r}; expected {', '.join(sorted(_TOP))}")
    remote_tables = raw.get("remote", [])
    rule_tables = raw.get("rule", [])
    for key, value in (("remote", remote_tables), ("rule", rule_tables)):
        if not isinstance(value, list):
            raise PolicyError(f"{key} must be an array of tables ([[{key}]])")
    remotes: dict[str, Remote] = {}
    for i, table in enumerate(remote_tables):
        remote = _remote(i, table)
        if remote.name in remotes:
            raise PolicyError(f"remote {remote.name!r} is defined twice")
        remotes[remote.name] = remote
    targets = {LOCAL, *remotes}
    rules = tuple(_rule(i, table, targets) for i, table in enumerate(rule_tables))
    default = raw.get("default", LOCAL)
    if default not in targets:
        raise PolicyError(f"default {default!r} is neither 'local' nor a remote ({', '.join(sorted(targets))})")
    return Policy(remotes, rules, default, _fallback(raw.get("fallback", {}), remotes))


def load_policy(path: str | Path) -> Policy:
    """Read and validate a policy file; every problem is one PolicyError line naming the file."""
    return load_toml(path, "routing policy", parse_policy, PolicyError)
