"""The one interface every rule of the loop guard has: read the scanner, return changed logits or None."""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgellm.structured.loop_guard.scanner import JSONScanner


class Rule(Protocol):
    """A loop-guard rule. `steer` sees the scanner after the step's tokens were fed and the logits after the grammar
    mask; it returns a changed copy of the logits where it acts (only finite logits changed), None where it does
    not (it must then leave `logits` untouched). `steps` counts the steps it changed."""

    steps: int

    def steer(self, scanner: JSONScanner, logits: np.ndarray) -> np.ndarray | None: ...
