"""Credentials out of every message, body and log line that may show a remote's URL or its answer.

One function, `redact`, is used wherever such text leaves edgellm: the errors and 502 bodies built from a remote's
failure, the policy file's errors, and (as a logging filter) every log line of `edgellm serve`. It masks the
credentials it is told about (a remote's API key, the user and password of its `base_url`, secret query values),
and wherever they appear in the shapes credentials take: `user:pass@` in a URL, a secret-named query parameter,
an `Authorization` value, a `Bearer`/`Basic` token.
"""

from __future__ import annotations

import base64
import logging
import os
import re
from typing import Iterable, Protocol
from urllib.parse import parse_qsl, unquote, urlsplit

MASK = "***"
MIN_SECRET_CHARS = 4  # a shorter known value is not masked wherever it appears (it would garble the text); the
# shape patterns below still mask it in a URL or a header
_SECRET_NAMES = r"(?:api[-_]?key|key|token|access[-_]?token|auth|secret|password|passwd|sig|signature)"
_PATTERNS = (
    (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]*@"), r"\1" + MASK + "@"),  # user:pass@ in a URL
    (re.compile(r"(?i)([?&;]" + _SECRET_NAMES + r"=)[^&#\s\"']*"), r"\1" + MASK),  # ?api-key=... in a URL
    (re.compile(r"(?i)(\bauthorization[\"']?\s*[:=]\s*[\"']?)(?:(?:bearer|basic)\s+)?[^\s\"',}]+"), r"\1" + MASK),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]{4,}"), r"\1 " + MASK),
    (re.compile(r"(?i)([\"']?" + _SECRET_NAMES + r"[\"']?\s*[:=]\s*[\"'])[^\"']+"), r"\1" + MASK),  # "api_key": "..."
)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with each known secret (of MIN_SECRET_CHARS or more) and every credential-shaped span masked."""
    for secret in sorted({s for s in secrets if len(s) >= MIN_SECRET_CHARS}, key=len, reverse=True):
        text = text.replace(secret, MASK)
    for pattern, replacement in _PATTERNS:
        text = pattern.sub(replacement, text)
    return text


class Endpoint(Protocol):
    """What `remote_secrets` reads of a remote (policy.Remote has it; policy imports this module, not back)."""

    @property
    def base_url(self) -> str: ...

    @property
    def api_key_env(self) -> str | None: ...


def remote_secrets(remote: Endpoint) -> tuple[str, ...]:
    """The credentials a remote's requests carry: its API key (from the environment), its base_url's user and
    password (as written, decoded, and as the Basic token httpx sends), and its secret-named query values."""
    found: list[str] = []
    if remote.api_key_env and os.environ.get(remote.api_key_env):
        found.append(os.environ[remote.api_key_env])
    url = urlsplit(remote.base_url)
    userinfo, at, _ = url.netloc.rpartition("@")
    if at:
        user, _, password = userinfo.partition(":")
        found += [userinfo, user, password, unquote(user), unquote(password)]
        pair = f"{unquote(user)}:{unquote(password)}".encode()
        found.append(base64.b64encode(pair).decode("ascii"))
    name = re.compile(_SECRET_NAMES + "$", re.IGNORECASE)
    for key, value in parse_qsl(url.query, keep_blank_values=False):
        if name.match(key):
            found.append(value)
    return tuple(s for s in found if s)


class RedactingFilter(logging.Filter):
    """A handler filter that masks credentials in every record it passes (the formatted message)."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secrets)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        clean = redact(message, self.secrets)
        if clean != message:
            record.msg, record.args = clean, None
        return True
