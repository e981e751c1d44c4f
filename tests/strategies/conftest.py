from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.harness import Runs


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Launches of the multi-process scenario, each fit run once for the whole session."""
    return Runs(Path(tmp_path_factory.mktemp("strategies")))
