"""Never blank (D6): when local generation fails or misses its deadline, a caller's rule-based function answers.

The rule is any callable ``rule(request, reason) -> str``: ``request`` is what the caller asked (prompt
text or token ids, or the chat messages) and ``reason`` says in words why the model did not answer.
The result is flagged (``GenerationResult.fallback``) so no one mistakes it for the model's output.
A generation past its deadline is stopped at its next token; the caller gets the fallback at the deadline.
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

from edgellm.errors import EdgeLLMError
from edgellm.generation import GenerationParams, GenerationResult, GenerationStats

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from edgellm.runtime.engine import Engine

FallbackRule = Callable[[Any, str], str]


class _Cancelled(Exception):
    """Raised inside the generation (from a logits processor) to stop it at the next token."""


def load_rule(spec: str) -> FallbackRule:
    """`module:function` → the function; EdgeLLMError with one line when it cannot be imported or called."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise EdgeLLMError(f"fallback {spec!r} must be MODULE:FUNCTION, e.g. myrules:answer")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the caller's module's
        raise EdgeLLMError(f"cannot import the fallback module {module_name!r}: {type(exc).__name__}: {exc}") from None
    rule = getattr(module, attr, None)
    if not callable(rule):
        raise EdgeLLMError(f"{module_name} has no function {attr!r} for the fallback")
    return rule


def answer(rule: FallbackRule, request: Any, reason: str) -> GenerationResult:
    """The rule's answer as a result flagged as a fallback (a rule that fails raises EdgeLLMError)."""
    try:
        text = rule(request, reason)
    except Exception as exc:  # noqa: BLE001 - the rule is the caller's code
        raise EdgeLLMError(f"the fallback failed too ({reason}): {type(exc).__name__}: {exc}") from None
    if not isinstance(text, str):
        raise EdgeLLMError(f"the fallback returned {type(text).__name__}, not text ({reason})")
    return GenerationResult(text, [], "stop", GenerationStats(), fallback=True, fallback_reason=reason)


def _is_messages(prompt: str | Sequence[int] | Sequence[dict[str, Any]]) -> TypeIs[Sequence[dict[str, Any]]]:
    """Whether `prompt` is chat messages (a non-empty list or tuple of dicts), not text or token ids."""
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def generate_with_fallback(engine: Engine, prompt: str | Sequence[int] | Sequence[dict[str, Any]],
                           params: GenerationParams | None = None, *, rule: FallbackRule,
                           deadline_s: float | None = None) -> GenerationResult:
    """engine.generate (or engine.chat, for a list of messages), or `rule`'s answer on failure or deadline."""
    params = params or GenerationParams()
    stop = threading.Event()

    def cancel_check(generated: Sequence[int], logits: Any) -> Any:
        if stop.is_set():
            raise _Cancelled()
        return logits

    guarded = replace(params, logits_processors=(cancel_check, *params.logits_processors))
    outcome: dict[str, Any] = {}

    def work() -> None:
        try:
            outcome["result"] = (engine.chat(prompt, guarded) if _is_messages(prompt)
                                 else engine.generate(prompt, guarded))
        except _Cancelled:
            pass
        except Exception as exc:  # noqa: BLE001 - every failure turns into the fallback
            outcome["error"] = exc

    worker = threading.Thread(target=work, name="edgellm-generate", daemon=True)
    worker.start()
    worker.join(deadline_s)
    if worker.is_alive():
        stop.set()
        reason = f"no answer within the deadline of {deadline_s:g} s"
    elif "error" in outcome:
        exc = outcome["error"]
        reason = f"generation failed: {exc}" if isinstance(exc, EdgeLLMError) else \
            f"generation failed: {type(exc).__name__}"
    else:
        return outcome["result"]
    return answer(rule, prompt, reason)
