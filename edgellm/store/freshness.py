"""Freshness of channel indexes: a replayed older index or a frozen channel is refused.

A signature proves who wrote an index, not when: a mirror (or anyone between the device and the channel)
can keep serving an older, genuinely signed index. So the store remembers, per channel, the newest index
it has accepted — in ``store/channels.json``, replaced atomically under the store lock::

    {"channels": {IDENTITY: {"sequence": N, "updated": T, "digest": SHA256}}, "sequenced_keys": [KEY_ID, ...]}

and refuses, in one line:

- an index whose ``expires`` has passed (the channel stopped being re-signed: frozen, or a replay of one);
- an index with a lower ``sequence`` than the newest seen for the same channel (a replay), or the same
  sequence with other contents (the key signed two different indexes under one number);
- an index without ``sequence``/``expires`` (written by an edgellm before they existed) once its key has been
  seen signing indexes that have them — such an index can only be a replay of an old one. Before that it
  is accepted with a warning, and only if its ``updated`` is not older than the newest seen for its location.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgellm.store.channel import TIME_FORMAT, ChannelError, SignedIndex
from edgellm.store.local import Store
from edgellm.store.trust import key_id

STATE_FILE = "channels.json"


def check_expiry(index: SignedIndex, now: float | None = None) -> None:
    """ChannelError if the index has expired."""
    if index.expires is None:
        return
    stamp = time.strftime(TIME_FORMAT, time.gmtime(time.time() if now is None else now))
    if stamp > index.expires:  # both UTC in the same fixed format: text order is time order
        raise ChannelError(f"the channel index of {index.location} expired at {index.expires} (now {stamp}): the "
                           "channel is frozen or replayed, or its publisher has not run `edgellm refresh-channel`; "
                           "nothing was changed")


def accept(store: Store, index: SignedIndex, say: Callable[[str], None], now: float | None = None) -> None:
    """Refuse an expired, older or legacy-after-new index; otherwise remember it as the newest seen."""
    check_expiry(index, now)
    kid = key_id(index.key)
    with store.locked():
        state = _load(store.root / STATE_FILE)
        seen = state["channels"].get(index.identity)
        if index.sequence is None:
            if kid in state["sequenced_keys"]:
                raise ChannelError(f"the channel index of {index.location} has no sequence or expiry, but key {kid} "
                                   "has signed indexes that do: an old index replayed; nothing was changed")
            if seen and index.updated < seen["updated"]:
                raise ChannelError(_older(index, f"updated {index.updated}", f"updated {seen['updated']}"))
            say(f"warning: the channel index of {index.location} has no sequence or expiry (published by an older "
                "edgellm), so a replay of it cannot be told apart; ask its publisher to run `edgellm refresh-channel`")
        elif seen is not None and seen.get("sequence") is not None:
            if index.sequence < seen["sequence"]:
                raise ChannelError(_older(index, f"sequence {index.sequence}", f"sequence {seen['sequence']}"))
            if index.sequence == seen["sequence"] and index.digest != seen["digest"]:
                raise ChannelError(f"the channel index of {index.location} has sequence {index.sequence}, like the "
                                   "one seen before, but other contents: its key signed two different indexes; "
                                   "nothing was changed")
        state["channels"][index.identity] = {"sequence": index.sequence, "updated": index.updated,
                                             "digest": index.digest}
        if index.sequence is not None and kid not in state["sequenced_keys"]:
            state["sequenced_keys"].append(kid)
        _save(store.root / STATE_FILE, state)


def _older(index: SignedIndex, got: str, seen: str) -> str:
    return (f"the channel index of {index.location} is older than one seen before ({got}, seen {seen}): a replayed "
            "or rolled-back channel; nothing was changed")


def _load(path: Path) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"channels": {}, "sequenced_keys": []}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChannelError(f"{path} is unreadable ({exc}); it records which channel indexes were seen, so updates "
                           "stop until it is fixed (deleting it forgets them)") from None
    if not (isinstance(raw, dict) and isinstance(raw.get("channels"), dict)
            and isinstance(raw.get("sequenced_keys"), list)):
        raise ChannelError(f"{path} is malformed; it records which channel indexes were seen, so updates stop "
                           "until it is fixed (deleting it forgets them)")
    return raw


def _save(path: Path, state: dict[str, Any]) -> None:
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    tmp.write_text(json.dumps(state, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    os.replace(tmp, path)
