"""Sending a request, unchanged but for the model name, to a remote OpenAI-compatible endpoint."""

from __future__ import annotations

import json
import os
from typing import Any, AsyncIterator
from urllib.parse import urlsplit, urlunsplit

import httpx

from edgellm.router.policy import Remote
from edgellm.router.redact import redact, remote_secrets

_OWN_METADATA = ("task", "privacy")


class RemoteFailure(Exception):
    """The remote did not answer with a success: unreachable, timed out, or an error status."""

    def __init__(self, remote: str, message: str, *, status: int | None = None, schema_rejected: bool = False) -> None:
        self.remote = remote
        self.status = status
        self.schema_rejected = schema_rejected
        super().__init__(f"remote {remote!r}: {message}")


def outgoing_body(remote: Remote, body: dict[str, Any]) -> dict[str, Any]:
    """The request for `remote`: its model name, and none of edgellm's own routing metadata."""
    out = {**body, "model": remote.model}
    metadata = out.get("metadata")
    if isinstance(metadata, dict):
        rest = {k: v for k, v in metadata.items() if k not in _OWN_METADATA}
        if rest:
            out["metadata"] = rest
        else:
            out.pop("metadata")
    return out


def endpoint_url(remote: Remote, path: str) -> str:
    """`path` under the remote's base_url, before its query (a base_url may carry one, e.g. ?api-version=...)."""
    url = urlsplit(remote.base_url)
    return urlunsplit(url._replace(path=url.path.rstrip("/") + path))


def _headers(remote: Remote) -> dict[str, str]:
    key = os.environ.get(remote.api_key_env, "") if remote.api_key_env else ""
    return {"Authorization": f"Bearer {key}"} if key else {}


def _failure(remote: Remote, status: int, raw: bytes) -> RemoteFailure:
    """A RemoteFailure from an error response, telling whether the remote refused the response_format; its
    message, passed on to the client, is redacted (a remote may echo the request's Authorization header)."""
    try:
        error = json.loads(raw).get("error") or {}
        message = str(error.get("message") or raw[:200].decode("utf-8", "replace"))
        param = str(error.get("param") or "")
    except (ValueError, AttributeError):
        message, param = raw[:200].decode("utf-8", "replace"), ""
    rejected = status in (400, 422) and ("response_format" in param or "json_schema" in message
                                         or "response_format" in message)
    message = redact(message, remote_secrets(remote))
    return RemoteFailure(remote.name, f"HTTP {status}: {message}", status=status, schema_rejected=rejected)


def _transport(remote: Remote, exc: httpx.HTTPError) -> RemoteFailure:
    kind = "timed out" if isinstance(exc, httpx.TimeoutException) else "unreachable"
    where = redact(remote.base_url, remote_secrets(remote))
    return RemoteFailure(remote.name, f"{kind} at {where} ({type(exc).__name__})")


class RemoteStream:
    """An accepted streamed response: its server-sent-event lines, then close."""

    def __init__(self, client: httpx.AsyncClient, response: httpx.Response, remote: Remote) -> None:
        self._client = client
        self._response = response
        self._remote = remote

    async def lines(self) -> AsyncIterator[str]:
        try:
            async for line in self._response.aiter_lines():
                yield line
        except httpx.HTTPError as exc:
            raise _transport(self._remote, exc) from None

    async def close(self) -> None:
        await self._response.aclose()
        await self._client.aclose()


async def post(remote: Remote, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The remote's JSON reply to a whole (non-streamed) request; RemoteFailure otherwise."""
    try:
        async with httpx.AsyncClient(timeout=remote.timeout_s) as client:
            response = await client.post(endpoint_url(remote, path), json=outgoing_body(remote, body),
                                         headers=_headers(remote))
    except httpx.HTTPError as exc:
        raise _transport(remote, exc) from None
    return _reply(remote, response)


def _reply(remote: Remote, response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a whole reply; RemoteFailure for an error status or a body that is not JSON."""
    if response.status_code != 200:
        raise _failure(remote, response.status_code, response.content)
    try:
        return response.json()
    except ValueError:
        raise RemoteFailure(remote.name, "answered with a body that is not JSON", status=200) from None


async def open_stream(remote: Remote, path: str, body: dict[str, Any]) -> RemoteStream:
    """Start a streamed request; returns once the remote accepted it (so a refusal can still fall back)."""
    client = httpx.AsyncClient(timeout=remote.timeout_s)
    try:
        request = client.build_request("POST", endpoint_url(remote, path), json=outgoing_body(remote, body),
                                       headers=_headers(remote))
        response = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        await client.aclose()
        raise _transport(remote, exc) from None
    if response.status_code != 200:
        raw = await response.aread()
        await response.aclose()
        await client.aclose()
        raise _failure(remote, response.status_code, raw)
    return RemoteStream(client, response, remote)


def post_sync(remote: Remote, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """`post` for callers without an event loop (the Python API)."""
    try:
        response = httpx.post(endpoint_url(remote, path), json=outgoing_body(remote, body), headers=_headers(remote),
                              timeout=remote.timeout_s)
    except httpx.HTTPError as exc:
        raise _transport(remote, exc) from None
    return _reply(remote, response)
