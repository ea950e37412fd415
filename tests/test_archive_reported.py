"""What a new user found after `airlock journal archive`, each as the user typed it, on SQLite and
PostgreSQL: the demo runs again after an archive, a checkpoint taken before an archive is checked
against the archives, a missing archive is named, `show CALL_ID` says where an archived call's
events went, and `copy` copies an archived journal (a failed copy leaves nothing behind)."""

from __future__ import annotations

import contextlib
import shlex
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import pytest

import journal.copy
from journal import JournalError, open_journal
from tests.cli_support import Tools, invoke
from tests.journals import JOURNAL_PARAMS, JournalFactory, journal_factory


@pytest.fixture
def empty_db(journal_kind: JournalFactory, tmp_path: Path) -> str:
    """Where a journal is to be, of every store (tests/conftest.py): a SQLite path not made yet, or
    an empty PostgreSQL database."""
    return journal_kind.target(tmp_path, "g.db", own_database=True)


def now() -> str:
    return datetime.now(UTC).isoformat()


def calls(db: str, prefix: str, count: int = 3) -> Tools:
    """``count`` charges committed, one more timed out (unknown), each retried once."""
    with open_journal(db) as j:
        tools = Tools(j)
        for n in range(count):
            tools.call(f"{prefix}-{n}", tools.charge, account="acct_9", cents=n + 1)
            tools.call(f"{prefix}-{n}", tools.charge, account="acct_9", cents=n + 1)
        tools.fail_with = TimeoutError("no answer")
        with contextlib.suppress(TimeoutError):
            tools.call(f"{prefix}-doubt", tools.charge, account="acct_9", cents=99)
        tools.call(f"{prefix}-doubt", tools.charge, account="acct_9", cents=99)
    return tools


def archive(db: str, output: Path) -> str:
    done = invoke("journal", "archive", "--before", now(), "--output", str(output), "--db", db)
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith("Archived "), done.output
    return done.stdout


def checkpoint(db: str, output: Path) -> dict[str, Any]:
    done = invoke("journal", "checkpoint", "--db", db, "-o", str(output))
    assert done.exit_code == 0, done.output
    made: dict[str, Any] = orjson.loads(output.read_bytes())
    return made


# -- 1. the demo's run number -----------------------------------------------------------------------


def test_the_demo_runs_again_after_its_events_were_archived(empty_db: str, tmp_path: Path) -> None:
    for run in (1, 2):
        done = invoke("demo", "--db", empty_db)
        assert done.exit_code == 0, done.output
        assert done.stdout.startswith(f"airlock demo: run {run}, journal ")
    time.sleep(1.1)  # --before 1s: the demo's events are older than a second
    archived = invoke("journal", "archive", "--before", "1s", "--output", str(tmp_path / "A.jsonl"), "--db", empty_db)
    assert archived.exit_code == 0, archived.output
    assert archived.stdout.startswith("Archived ")

    again = invoke("demo", "--db", empty_db)
    assert again.exit_code == 0, again.output
    assert again.stdout.startswith("airlock demo: run 3, journal "), again.stdout
    assert "The backend's ledger: 3 charges for 3 intended payments" in again.stdout
    assert "call_r3_1" in again.stdout and again.stderr == ""


# -- 3. a checkpoint older than an archive ---------------------------------------------------------------


