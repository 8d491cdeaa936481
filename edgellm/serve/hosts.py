"""Which `Host` headers the server answers: the guard against DNS rebinding.

A web page on a name its owner rebinds to 127.0.0.1 reaches a loopback server with that name in `Host`
(the browser thinks it talks to the page's own origin, so CORS does not apply). Refusing every name the
server was not told about closes that door; IP literals cannot be rebound, so a wildcard bind accepts them.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Iterable

from edgellm.errors import EdgeLLMError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"  # --allowed-host '*': answer every Host (the check is off)
_WILDCARD_BINDS = ("0.0.0.0", "::", "")


def host_name(value: str) -> str | None:
    """The host part of a `Host` header or an address, lower-case, IPv6 without brackets, without the port or a
    trailing dot; None for a malformed value (an unclosed bracket, a port that is not a number)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, closed, rest = value[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            return None
        port = rest[1:] if rest else None
    elif value.count(":") == 1:
        name, port = value.split(":")
    else:  # a name, or an unbracketed IPv6 address (an address given to --host)
        name, port = value, None
    if port is not None and not port.isdigit():
        return None
    name = name.rstrip(".")
    return name or None


def _is_ip_literal(name: str) -> bool:
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return False
    return not address.is_unspecified  # 0.0.0.0 and :: reach a loopback server but name no one's address


@dataclass(frozen=True)
class HostAllowList:
    """The host names a request's `Host` may carry (any port): loopback, the bound address, the --allowed-host
    names; with a wildcard bind (0.0.0.0, ::) also any IP address but the unspecified ones."""

    names: frozenset[str] = frozenset(LOOPBACK_NAMES)
    ip_literals: bool = False
    any_host: bool = False

    @classmethod
    def for_bind(cls, bound: str, extra: Iterable[str] = ()) -> "HostAllowList":
        """The allow-list of a server bound to `bound` with the `--allowed-host` values `extra`."""
        names = set(LOOPBACK_NAMES)
        any_host = False
        for value in extra:
            if value.strip() == ANY_HOST:
                any_host = True
                continue
            name = host_name(value)
            if name is None or any(c in name for c in "/ @?#\\"):
                raise EdgeLLMError(f"--allowed-host {value!r} is not a host name or address")
            names.add(name)
        wildcard = bound.strip() in _WILDCARD_BINDS
        if not wildcard:
            name = host_name(bound)
            if name is not None:
                names.add(name)
        return cls(frozenset(names), ip_literals=wildcard, any_host=any_host)

    def allows(self, host: str) -> bool:
        """Whether a request with this `Host` header value is answered."""
        if self.any_host:
            return True
        name = host_name(host)
        if name is None:
            return False
        return name in self.names or (self.ip_literals and _is_ip_literal(name))

    def described(self) -> str:
        """The allowed hosts in words, for the refusal and the start-up log."""
        if self.any_host:
            return "any host"
        shown = ", ".join(f"[{n}]" if ":" in n else n for n in sorted(self.names))
        return shown + (", and any IP address" if self.ip_literals else "")
