"""Ed25519 keys: make a pair, sign a channel index, and the list of public keys this user trusts.

A public key is written as one line, ``ed25519:<base64 of the 32 raw bytes>``; its id is the first 16
hex digits of its sha256. Trusted keys live in ``$EDGELLM_HOME/trusted-keys.json``, each with the model
names (exact or glob patterns) it may publish.
"""

from __future__ import annotations

import base64
import binascii
import fnmatch
import hashlib
import json
import os
import re
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from edgellm.errors import EdgeLLMError
from edgellm.paths import edgellm_home

_PREFIX = "ed25519:"


class SignatureError(EdgeLLMError):
    """An unsigned, badly signed or untrusted channel index, or an unusable key."""


def public_key_text(key: Ed25519PublicKey) -> str:
    raw = key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return _PREFIX + base64.b64encode(raw).decode("ascii")


def key_id(text: str) -> str:
    return hashlib.sha256(_raw_public(text)).hexdigest()[:16]


def _raw_public(text: str) -> bytes:
    text = text.strip()
    if not text.startswith(_PREFIX):
        raise SignatureError(f"a public key looks like 'ed25519:BASE64', not {text[:24]!r}")
    try:
        raw = base64.b64decode(text[len(_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise SignatureError("the public key is not valid base64") from None
    if len(raw) != 32:
        raise SignatureError(f"an Ed25519 public key has 32 bytes, this one {len(raw)}")
    return raw


def parse_public_key(text: str) -> Ed25519PublicKey:
    return Ed25519PublicKey.from_public_bytes(_raw_public(text))


def generate_keypair(path: Path) -> str:
    """Write a private key (PEM, mode 0600) at ``path`` and its public key at ``path.pub``; return the public key."""
    if path.exists():
        raise EdgeLLMError(f"{path} already exists; refusing to overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    public = public_key_text(key.public_key())
    path.with_name(path.name + ".pub").write_text(public + "\n", encoding="utf-8")
    return public


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise SignatureError(f"no such key file: {path} (make one with `edgellm keygen {path}`)") from None
    except (ValueError, TypeError):
        raise SignatureError(f"{path} is not an unencrypted PEM private key") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SignatureError(f"{path} is not an Ed25519 key")
    return key


def sign(key: Ed25519PrivateKey, payload: bytes) -> str:
    return base64.b64encode(key.sign(payload)).decode("ascii")


def verify(public: str, signature: str, payload: bytes) -> None:
    """SignatureError unless ``signature`` (base64) is ``public``'s signature of ``payload``."""
    try:
        parse_public_key(public).verify(base64.b64decode(signature, validate=True), payload)
    except (InvalidSignature, binascii.Error, ValueError):
        raise SignatureError(f"the channel index signature does not verify with key {key_id(public)}: "
                             "the index was altered or signed by someone else; nothing was changed") from None


# ---- the trust list ---------------------------------------------------------------------------------------
_PATTERN = re.compile(r"^[A-Za-z0-9._+*?\[\]-]{1,64}$")
EVERY_MODEL = ("*",)


@dataclass(frozen=True)
class TrustedKey:
    """A public key the user trusts, and the model names (exact or glob patterns) it may publish."""

    key: str
    models: tuple[str, ...] = EVERY_MODEL
    comment: str = ""
    added: str = ""

    def allows(self, model: str) -> bool:
        return any(fnmatch.fnmatchcase(model, pattern) for pattern in self.models)


def check_patterns(patterns: list[str]) -> tuple[str, ...]:
    """Model-name patterns for ``trust add --models``: names or globs (``*``, ``?``, ``[...]``), at least one."""
    if not patterns:
        raise SignatureError("--models needs at least one model name or glob pattern")
    for pattern in patterns:
        if not _PATTERN.match(pattern):
            raise SignatureError(f"invalid model pattern {pattern!r}: letters, digits, '.', '_', '+', '-' and the "
                                 "glob characters * ? [ ] (at most 64)")
    return tuple(patterns)


def _trust_file() -> Path:
    return edgellm_home() / "trusted-keys.json"


def trusted_keys() -> dict[str, TrustedKey]:
    """key id → the trusted key. An entry written before keys had a scope may publish every model."""
    path = _trust_file()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
        entries = raw.get("keys", {})
        keys = {}
        for kid, v in entries.items():
            if not isinstance(v, dict) or not isinstance(v.get("key"), str):
                continue
            models = v.get("models", list(EVERY_MODEL))
            if not isinstance(models, list) or not all(isinstance(m, str) for m in models):
                raise ValueError(f"key {kid}: 'models' is not a list of names")
            keys[kid] = TrustedKey(v["key"], tuple(models), str(v.get("comment", "")), str(v.get("added", "")))
        return keys
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, AttributeError) as exc:
        raise SignatureError(f"{path} is unreadable ({exc}); fix or delete it and `edgellm trust add` again") from None


def _write_trusted(keys: dict[str, TrustedKey]) -> None:
    path = _trust_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".trusted-keys.{secrets.token_hex(4)}.tmp")
    body = {kid: {"key": k.key, "models": list(k.models), "comment": k.comment, "added": k.added}
            for kid, k in keys.items()}
    tmp.write_text(json.dumps({"keys": body}, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def read_key_argument(value: str) -> str:
    """A public key given inline (``ed25519:...``) or as the path of a ``.pub`` file."""
    if value.strip().startswith(_PREFIX):
        return value.strip()
    try:
        return Path(value).expanduser().read_text(encoding="utf-8").strip()
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError):
        raise SignatureError(f"{value!r} is neither a public key (ed25519:BASE64) nor a readable .pub file") from None


def trust(public: str, comment: str = "", models: tuple[str, ...] = EVERY_MODEL) -> str:
    """Add a public key to the trust list (or replace its entry: scope and comment); returns its id."""
    _raw_public(public)
    kid = key_id(public)
    keys = trusted_keys()
    keys[kid] = TrustedKey(public.strip(), check_patterns(list(models)), comment,
                           time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    _write_trusted(keys)
    return kid


def distrust(kid_or_key: str) -> str:
    keys = trusted_keys()
    kid = key_id(kid_or_key) if kid_or_key.startswith(_PREFIX) else kid_or_key
    if kid not in keys:
        raise SignatureError(f"no trusted key {kid!r}; `edgellm trust list` shows them")
    del keys[kid]
    _write_trusted(keys)
    return kid


def require_trusted(public: str, model: str | None = None) -> None:
    """SignatureError unless this exact key (not only its id) is in the trust list and, when ``model`` is given,
    may publish that model."""
    kid = key_id(public)
    known = trusted_keys().get(kid)
    if known is None or known.key != public.strip():
        raise SignatureError(f"the channel is signed by key {kid}, which you do not trust; "
                             f"if it is the publisher's, run `edgellm trust add {public}`")
    if model is not None and not known.allows(model):
        raise SignatureError(f"key {kid} is trusted only for models {', '.join(known.models)}, not {model!r}: "
                             f"refused; to let it publish {model}: `edgellm trust add {public} --models "
                             f"{' '.join(known.models)} {model}`")
