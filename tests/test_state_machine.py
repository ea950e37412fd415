"""The replay table, driven at random on every store (tests/stores.py); and, on every store that
keeps approvals, the same with an escalated tool whose approver is an ApprovalQueue."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from guard.approvals import ApprovalStore
from tests.state_machine import make_approval_state_machine, make_state_machine
from tests.stores import STORE_FACTORIES, close_store

_SETTINGS = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=list(HealthCheck)
)
# Longer runs: an approval takes a few steps (asked, one or two approvals, the retry; a replay's
# as many again). The in-memory store is cheap, so it gets the most examples.
_APPROVAL_EXAMPLES = {"memory": 150, "sqlite": 60}


def _approval_settings(name: str) -> settings:
    return settings(max_examples=_APPROVAL_EXAMPLES.get(name, 40), stateful_step_count=40, deadline=None,
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", sorted(STORE_FACTORIES))
def test_replay_table_state_machine(name: str) -> None:
    machine = make_state_machine(STORE_FACTORIES[name])
    machine.TestCase.settings = _SETTINGS
    machine.TestCase().runTest()


@pytest.mark.parametrize("name", sorted(STORE_FACTORIES))
def test_approvals_state_machine(name: str, tmp_path: Path) -> None:
    probe = STORE_FACTORIES[name](tmp_path)
    try:
        if not isinstance(probe, ApprovalStore):
            pytest.skip(f"{type(probe).__name__} keeps no approvals")
    finally:
        close_store(probe)
    machine = make_approval_state_machine(STORE_FACTORIES[name])
    machine.TestCase.settings = _approval_settings(name)
    machine.TestCase().runTest()
