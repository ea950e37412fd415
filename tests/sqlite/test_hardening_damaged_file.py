"""A journal file with a page overwritten in the middle of its log: once SQLite has called it
malformed, it takes no more writes, in any process, until it has been restored and verifies again."""

from __future__ import annotations

import shutil
import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guard import is_refusal
from journal import JournalDamaged, SQLiteJournal
from tests.cli_support import ROOT, Tools, digest, invoke

MALFORMED = "database disk image is malformed"


def seeded(path: Path) -> None:
    """Enough calls for the log to span many pages, and one call left unknown for resolve."""
    with SQLiteJournal(path) as journal:
        tools = Tools(journal)
        for n in range(150):
            tools.call(f"call-{n}", tools.charge, account="acct_" + "x" * 300, cents=n)
        tools.fail_with = TimeoutError("no answer")
        with pytest.raises(TimeoutError):
            tools.call("call-late", tools.charge, account="acct_9", cents=9)


def damage(path: Path, name: str = "events") -> None:
    """Overwrite the header of a leaf page in the middle of the table or index ``name``, as a bad
    sector or a stray write would: the pages a new call writes (the last ones) stay readable."""
    conn = sqlite3.connect(path)
    try:
        leaves = [p for (p,) in conn.execute(
            "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY pageno", (name,))]
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
    finally:
        conn.close()
    assert len(leaves) >= 2
    with path.open("r+b") as f:
        f.seek((leaves[len(leaves) // 3] - 1) * page_size)
        f.write(b"\x0d\xff\xff\xff\xff\xff\xff\xff" if name == "events" else b"\x0a\xff\xff\xff\xff\xff\xff\xff")


@pytest.fixture
def journal_path(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seeded(path)
    return path


def test_a_file_verify_finds_malformed_refuses_resolve_and_new_calls_until_restored(
    journal_path: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "copy.db"
    shutil.copyfile(journal_path, copy)  # the journal is closed: the file holds everything
    damage(journal_path)
    agent = SQLiteJournal(journal_path)  # an agent that had the journal open before the damage was found
    try:
        tools = Tools(agent)
        assert tools.call("call-before", tools.charge, account="acct_1", cents=1) == {"charge_id": "ch_1", "cents": 1}

        found = invoke("journal", "verify", "--db", str(journal_path))
        assert found.exit_code == 1
        assert found.stderr == (f"Error: The journal {journal_path} is damaged ({MALFORMED}). "
                                "It refuses writes until it is restored (see the runbook).\n")
        before = digest(journal_path)
        for command in (("export",), ("rebuild",)):
            result = invoke("journal", *command, "--db", str(journal_path))
            assert result.exit_code == 1 and "is damaged" in result.stderr, result.stderr
            assert result.stderr.count("\n") == 1

        resolved = invoke("journal", "resolve", "call-late", "--not-applied", "--reason", "checked",
                          "--db", str(journal_path))
        assert resolved.exit_code == 1
        assert resolved.stderr == found.stderr  # the same sentence, from the mark the verify left

        refused = tools.call("call-after", tools.charge, account="acct_2", cents=2)
        assert is_refusal(refused) and refused["block_reason"] == "store_unavailable"
        assert tools.payments.charges == [("acct_1", 1)]  # the refused call did not run
        with pytest.raises(JournalDamaged):
            agent.resolve("call-late", applied=False, reason="checked", operator="ops")
        assert digest(journal_path) == before  # nothing was written to the damaged file
    finally:
        agent.close()

    # Restored from the copy: verify finds it whole, and writes are taken again.
    shutil.copyfile(copy, journal_path)
    assert invoke("journal", "resolve", "call-late", "--not-applied", "--reason", "checked",
                  "--db", str(journal_path)).exit_code == 1  # not until verify has found it whole
    verified = invoke("journal", "verify", "--db", str(journal_path))
    assert verified.exit_code == 0 and verified.stdout.startswith("OK: 302 events"), verified.output
    resolved = invoke("journal", "resolve", "call-late", "--not-applied", "--reason", "checked",
                      "--db", str(journal_path))
    assert resolved.exit_code == 0, resolved.stderr
    with SQLiteJournal(journal_path) as journal:
        tools = Tools(journal)
        assert tools.call("call-after", tools.charge, account="acct_2", cents=2) == {"charge_id": "ch_1", "cents": 2}


_AGENT = textwrap.dedent(
    """
    import sys
    from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
    from guard.effect_guard import EffectGuard
    from journal import SQLiteJournal

    journal = SQLiteJournal(sys.argv[1])
    ran = []

    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=journal)))
    def charge(cents: int) -> int:
        ran.append(cents)
        return cents

    with AirlockContext(metadata={"tool_call_id": sys.argv[2]}):
        result = charge(cents=5)
    print(result["block_reason"] if is_refusal(result) else "ran", len(ran))
    """
)


def test_a_damage_seen_by_one_process_refuses_the_calls_of_another(journal_path: Path) -> None:
    damage(journal_path)
    with SQLiteJournal(journal_path, readonly=True) as reader, pytest.raises(JournalDamaged, match=MALFORMED):
        list(reader.event_rows())
    agent = subprocess.run([sys.executable, "-c", _AGENT, str(journal_path), "call-new"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert agent.returncode == 0, agent.stderr
    assert agent.stdout.split() == ["store_unavailable", "0"]
    assert "is damaged" in agent.stderr  # the guard logs why


def test_verify_keeps_the_mark_while_sqlite_still_finds_the_file_damaged(journal_path: Path) -> None:
    # A page of an index overwritten: the chain and the projection still read whole, but a lookup
    # of a call's events goes through the index, and SQLite's own check finds it.
    damage(journal_path, "events_call_id")
    shown = invoke("journal", "show", "call-1", "--db", str(journal_path))
    assert shown.exit_code == 1 and MALFORMED in shown.stderr
    again = invoke("journal", "verify", "--db", str(journal_path))
    assert again.exit_code == 1
    assert again.stderr.startswith(f"Error: {journal_path} does not verify: SQLite finds the file damaged: ")
    assert journal_path.with_name("journal.db-damaged").exists()
    resolved = invoke("journal", "resolve", "call-late", "--not-applied", "--reason", "checked",
                      "--db", str(journal_path))
    assert resolved.exit_code == 1 and "is damaged" in resolved.stderr


def test_a_journal_that_verifies_carries_no_mark_and_writes_as_before(journal_path: Path) -> None:
    assert invoke("journal", "verify", "--db", str(journal_path)).exit_code == 0
    assert not journal_path.with_name("journal.db-damaged").exists()
    assert invoke("journal", "resolve", "call-late", "--not-applied", "--reason", "checked",
                  "--db", str(journal_path)).exit_code == 0
