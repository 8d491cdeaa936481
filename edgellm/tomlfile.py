"""Reading a user's TOML settings file with one-line errors that name the file."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any, Callable, TypeVar

from edgellm.errors import EdgeLLMError

T = TypeVar("T")


def load_toml(path: str | Path, what: str, parse: Callable[[dict[str, Any]], T], error: type[EdgeLLMError]) -> T:
    """`parse` applied to the TOML file at `path`; every problem is one `error` line naming `what` and the file."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"{what} {path} cannot be read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise error(f"{what} {path} is not valid TOML: {exc}") from None
    try:
        return parse(raw)
    except error as exc:
        raise error(f"{what} {path}: {exc}") from None