def test_a_checkpoint_taken_before_an_archive_is_checked_against_the_archives(seeded_db: str, tmp_path: Path) -> None:
    db = seeded_db
    old = checkpoint(db, tmp_path / "C.json")
    calls(db, "m1")
    a1 = tmp_path / "A1.jsonl"
    archive(db, a1)
    calls(db, "m2")
    later = checkpoint(db, tmp_path / "C2.json")
    calls(db, "m2b", 1)  # the journal's last event stays: a checkpoint's seq goes with the next archive
    a2 = tmp_path / "A2.jsonl"
    archive(db, a2)
    calls(db, "m3")
    latest = checkpoint(db, tmp_path / "C3.json")

    # The journal alone: not tampering, but where the checkpoint's seq went and what to run.
    alone = invoke("journal", "verify", "--checkpoint", str(tmp_path / "C.json"), "--db", db)
    assert alone.exit_code == 1
    said = alone.stderr
    assert said.startswith(f"Error: the checkpoint {tmp_path / 'C.json'} cannot be checked against ")
    assert f"its seq {old['seq']} was archived to {a1.resolve()}, as the journal recorded" in said
    assert "no sign of tampering" in said and "which the checkpoint records" not in said
    assert "rewritten" not in said and "removed" not in said
    advised = said.split("every archive in seq order: ", 1)[1].strip()
    assert advised.startswith("airlock journal verify --checkpoint ")
    assert f"--export {a1.resolve()} --export {a2.resolve()} --db " in advised
    ran = invoke(*shlex.split(advised)[1:])
    assert ran.exit_code == 0, ran.output
    assert ran.stdout.startswith(f"OK: {latest['seq']} events, head {latest['hash']}")
    assert f"The archive {a1.resolve()} holds seq {old['seq']} of the checkpoint" in ran.stderr

    # As the user typed it: the checkpoint, the archives in order, the journal.
    both = invoke("journal", "verify", "--checkpoint", str(tmp_path / "C.json"), "--export", str(a1), "--export",
                  str(a2), "--db", db)
    assert (both.exit_code, both.stdout) == (0, f"OK: {latest['seq']} events, head {latest['hash']}\n"), both.output
    # Every checkpoint at once: in the first archive, the second, and the journal.
    every = invoke("journal", "verify", "--checkpoint", str(tmp_path / "C.json"), "--checkpoint",
                   str(tmp_path / "C2.json"), "--checkpoint", str(tmp_path / "C3.json"), "--export", str(a1),
                   "--export", str(a2), "--db", db)
    assert every.exit_code == 0, every.output
    assert (f"Each of the 3 checkpoints (seq {old['seq']} to {latest['seq']}) matches: 2 in the archives, 1 in the "
            "journal.") in every.stderr
    # A later checkpoint still in the journal needs no archive.
    assert later["seq"] < latest["seq"]
    assert invoke("journal", "verify", "--checkpoint", str(tmp_path / "C3.json"), "--db", db).exit_code == 0

    # A checkpoint that does not match what the archive holds is still found.
    forged = tmp_path / "forged.json"
    forged.write_bytes(orjson.dumps({**old, "hash": "1" * 64}))
    bad = invoke("journal", "verify", "--checkpoint", str(forged), "--export", str(a1), "--export", str(a2),
                 "--db", db)
    assert bad.exit_code == 1
    assert (f"{a1} does not verify: it no longer matches the checkpoint {forged}: event seq {old['seq']} in {a1} "
            f"has the hash {old['hash']}, not the checkpoint's {'1' * 64}: the log has been rewritten") in bad.stderr
    # One archive left out: it is named, and still no tampering is claimed.
    short = invoke("journal", "verify", "--checkpoint", str(tmp_path / "C.json"), "--export", str(a2), "--db", db,
                   "--allow-gaps")
    assert short.exit_code == 1
    assert f"its seq {old['seq']} was archived to {a1.resolve()}" in short.stderr
    assert "and the --export files given" in short.stderr


def test_one_file_given_as_checkpoint_and_export_is_a_usage_error(seeded_db: str, tmp_path: Path) -> None:
    checkpoint(seeded_db, tmp_path / "C.json")
    mixed = invoke("journal", "verify", "--db", seeded_db, "--checkpoint", str(tmp_path / "C.json"), "--export",
                   str(tmp_path / "C.json"))
    assert mixed.exit_code == 2
    assert "is given as --checkpoint and as --export" in mixed.stderr


# -- 5. a missing archive is named; show CALL_ID says where the events went ----------------------------


def test_verify_names_the_archive_left_out(seeded_db: str, tmp_path: Path) -> None:
    db = seeded_db
    a1, a2 = tmp_path / "a1.jsonl", tmp_path / "a2.jsonl"
    archive(db, a1)
    calls(db, "m2")
    archive(db, a2)
    calls(db, "m3")
    first = orjson.loads(a2.read_bytes().splitlines()[0])["seq"]
    last = orjson.loads(a2.read_bytes().splitlines()[-1])["seq"]

    for extra in ((), ("--allow-gaps",)):
        left_out = invoke("journal", "verify", "--db", db, "--export", str(a1), *extra)
        assert left_out.exit_code == 1
        said = left_out.stderr
        assert f"events are missing (seq {first} to {last}): the journal recorded archiving them to {a2.resolve()} " \
               f"(seq {first} to {last}); give it (or its copy): --export {a2.resolve()}, after --export {a1}" in said
        assert "--allow-gaps" not in said and len(said.splitlines()) == 1

    first_left_out = invoke("journal", "verify", "--db", db, "--export", str(a2))
    assert first_left_out.exit_code == 1
    assert f"the journal recorded archiving them to {a1.resolve()}" in first_left_out.stderr
    assert f"before --export {a2}" in first_left_out.stderr and "--allow-gaps" not in first_left_out.stderr

    # An export filtered by the user, with no archive to name, still gets the hint.
    filtered = tmp_path / "one-call.jsonl"
    assert invoke("journal", "export", "--db", db, "--call", "m3-0", "-o", str(filtered)).exit_code == 0
    gapped = invoke("journal", "verify", "--export", str(filtered))
    assert gapped.exit_code == 1 and "add --allow-gaps" in gapped.stderr


