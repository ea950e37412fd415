"""What an operator or a check gets wrong, answered with one clear line and nothing appended.

- numbers out of range (``--timeout inf``, ``nan``, ``1e308``, ``--older-than`` past the year 1,
  ``--offset`` past SQL's integers) are usage errors (exit 2) naming the flag and its range, or
  (``--offset``, like ``--limit``) are taken for what they mean;
- a checkpoint, a manifest or a key is a small file: a device (``/dev/zero``) or a file too large
  is an error (exit 1) at once, not a read without end; so is an ``--export`` that is a device;
- ``--with`` is ``MODULE`` or ``MODULE:ATTR`` with dotted names, nothing else (exit 2);
- a check whose answer cannot be stored (evidence with a lone surrogate, evidence whose ``str()``
  raises) is a check that failed, never ``store_unavailable``: the store did not fail.

Each runs against a real SQLite file, and reads its events again afterwards to see them unchanged.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard import Airlock, AirlockContext, SecurityPolicy, is_refusal
from guard.effect_guard import EffectGuard
from guard.reconcile import Applied, InDoubtCall, NotApplied, reconciled_by
from journal import SQLiteJournal, open_journal
from tests.cli_support import AIRLOCK, invoke

# -- a journal with a call in doubt, and a module of checks ------------------------------------------

CHECKS_MODULE = textwrap.dedent('''
    from types import SimpleNamespace

    from guard import Airlock, SecurityPolicy
    from guard.effect_guard import EffectGuard
    from guard.reconcile import Applied, NotApplied, reconciled_by

    class Unprintable:
        def __str__(self):
            raise RuntimeError("no text for you")

    class Unsayable(Exception):
        def __str__(self):
            raise RuntimeError("no text for you either")

    ANSWER = {"evidence": "ledger has it"}

    def charge_exists(call):
        if ANSWER.get("raise"):
            raise Unsayable()
        return Applied(value={"charge_id": "ch_1"}, evidence=ANSWER["evidence"])

    CHECKS = {"charge": charge_exists}
    NS = SimpleNamespace(CHECKS=CHECKS)

    @reconciled_by(charge_exists)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard()))
    def charge(cents: int) -> dict:
        return {}
''')


def lose(db: Path, call_id: str = "c0") -> None:
    """A call of ``charge`` whose response was lost: ``unknown`` in the journal at ``db``."""
    with SQLiteJournal(db) as store:
        @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store, reconcile_on_retry=False)))
        def charge(cents: int) -> dict[str, Any]:
            raise TimeoutError("the response was lost")

        with AirlockContext(metadata={"tool_call_id": call_id}), pytest.raises(TimeoutError):
            charge(5)


def events(db: Path) -> list[tuple[int, str, str, str]]:
    """The journal's events, read by opening the file again: (seq, kind, actor, hash)."""
    with open_journal(str(db), readonly=True, create=False) as j:
        return [(e.seq, e.kind, e.actor, e.hash) for e in j.events()]


@pytest.fixture
def agent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    (tmp_path / "billing_checks.py").write_text(CHECKS_MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("billing_checks", None)
    import importlib

    yield importlib.import_module("billing_checks")
    sys.modules.pop("billing_checks", None)


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    lose(path)
    return path


def one_error_line(text: str) -> str:
    """The one line of ``text``, which must be ``Error: ...`` and hold no traceback."""
    assert "Traceback" not in text, text
    lines = text.splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), text
    return lines[0]


