"""Archiving with the roles of docs/postgres.md: the operator archives through the journal's own
function, without DELETE on the events; the guard cannot remove an event, archived or not."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest

from journal.postgres import PostgresJournal
from tests.cli_support import invoke
from tests.postgres.test_roles import as_role, deployed, guarded_call, refused

pytestmark = pytest.mark.postgres

__all__ = ["deployed"]  # the fixture, taken from the roles test


def test_the_operator_archives_and_the_auditor_verifies(deployed: str, tmp_path: Path) -> None:
    with PostgresJournal(as_role(deployed, "airlock_guard")) as journal:
        for n in range(3):
            guarded_call(journal, f"c{n}")
        cut = datetime.now(UTC).isoformat()
        guarded_call(journal, "later")
    output = tmp_path / "a1.jsonl"
    done = invoke("journal", "archive", "--db", as_role(deployed, "airlock_operator"), "--before", cut,
                  "-o", str(output))
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("Archived 6 events (seq 1 to 6, ")
    checked = invoke("journal", "verify", "--export", str(output), "--db", as_role(deployed, "airlock_auditor"))
    assert checked.exit_code == 0 and checked.stdout.startswith("OK: 8 events"), checked.output

    # An archived call is still replayed for the guard.
    with PostgresJournal(as_role(deployed, "airlock_guard")) as journal:
        assert guarded_call(journal, "c0") == {"charged": 5}
        assert [e.kind for e in journal.call_events("c0")] == ["replayed"]
    # Neither the guard nor the auditor may archive; the guard still cannot remove an event.
    for role in ("airlock_guard", "airlock_auditor"):
        refused(as_role(deployed, role), "SELECT airlock_archive_events(6, 7, 'x', 'now', 'f')")
    refused(as_role(deployed, "airlock_guard"), "DELETE FROM events")
    guard = as_role(deployed, "airlock_guard")
    with psycopg.connect(guard) as conn, pytest.raises(psycopg.errors.InsufficientPrivilege):
        conn.execute("SELECT set_config('airlock.archiving', 'on', false)")
        conn.execute("DELETE FROM events")
