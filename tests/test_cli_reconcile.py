"""``airlock journal reconcile``: checks found in a module, one line per call in doubt, exit codes."""

from __future__ import annotations

import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.cli_support import invoke, rows

TOOLS = textwrap.dedent('''
    import threading
    from guard import Airlock, AirlockContext, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from guard.reconcile import Applied, NotApplied, reconciled_by
    from journal import SQLiteJournal

    ANSWERS = {}  # cents -> what the backend says

    def charge_exists(call):
        answer = ANSWERS.get(call.arguments["cents"], "applied")
        if answer == "raise":
            raise RuntimeError("the backend is down")
        if answer == "junk":
            return "yes"
        if answer == "hang":
            threading.Event().wait(30)
        if answer == "none":
            return None
        if answer == "not":
            return NotApplied(evidence="no charge for that key")
        return Applied(value={"charge_id": "ch_%d" % call.arguments["cents"]}, evidence="ledger has it")

    def refund_exists(call):
        return NotApplied(evidence="no refund")

    CHECKS = {"charge": charge_exists, "refund": refund_exists}
    NOT_A_DICT = [charge_exists]

    def make(db):
        policy = SecurityPolicy(effect_guard=EffectGuard(store=SQLiteJournal(db), reconcile_on_retry=False))

        @reconciled_by(charge_exists)
        @Airlock(policy=policy)
        def charge(cents: int) -> dict:
            raise TimeoutError("lost")

        return charge

    def lose(db, call_id, cents):
        charge = make(db)
        with AirlockContext(metadata={"tool_call_id": call_id}):
            try:
                charge(cents)
            except TimeoutError:
                pass

    @reconciled_by(charge_exists)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def charge(cents: int) -> dict:
        return {}
''')


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    (tmp_path / "billing.py").write_text(TOOLS)
    (tmp_path / "broken.py").write_text("raise ImportError('missing dependency')\n")
    (tmp_path / "empty.py").write_text("X = 1\n")
    monkeypatch.chdir(tmp_path)  # --with looks in the current directory first
    sys.modules.pop("billing", None)
    import importlib

    monkeypatch.syspath_prepend(str(tmp_path))
    billing = importlib.import_module("billing")
    yield billing
    for name in ("billing", "broken", "empty"):
        sys.modules.pop(name, None)


def test_applied_not_applied_and_still_unknown_are_one_line_each(agent: object, tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    for n, cents in enumerate((1, 2, 3)):
        agent.lose(db, f"c{n}", cents)  # type: ignore[attr-defined]
    agent.ANSWERS.update({2: "not", 3: "none"})  # type: ignore[attr-defined]
    result = invoke("journal", "reconcile", "--with", "billing", "--db", db)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].split()[:4] == ["c0", "charge", "applied", "(seq"]
    assert lines[0].endswith("ledger has it")
    assert lines[1].split()[:5] == ["c1", "charge", "not", "applied", "(seq"]
    assert lines[2] == "c2  charge  still unknown  the backend cannot tell yet"
    assert lines[3] == "3 call(s) in doubt: 1 applied, 1 not applied, 1 still unknown."
    assert rows(db, "SELECT call_id, status, actor FROM calls ORDER BY call_id") == [
        ("c0", "committed", "reconciler:charge_exists"), ("c1", "released", "reconciler:charge_exists"),
        ("c2", "unknown", "guard"),
    ]
    assert invoke("journal", "verify", "--db", db).exit_code == 0


