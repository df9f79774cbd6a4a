"""The integration tier: every test here carries the ``integration`` marker.

So ``pytest -m "not integration"`` leaves out whatever needs real brokers, processes,
sockets or process groups, whether or not a module marks itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest hook sees every collected item, not only this directory's.
    for item in items:
        if _HERE in item.path.parents:
            item.add_marker(pytest.mark.integration)
