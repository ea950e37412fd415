"""The replay table, driven at random on every store (tests/stores.py)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

from tests.state_machine import make_state_machine
from tests.stores import STORE_FACTORIES

_SETTINGS = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)


@pytest.mark.parametrize("name", sorted(STORE_FACTORIES))
def test_replay_table_state_machine(name: str) -> None:
    machine = make_state_machine(STORE_FACTORIES[name])
    machine.TestCase.settings = _SETTINGS
    machine.TestCase().runTest()