def test_json_lines_and_a_dict_of_checks(agent: object, tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    agent.lose(db, "c0", 5)  # type: ignore[attr-defined]
    result = invoke("journal", "reconcile", "--with", "billing:CHECKS", "--json", "--db", db)
    assert result.exit_code == 0, result.output
    [line] = [json.loads(x) for x in result.stdout.splitlines()]
    assert line == {"call_id": "c0", "tool": "charge", "outcome": "applied", "message": "ledger has it",
                    "seq": 3, "dry_run": False}
    # The check for refund, a tool the journal has no calls of, is named and not used.
    assert "no call of the tool 'refund'" in result.stderr
    assert "1 call(s) in doubt: 1 applied." in result.stderr


def test_dry_run_appends_nothing(agent: object, tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    agent.lose(db, "c0", 5)  # type: ignore[attr-defined]
    before = rows(db, "SELECT count(*) FROM events")
    result = invoke("journal", "reconcile", "--with", "billing", "--dry-run", "--db", db)
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[0].startswith("c0  charge  applied  ledger has it")
    assert "Dry run (nothing appended)" in result.stdout
    assert rows(db, "SELECT count(*) FROM events") == before


@pytest.mark.parametrize(("answer", "said"), [
    ("raise", "raised RuntimeError: the backend is down"),
    ("junk", "returned str, not Applied, NotApplied or None"),
    ("hang", "did not answer within 0.5 s"),
])
def test_a_check_that_fails_is_a_line_and_exit_1_and_appends_nothing(
        agent: object, tmp_path: Path, answer: str, said: str) -> None:
    db = str(tmp_path / "j.db")
    agent.lose(db, "c0", 7)  # type: ignore[attr-defined]
    agent.ANSWERS[7] = answer  # type: ignore[attr-defined]
    before = rows(db, "SELECT count(*) FROM events")
    result = invoke("journal", "reconcile", "--with", "billing", "--timeout", "0.5", "--db", db)
    assert result.exit_code == 1
    assert result.stdout.splitlines()[0].startswith("c0  charge  error  the check charge_exists ")
    assert said in result.stdout
    assert rows(db, "SELECT count(*) FROM events") == before


@pytest.mark.parametrize(("spec", "said"), [
    ("broken", "the module 'broken' does not import: ImportError: missing dependency"),
    ("nosuchmodule", "the module 'nosuchmodule' does not import"),
    ("empty", "no check found in 'empty'"),
    ("billing:NOT_A_DICT", "billing.NOT_A_DICT is not a dict of tool name to check"),
    ("billing:MISSING", "billing.MISSING is not a dict"),
    (":CHECKS", "--with takes MODULE or MODULE:ATTR"),
])
def test_usage_errors_exit_2_and_change_nothing(agent: object, tmp_path: Path, spec: str, said: str) -> None:
    db = str(tmp_path / "j.db")
    agent.lose(db, "c0", 5)  # type: ignore[attr-defined]
    result = invoke("journal", "reconcile", "--with", spec, "--db", db)
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("Error: ") and said in result.stderr
    assert rows(db, "SELECT status FROM calls") == [("unknown",)]


def test_other_usage_errors(agent: object, tmp_path: Path) -> None:
    db = str(tmp_path / "j.db")
    agent.lose(db, "c0", 5)  # type: ignore[attr-defined]
    assert invoke("journal", "reconcile", "--db", db).exit_code == 2  # --with is required
    unknown_tool = invoke("journal", "reconcile", "--with", "billing", "--tool", "ship", "--db", db)
    assert unknown_tool.exit_code == 2 and "no check for the tool 'ship'" in unknown_tool.stderr
    bad_age = invoke("journal", "reconcile", "--with", "billing", "--older-than", "soon", "--db", db)
    assert bad_age.exit_code == 2 and "not a length of time" in bad_age.stderr
    older = invoke("journal", "reconcile", "--with", "billing", "--older-than", "1h", "--db", db)
    assert older.exit_code == 0 and older.stdout.startswith("No call in doubt older than 1h. 1 younger call(s)")


def test_a_journal_that_does_not_exist_is_exit_1(agent: object, tmp_path: Path) -> None:
    result = invoke("journal", "reconcile", "--with", "billing", "--db", str(tmp_path / "none.db"))
    assert result.exit_code == 1 and result.stderr.startswith("Error: ")
    assert not (tmp_path / "none.db").exists()


def test_help_has_an_example() -> None:
    result = invoke("journal", "reconcile", "--help")
    assert result.exit_code == 0 and "Example:" in result.stdout and "--older-than" in result.stdout
