"""A module whose import has a side effect (for a hostile pickle of ``__import__``): it creates the file
named by :data:`tests.hostile.IMPORT_MARKER_ENV`, if that is set."""

from __future__ import annotations

import os
from pathlib import Path

from tests.hostile import IMPORT_MARKER_ENV

if os.environ.get(IMPORT_MARKER_ENV):
    Path(os.environ[IMPORT_MARKER_ENV]).write_text("imported by a checkpoint\n")