def run(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``airlock ARGS`` in a process of its own, given at most 30 s (a read without end never ends)."""
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    return subprocess.run([AIRLOCK, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=30,
                          stdin=subprocess.DEVNULL)


needs_dev_zero = pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="no /dev/zero here")


# -- (a), (b): numbers out of range ------------------------------------------------------------------

TIMEOUT_RANGE = "is not in the range 0.001<=x<=86400 (seconds: at most a day)"


@pytest.mark.parametrize("dry_run", [False, True])
@pytest.mark.parametrize("timeout", ["inf", "1e308", "1e400", "-inf", "Infinity", "86400.5"])
def test_a_timeout_too_long_is_a_usage_error_naming_the_range(
        agent: Any, db: Path, timeout: str, dry_run: bool) -> None:
    before = events(db)
    result = invoke("journal", "reconcile", "--with", "billing_checks", "--timeout", timeout, "--db", str(db),
                    *(["--dry-run"] if dry_run else []))
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert line.startswith("Error: Invalid value for '--timeout': ") and line.endswith(TIMEOUT_RANGE), line
    assert result.stdout == ""
    assert events(db) == before
    # A day is the longest a check may be given.
    longest = invoke("journal", "reconcile", "--with", "billing_checks", "--timeout", "86400", "--dry-run",
                     "--db", str(db))
    assert longest.exit_code == 0, longest.output
    assert longest.stdout.startswith("c0  charge  applied")


@pytest.mark.parametrize("timeout", ["nan", "NaN", "-nan", "0", "-0", "-1", "0.0009", "ten"])
def test_a_timeout_that_is_no_length_of_time_is_a_usage_error(agent: Any, db: Path, timeout: str) -> None:
    before = events(db)
    result = invoke("journal", "reconcile", "--with", "billing_checks", "--timeout", timeout, "--db", str(db))
    assert result.exit_code == 2, result.output
    line = one_error_line(result.stderr)
    assert line.startswith("Error: Invalid value for '--timeout': "), line
    assert "86400" in line and "journal" not in line, line  # the flag is blamed, not the journal
    assert events(db) == before


@pytest.mark.parametrize("age", ["3000000d", "999999999d", "1000000w", "9" * 400 + "s", "99999999999999999999d"])
def test_an_age_before_the_year_1_is_a_usage_error(agent: Any, db: Path, age: str) -> None:
    before = events(db)
    result = invoke("journal", "reconcile", "--with", "billing_checks", "--older-than", age, "--db", str(db))
    assert result.exit_code == 2, result.output
    assert one_error_line(result.stderr) == (
        f"Error: Invalid value for '--older-than': {age!r} is out of range: give an age that reaches back no "
        "further than the year 1, such as 10m, 2h, 3d")
    assert events(db) == before
    # An age of many centuries is still one.
    centuries = invoke("journal", "reconcile", "--with", "billing_checks", "--older-than", "500000d",
                       "--db", str(db))
    assert centuries.exit_code == 0, centuries.output
    assert centuries.stdout.startswith("No call in doubt older than 500000d. 1 younger call(s) in doubt")


@pytest.mark.parametrize("offset", [str(2**63), "9" * 30, "9" * 400])
@pytest.mark.parametrize("as_json", [False, True])
def test_an_offset_past_every_call_shows_none(db: Path, offset: str, as_json: bool) -> None:
    before = events(db)
    result = invoke("journal", "show", "--db", str(db), "--offset", offset, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    assert result.stdout == ""
    assert result.stderr == ("" if as_json else f"No calls match past the first {offset}.\n")
    assert events(db) == before


# -- (c): small files that are not small -------------------------------------------------------------


@needs_dev_zero
@pytest.mark.parametrize(("args", "said"), [
    (["verify", "--checkpoint", "/dev/zero"],
     "Error: /dev/zero is not a checkpoint that can be used: it is a device, not a file"),
    (["verify", "--export", "/dev/zero"], "Error: cannot read /dev/zero: it is a device, not an export file"),
    (["verify", "--export", "/dev/zero", "--allow-gaps"],
     "Error: cannot read /dev/zero: it is a device, not an export file"),
    (["verify", "--checkpoint", "CHECKPOINT", "--public-key", "/dev/zero"],
     "Error: the public key /dev/zero is a device, not a file holding a key"),
    (["verify", "--export", "EXPORT", "--public-key", "/dev/zero"],
     "Error: the public key /dev/zero is a device, not a file holding a key"),
    (["checkpoint", "--sign", "/dev/zero"], "Error: the key /dev/zero is a device, not a key file"),
    (["export", "--sign", "/dev/zero", "-o", "OUT"], "Error: the key /dev/zero is a device, not a key file"),
    (["archive", "--before", "1d", "-o", "OUT", "--sign", "/dev/zero"],
     "Error: the key /dev/zero is a device, not a key file"),
])
def test_a_device_for_a_small_file_is_one_error_line_at_once(db: Path, args: list[str], said: str) -> None:
    checkpoint = db.with_name("checkpoint.json")
    assert invoke("journal", "checkpoint", "--db", str(db), "-o", str(checkpoint)).exit_code == 0
    export = db.with_name("export.jsonl")
    assert invoke("journal", "export", "--db", str(db), "-o", str(export)).exit_code == 0
    out = db.with_name("out.jsonl")
    named = {"CHECKPOINT": str(checkpoint), "EXPORT": str(export), "OUT": str(out)}
    before = events(db)
    result = run("journal", *[named.get(a, a) for a in args], "--db", str(db))
    assert result.returncode == 1, result.stderr
    assert one_error_line(result.stderr) == said
    assert result.stdout == ""
    assert not out.exists()
    assert events(db) == before


def test_a_checkpoint_larger_than_64_kib_is_refused(db: Path) -> None:
    checkpoint = db.with_name("checkpoint.json")
    made = invoke("journal", "checkpoint", "--db", str(db)).stdout
    checkpoint.write_text(made[:-2] + " " * (64 * 1024) + "}\n")  # valid JSON, padded past the limit
    before = events(db)
    result = run("journal", "verify", "--checkpoint", str(checkpoint), "--db", str(db))
    assert result.returncode == 1, result.stderr
    assert one_error_line(result.stderr) == (
        f"Error: {checkpoint} is not a checkpoint that can be used: it is larger than 64 KiB "
        "(a checkpoint is a small JSON file)")
    assert events(db) == before


@needs_dev_zero
def test_a_manifest_that_is_a_device_or_too_large_is_refused(db: Path) -> None:
    pytest.importorskip("cryptography")
    key = db.with_name("key.pem")
    public = invoke("journal", "keygen", "-o", str(key)).stdout.strip()
    export = db.with_name("export.jsonl")
    assert invoke("journal", "export", "--db", str(db), "--sign", str(key), "-o", str(export)).exit_code == 0
    manifest = db.with_name("export.jsonl.manifest.json")
    assert run("journal", "verify", "--export", str(export), "--public-key", public).returncode == 0
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    before = events(db)
    result = run("journal", "verify", "--export", str(export), "--public-key", public)
    assert result.returncode == 1, result.stderr
    assert one_error_line(result.stderr) == (
        f"Error: {manifest} does not verify: it is a device, not a file")
    manifest.unlink()
    manifest.write_bytes(b" " * (1024 * 1024 + 1))
    result = run("journal", "verify", "--export", str(export), "--public-key", public)
    assert result.returncode == 1, result.stderr
    assert one_error_line(result.stderr) == (
        f"Error: {manifest} does not verify: it is larger than 1 MiB (a manifest is a small JSON file)")
    assert events(db) == before


def test_a_key_file_larger_than_64_kib_is_refused(db: Path) -> None:
    big = db.with_name("big.pem")
    big.write_bytes(b"-----BEGIN PRIVATE KEY-----\n" + b"A" * (64 * 1024) + b"\n-----END PRIVATE KEY-----\n")
    before = events(db)
    result = run("journal", "checkpoint", "--sign", str(big), "--db", str(db))
    assert result.returncode == 1, result.stderr
    assert one_error_line(result.stderr) == f"Error: the key {big} is larger than 64 KiB: it is not a key file"
    assert result.stdout == ""
    checkpoint = db.with_name("checkpoint.json")
    assert invoke("journal", "checkpoint", "--db", str(db), "-o", str(checkpoint)).exit_code == 0
    result = run("journal", "verify", "--checkpoint", str(checkpoint), "--public-key", str(big), "--db", str(db))
    assert result.returncode == 1, result.stderr
    assert one_error_line(result.stderr) == (
        f"Error: the public key {big} is larger than 64 KiB: it is not a file holding a key")
    assert events(db) == before


# -- (d): --with MODULE[:ATTR] -------------------------------------------------------------------------

WITH_FORM = "--with takes MODULE or MODULE:ATTR, each a dotted Python name (payments, payments:CHECKS)"


@pytest.mark.parametrize("spec", [
    "billing_checks:", ":CHECKS", ":", "billing_checks::CHECKS", "billing_checks:CHECKS:", "billing_checks:1x",
    "billing_checks:.CHECKS", "billing_checks:NS.", "billing_checks.", ".billing_checks", "billing_checks..x",
    " billing_checks", "billing_checks ", "billing_checks :CHECKS", "billing_checks: CHECKS", "billing_checks:CHECKS ",
    "billing\tchecks", " ",
])
def test_a_with_that_is_not_module_or_module_attr_is_a_usage_error(agent: Any, db: Path, spec: str) -> None:
    before = events(db)
    result = invoke("journal", "reconcile", "--with", spec, "--db", str(db))
    assert result.exit_code == 2, result.output
    assert one_error_line(result.stderr) == f"Error: {WITH_FORM}, not {spec!r}"
    assert result.stdout == ""
    assert events(db) == before


def test_a_with_attr_may_be_a_dotted_path(agent: Any, db: Path) -> None:
    result = invoke("journal", "reconcile", "--with", "billing_checks:NS.CHECKS", "--dry-run", "--db", str(db))
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("c0  charge  applied  ledger has it")
    missing = invoke("journal", "reconcile", "--with", "billing_checks:NS.MISSING", "--db", str(db))
    assert missing.exit_code == 2
    assert one_error_line(missing.stderr) == (
        "Error: --with: billing_checks.NS.MISSING is not a dict of tool name to check")


# -- (e): a check's answer that cannot be stored ---------------------------------------------------


class Unprintable:
    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class Unsayable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no text for you either")


def _surrogate(call: InDoubtCall) -> Any:
    return Applied(value={"charge_id": "ch_1"}, evidence="found \udcff")


def _surrogate_not_applied(call: InDoubtCall) -> Any:
    return NotApplied(evidence="\udcff")


def _unprintable(call: InDoubtCall) -> Any:
    return Applied(evidence=Unprintable())  # type: ignore[arg-type]


def _unsayable(call: InDoubtCall) -> Any:
    raise Unsayable()


UNUSABLE = {
    "surrogate": (_surrogate, "returned evidence that cannot be stored: it is not valid UTF-8"),
    "surrogate-not-applied": (_surrogate_not_applied, "returned evidence that cannot be stored: it is not valid UTF-8"),
    "unprintable": (_unprintable, "returned evidence that cannot be stored: its str() raised RuntimeError: "
                                  "no text for you"),
    "unsayable": (_unsayable, "raised Unsayable"),
}


def _tool(store: SQLiteJournal, check: Any) -> Any:
    @reconciled_by(check)
    @Airlock(policy=SecurityPolicy(effect_guard=EffectGuard(store=store)))
    def charge(cents: int) -> dict[str, Any]:
        raise TimeoutError("the response was lost")

    return charge


@pytest.mark.parametrize("case", list(UNUSABLE))
def test_a_check_answer_that_cannot_be_stored_leaves_the_ordinary_refusal(
        tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture) -> None:
    check, said = UNUSABLE[case]
    path = tmp_path / "journal.db"
    with SQLiteJournal(path) as store:
        charge = _tool(store, check)
        with AirlockContext(agent_id="agent-1", metadata={"tool_call_id": "call_1"}):
            with pytest.raises(TimeoutError):
                charge(100)  # in doubt: the response was lost
            before = events(path)
            with caplog.at_level(logging.WARNING, logger="guard"):
                refusal = charge(100)  # the retry runs the check first
    assert is_refusal(refusal), refusal
    assert refusal["block_reason"] == "effect_status_unknown", refusal
    after = events(path)
    assert after[: len(before)] == before
    assert [kind for _, kind, _, _ in after[len(before):]] == ["refused"]  # the refusal, no settlement
    assert said in caplog.text and "store could not record" not in caplog.text
    with SQLiteJournal(path) as journal:
        record = journal.get("call_1")
        assert record is not None and record.status == "unknown"
        results = journal.reconcile({"charge": check})
        dry = journal.reconcile({"charge": check}, dry_run=True)
    assert [(r.call_id, r.outcome, r.seq) for r in results] == [("call_1", "error", None)]
    assert [(r.call_id, r.outcome, r.seq) for r in dry] == [("call_1", "error", None)]
    assert said in results[0].message and said in dry[0].message
    assert results[0].message.encode("utf-8")  # a message any output can print
    assert events(path) == after


@pytest.mark.parametrize(("answer", "said"), [
    ({"evidence": "found \udcff"}, "returned evidence that cannot be stored: it is not valid UTF-8"),
    ({"evidence": "UNPRINTABLE"}, "returned evidence that cannot be stored: its str() raised RuntimeError"),
    ({"evidence": "", "raise": True}, "raised Unsayable"),
])
@pytest.mark.parametrize("dry_run", [False, True])
def test_the_cli_reports_an_answer_that_cannot_be_stored_as_the_calls_error(
        agent: Any, db: Path, answer: dict[str, Any], said: str, dry_run: bool) -> None:
    agent.ANSWER.update(answer)
    if agent.ANSWER["evidence"] == "UNPRINTABLE":
        agent.ANSWER["evidence"] = agent.Unprintable()
    before = events(db)
    result = invoke("journal", "reconcile", "--with", "billing_checks", "--db", str(db),
                    *(["--dry-run"] if dry_run else []))
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    first = result.stdout.splitlines()[0]
    assert first.startswith("c0  charge  error  the check charge_exists ") and said in first, first
    assert events(db) == before
