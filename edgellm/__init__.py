"""edgellm: compile small language models into verified artifacts and run them on the device.

    from edgellm import Engine, GenerationParams
    engine = Engine.load("smollm2-135m")            # pulled and compiled on first use
    print(engine.chat([{"role": "user", "content": "Hi"}], GenerationParams(max_tokens=32)).text)
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

import edgellm.openmp  # noqa: F401 - before anything loads torch (edgellm/openmp.py)

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "edgellm.runtime.engine",
    "GenerationParams": "edgellm.generation",
    "GenerationResult": "edgellm.generation",
    "StreamChunk": "edgellm.generation",
    "convert": "edgellm.convert.pipeline",
    "open_artifact": "edgellm.artifact.reader",
    "pull": "edgellm.pull",
    "EdgeLLMError": "edgellm.errors",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    """Import the public API lazily, so `edgellm --help` does not pay for torch."""
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'edgellm' has no attribute {name!r}")