def test_show_says_which_archive_holds_an_archived_calls_events(seeded_db: str, tmp_path: Path) -> None:
    db = seeded_db
    a1 = tmp_path / "a1.jsonl"
    archive(db, a1)
    held = [orjson.loads(line) for line in a1.read_bytes().splitlines()]
    last_ok = max(line["seq"] for line in held if line["call_id"] == "call-ok" and line["kind"] == "committed")

    shown = invoke("journal", "show", "call-ok", "--db", db)
    assert shown.exit_code == 0, shown.output
    assert "committed" in shown.stdout
    assert shown.stdout.rstrip().endswith(
        f"Events of this call were archived and are not shown: seq {last_ok}, the last that changed its state, is "
        f"in the archive {a1.resolve()} (seq 1 to {held[-1]['seq']}).")
    as_json = orjson.loads(invoke("journal", "show", "call-ok", "--db", db, "--json").stdout)
    assert as_json["events"] == []
    assert as_json["archived"] == {"last_seq": last_ok, "file": str(a1.resolve()), "file_first_seq": 1,
                                   "file_last_seq": held[-1]["seq"]}

    # A call archived in part: its later events shown, its earlier ones named.
    calls(db, "m2")
    with open_journal(db) as j:  # call-timeout, archived unknown, is settled after the archive
        j.resolve("call-timeout", applied=False, reason="no charge at the backend", operator="ops")
    unknown_at = max(line["seq"] for line in held if line["call_id"] == "call-timeout" and line["kind"] == "unknown")
    settled = invoke("journal", "show", "call-timeout", "--db", db)
    assert " released " in settled.stdout and "operator:ops" in settled.stdout  # its event in the journal
    assert settled.stdout.rstrip().endswith(
        f"Earlier events of this call were archived and are not shown: seq {unknown_at}, the last that changed its "
        f"state, is in the archive {a1.resolve()} (seq 1 to {held[-1]['seq']}).")
    a2 = tmp_path / "a2.jsonl"
    archive(db, a2)
    calls(db, "m3")
    part = invoke("journal", "show", "m3-0", "--db", db)
    assert "archived" not in part.stdout  # nothing of it was archived
    m2 = invoke("journal", "show", "m2-1", "--db", db)
    assert f"is in the archive {a2.resolve()} (seq " in m2.stdout
    assert "earlier ones are there or in the archives before it" in m2.stdout


# -- 4. copy an archived journal ------------------------------------------------------------------------


@pytest.fixture(params=JOURNAL_PARAMS)
def destination_kind(request: pytest.FixtureRequest) -> JournalFactory:
    """Every journal store to copy to, whatever the store copied from."""
    return journal_factory(request)


@pytest.fixture
def destination(destination_kind: JournalFactory, tmp_path: Path) -> str:
    """Where to copy to: a new SQLite file, or an empty PostgreSQL database of its own."""
    return destination_kind.target(tmp_path, "copy.db", own_database=True)


def projection(db: str) -> list[Any]:
    with open_journal(db, readonly=True, create=False) as j:
        return sorted((r.call_id, r.status, r.attempt, r.value, r.last_seq) for r in j.calls(limit=None))


def test_copy_of_an_archived_journal_verifies_and_forgets_no_call(seeded_db: str, destination: str,
                                                                tmp_path: Path) -> None:
    db = seeded_db
    a1 = tmp_path / "A1.jsonl"
    archive(db, a1)
    calls(db, "later")
    with open_journal(db, readonly=True, create=False) as j:
        head = j.head()
        start = j.archived_head()[0]

    copied = invoke("journal", "copy", "--from", db, "--to", destination)
    assert copied.exit_code == 0, copied.output
    assert copied.stdout.startswith(f"Copied {head[0] - start} events ")
    assert f"its log after the archived head (seq {start})" in copied.stdout
    assert copied.stdout.rstrip().endswith(f"the copy verifies, head {head[1]}")

    alone = invoke("journal", "verify", "--db", destination)
    assert (alone.exit_code, alone.stdout) == (0, f"OK: {head[0] - start} events, head {head[1]}\n"), alone.output
    joined = invoke("journal", "verify", "--export", str(a1), "--db", destination)
    assert (joined.exit_code, joined.stdout) == (0, f"OK: {head[0]} events, head {head[1]}\n"), joined.output
    assert projection(destination) == projection(db)
    assert f"is in the archive {a1.resolve()}" in invoke("journal", "show", "call-ok", "--db", destination).stdout

    with open_journal(destination) as j:
        tools = Tools(j)
        assert tools.call("call-ok", tools.charge, account="acct_1", cents=500) == {"charge_id": "ch_1", "cents": 500}
        refused = tools.call("call-timeout", tools.charge, account="acct_2", cents=700)
        assert isinstance(refused, dict) and refused["block_reason"] == "effect_status_unknown"
        assert tools.payments.charges == []
    assert invoke("journal", "verify", "--db", destination).exit_code == 0
    # The copy archives on from there, and its archives join the first one.
    a2 = tmp_path / "A2.jsonl"
    archive(destination, a2)
    both = invoke("journal", "verify", "--export", str(a1), "--export", str(a2), "--db", destination)
    assert both.exit_code == 0, both.output


def test_a_failed_copy_leaves_nothing_at_the_destination(seeded_db: str, destination_kind: JournalFactory,
                                                         destination: str, monkeypatch: pytest.MonkeyPatch) -> None:

    def broken(*args: Any, **kwargs: Any) -> int:
        raise JournalError("the copy broke off")

    monkeypatch.setattr(journal.copy, "import_events", broken)
    failed = invoke("journal", "copy", "--from", seeded_db, "--to", destination)
    assert (failed.exit_code, failed.stderr) == (1, "Error: the copy broke off\n")
    assert destination_kind.database(destination).remains() == []
