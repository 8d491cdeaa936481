"""Where one request runs: the facts about it and the device, and the policy's first matching rule."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping

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


def request_tags(headers: Mapping[str, str], body: Mapping[str, Any]) -> tuple[str | None, bool]:
    """(task, private) from the X-Edgellm-Task / X-Edgellm-Privacy headers or the body's `metadata`."""
    metadata = body.get("metadata") if isinstance(body.get("metadata"), dict) else {}
    lower = {k.lower(): v for k, v in headers.items()}
    task = lower.get(TASK_HEADER) or metadata.get("task")
    privacy = str(lower.get(PRIVACY_HEADER) or metadata.get("privacy") or "").strip().lower()
    return (str(task) if task else None), privacy in ("local", "local-only", "private", "true", "1")


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
