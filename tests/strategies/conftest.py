from __future__ import annotations

from pathlib import Path

import pytest

from tests.strategies.plan import Session


@pytest.fixture(scope="session")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Session:
    """Every multi-process fit, resume and error case of the strategy tests, run once per session."""
    return Session(Path(tmp_path_factory.mktemp("strategies")))
