"""Progress bars, drawn only when stderr is a terminal: captured or redirected output gets none of their frames."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def stderr_is_terminal() -> bool:
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


def bar(iterable: Any = None, *, enabled: bool, **kwargs: Any) -> tqdm:
    """A tqdm bar on stderr that is drawn only if `enabled` (the caller's --quiet) and stderr is a terminal."""
    return tqdm(iterable, disable=not (enabled and stderr_is_terminal()), file=sys.stderr, leave=False, **kwargs)
