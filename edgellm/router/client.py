"""The router from Python: the same policy and decisions as `edgellm serve --route`, for chat messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

from edgellm.errors import EdgeLLMError
from edgellm.router.decide import Decision, RequestFacts, decide, device_state
from edgellm.router.policy import LOCAL, Policy
from edgellm.router.remote import RemoteFailure, post_sync

if TYPE_CHECKING:
    from edgellm.generation import GenerationParams, GenerationResult


class RoutingError(EdgeLLMError):
    """Every route the policy allowed for a request failed."""


@dataclass(frozen=True)
class RoutedReply:
    """A reply and where it ran: `route` is "local" or "remote:NAME"; `fallback` says why it was not the first choice."""

    text: str
    finish_reason: str
    route: str
    reason: str
    fallback: str | None = None


# one way to answer: (target, decision, request, why it is a fallback) -> reply
_Route = Callable[[str, Decision, dict[str, Any], "str | None"], RoutedReply]


class LocalEngine(Protocol):
    """What the client needs of the local engine (runtime/engine.py's Engine has it)."""

    def render(self, messages: Sequence[dict[str, Any]]) -> str: ...

    def encode(self, prompt: str) -> list[int]: ...

    def chat(self, messages: Sequence[dict[str, Any]], params: GenerationParams | None = None) -> GenerationResult: ...


class HybridClient:
    """Chat through a routing policy: `engine` answers locally (an Engine, or anything with its three methods)."""

    def __init__(self, policy: Policy, engine: LocalEngine, *, power_mode: str = "performance") -> None:
        self.policy = policy
        self.engine = engine
        self.power_mode = power_mode

    def chat(self, messages: Sequence[dict[str, Any]], *, max_tokens: int | None = None,
             temperature: float | None = None, task: str | None = None, private: bool = False) -> RoutedReply:
        """One reply, routed by the policy; local failures and remote failures fall back as the policy allows."""
        tier, free = device_state()
        facts = RequestFacts(prompt_tokens=len(self.engine.encode(self.engine.render(messages))),
                             max_tokens=max_tokens, task=task, private=private, device_tier=tier,
                             free_memory_mib=free, power_mode=self.power_mode)
        decision = decide(self.policy, facts)
        first: _Route = self._local
        second: _Route = self._remote
        if decision.is_local:
            allowed = None if private else self.policy.fallback.local_error
        else:
            first, second = second, first
            allowed = LOCAL if self.policy.fallback.remote_error == LOCAL else None
        request = {"messages": list(messages), "max_tokens": max_tokens, "temperature": temperature}
        try:
            return first(decision.target, decision, request, None)
        except (EdgeLLMError, RemoteFailure) as exc:
            if allowed is None:
                raise RoutingError(f"{decision.target} failed ({exc}) and the policy allows no fallback") from None
            why = "local_error" if decision.is_local else "remote_error"
            try:
                return second(allowed, decision, request, why)
            except (EdgeLLMError, RemoteFailure) as again:
                raise RoutingError(f"{decision.target} failed ({exc}) and so did {allowed} ({again})") from None

    def _local(self, _: str, decision: Decision, request: dict[str, Any], fallback: str | None) -> RoutedReply:
        from edgellm.generation import GenerationParams

        params = GenerationParams(max_tokens=request["max_tokens"], temperature=request["temperature"])
        result = self.engine.chat(request["messages"], params)
        return RoutedReply(result.text, result.finish_reason, LOCAL, decision.reason, fallback)

    def _remote(self, name: str, decision: Decision, request: dict[str, Any], fallback: str | None) -> RoutedReply:
        body = {k: v for k, v in request.items() if v is not None}
        reply = post_sync(self.policy.remotes[name], "/chat/completions", body)
        try:
            choice = reply["choices"][0]
            return RoutedReply(choice["message"].get("content") or "", choice.get("finish_reason") or "stop",
                               f"remote:{name}", decision.reason, fallback)
        except (KeyError, IndexError, TypeError, AttributeError):
            raise RemoteFailure(name, "answered without choices[0].message") from None

