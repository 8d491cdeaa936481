"""Where edgellm keeps its files. Nothing here creates a folder; callers do, when they write."""

from __future__ import annotations

import os
from pathlib import Path


def edgellm_home() -> Path:
    """The cache root: ``$EDGELLM_HOME`` if set and non-empty, else ``~/.cache/edgellm``."""
    env = os.environ.get("EDGELLM_HOME", "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "edgellm"


def sources_dir() -> Path:
    """Verified source models, one folder per catalog name: ``<home>/sources``."""
    return edgellm_home() / "sources"


def downloads_dir() -> Path:
    """Downloaded wheels, one folder per catalog name, kept until a pull succeeds: ``<home>/downloads``."""
    return edgellm_home() / "downloads"


def artifacts_dir() -> Path:
    """Compiled artifacts: ``<home>/artifacts``."""
    return edgellm_home() / "artifacts"
