"""Where one request runs: the facts about it and the device, and the policy's first matching rule."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

from edgellm.errors import EdgeLLMError
from edgellm.router.policy import LOCAL, Policy, Rule

PRIVACY_HEADER = "x-edgellm-privacy"
TASK_HEADER = "x-edgellm-task"
ROUTE_HEADER = "X-Edgellm-Route"
_MIB = 1 << 20


@dataclass(frozen=True)
class RequestFacts:
    """What the rules look at: the request (sizes, task, privacy) and the device's state right now."""

    prompt_tokens: int
    max_tokens: int | None = None
    task: str | None = None
    private: bool = False
    device_tier: str = "mid"
    free_memory_mib: int | None = None
    power_mode: str = "performance"
    queue_depth: int = 0
    wants_json_schema: bool = False


@dataclass(frozen=True)
class Decision:
    """The target ("local" or a remote's name) and why: a rule's name, "default", "privacy" or "schema"."""

    target: str
    reason: str

    @property
    def is_local(self) -> bool:
        return self.target == LOCAL


def _matches(rule: Rule, facts: RequestFacts) -> bool:
    checks = (
        rule.prompt_tokens_over is None or facts.prompt_tokens > rule.prompt_tokens_over,
        rule.prompt_tokens_at_most is None or facts.prompt_tokens <= rule.prompt_tokens_at_most,
        rule.max_tokens_over is None or (facts.max_tokens or 0) > rule.max_tokens_over,
        not rule.task or facts.task in rule.task,
        not rule.device_tier or facts.device_tier in rule.device_tier,
        rule.free_memory_below_mib is None
        or (facts.free_memory_mib is not None and facts.free_memory_mib < rule.free_memory_below_mib),
        not rule.power_mode or facts.power_mode in rule.power_mode,
        rule.queue_depth_over is None or facts.queue_depth > rule.queue_depth_over,
    )
    return all(checks)


def decide(policy: Policy, facts: RequestFacts) -> Decision:
    """The first matching rule's route (or the default); a private request always stays local."""
    if facts.private:
        return Decision(LOCAL, "privacy")
    target, reason = policy.default, "default"
    for rule in policy.rules:
        if _matches(rule, facts):
            target, reason = rule.route, rule.name
            break
    if target != LOCAL and facts.wants_json_schema and not policy.remotes[target].json_schema:
        return Decision(LOCAL, "schema")
    return Decision(target, reason)


# The privacy marker's accepted values, compared case-insensitively; anything else is refused (MarkerError),
# never read as "not private". JSON true/false in metadata.privacy mean the same as "true"/"false".
PRIVATE_VALUES = ("local", "local-only", "private", "true", "1")
NOT_PRIVATE_VALUES = ("public", "false", "0")


class MarkerError(EdgeLLMError):
    """A routing marker (the X-Edgellm-* headers or edgellm's metadata keys) with a value edgellm does not accept;
    `param` names where it was."""

    def __init__(self, param: str, message: str) -> None:
        self.param = param
        super().__init__(message)


def _private(value: object, param: str) -> bool:
    """One privacy marker: True or False for an accepted value, MarkerError for anything else."""
    if isinstance(value, bool):
        return value
    word = value.strip().lower() if isinstance(value, str) else None
    if word in PRIVATE_VALUES:
        return True
    if word in NOT_PRIVATE_VALUES:
        return False
    shown = repr(value)[:80]
    where = "the X-Edgellm-Privacy header" if param == "X-Edgellm-Privacy" else param
    raise MarkerError(param, f"{where} is {shown}; accepted values: {', '.join(PRIVATE_VALUES)} (private: the "
                             f"request never leaves the device) or {', '.join(NOT_PRIVATE_VALUES)} (not private)")


def request_tags(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(task, private) from the X-Edgellm-Task / X-Edgellm-Privacy headers and the body's `metadata`.

    Every privacy marker given must hold an accepted value, and any one that says private makes the request
    private (a header and the metadata may both be given; a repeated header counts each time). `headers` may be
    a plain dict or Starlette's Headers, whose items() keeps repeated headers."""
    metadata = body.get("metadata")
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, Mapping):
        raise MarkerError("metadata", f"metadata must be an object, not {type(metadata).__name__}")
    sent = [(k.lower(), v) for k, v in headers.items()]
    markers = [_private(v, "X-Edgellm-Privacy") for k, v in sent if k == PRIVACY_HEADER]
    if metadata.get("privacy") is not None:
        markers.append(_private(metadata["privacy"], "metadata.privacy"))
    tasks = {v.strip() for k, v in sent if k == TASK_HEADER}
    if len(tasks) > 1:
        raise MarkerError("X-Edgellm-Task", f"the X-Edgellm-Task header was sent {len(tasks)} times with "
                                            "different values; send it once")
    task = next(iter(tasks), None) or metadata.get("task")
    if task is not None and not isinstance(task, str):
        raise MarkerError("metadata.task", f"metadata.task must be a string, not {type(task).__name__}")
    return task or None, any(markers)


def device_state() -> tuple[str, int | None]:
    """(tier, free MiB) from the OS: tier by total memory (low < 4 GiB <= mid < 12 GiB <= high)."""
    info: dict[str, int] = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                info[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    total = info.get("MemTotal")
    if total is None:
        try:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            total = None
    tier = "mid" if total is None else "low" if total < 4 << 30 else "mid" if total < 12 << 30 else "high"
    free = info.get("MemAvailable")
    return tier, None if free is None else free // _MIB
