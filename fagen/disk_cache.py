"""fagen's directory on disk: $FAGEN_CACHE_DIR, else ~/.cache/fagen. It holds compiled kernels
(cubins), the hot path's C build and compiled templates, each file keyed by what produced it, so
an edit or another version writes new files and never reads stale ones."""

from __future__ import annotations

import os
from pathlib import Path


def directory() -> Path:
    return Path(os.environ.get("FAGEN_CACHE_DIR") or Path.home() / ".cache" / "fagen")
