"""A short run of benchmarks/soak.py: processes SIGKILLed at random, no effect twice, nothing lost."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "benchmarks" / "soak.py"


def soak(*args: str) -> tuple[int, dict[str, str]]:
    proc = subprocess.run([sys.executable, str(SOAK), "--seed", "7", *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    figures = dict(re.findall(r"^\s*([^:\n]+): (.*)$", proc.stdout, re.MULTILINE))
    assert "RESULT" in figures, proc.stdout + proc.stderr
    return proc.returncode, figures


def test_a_short_soak_with_kills_makes_no_double_effect_and_verifies(tmp_path: Path) -> None:
    code, figures = soak("--seconds", "6", "--procs", "3", "--kill-every", "0.5", "--db", str(tmp_path / "soak.db"))
    assert (code, figures["RESULT"]) == (0, "ok"), figures
    assert int(figures["kills"]) >= 3
    assert int(figures["calls completed"]) > 20
    assert int(figures["effects"]) > 0
    assert figures["double effects"] == "0"
    assert figures["values lost or changed"] == "0"
    assert figures["committed without effect"] == "0"
    assert figures["worker crashes"] == "0"
    assert figures["chain and projection verify"] == "ok"


def test_the_soak_catches_double_effects_when_the_store_forgets_on_a_kill() -> None:
    # Each worker guarded by its own in-memory store: a retry in another process runs again.
    code, figures = soak("--seconds", "6", "--procs", "2", "--kill-every", "1.0", "--memory")
    assert (code, figures["RESULT"]) == (1, "FAILED")
    assert int(figures["double effects"]) > 0


@pytest.mark.postgres
def test_a_short_soak_on_postgres_makes_no_double_effect_and_verifies() -> None:
    from tests.pgserver import fresh_database, require_server

    dsn = fresh_database(require_server())
    code, figures = soak("--seconds", "6", "--procs", "3", "--kill-every", "0.5", "--db", dsn)
    assert (code, figures["RESULT"]) == (0, "ok"), figures
    assert figures["journal"] == "PostgreSQL"
    assert int(figures["kills"]) >= 3
    assert int(figures["calls completed"]) > 10
    assert figures["double effects"] == "0"
    assert figures["values lost or changed"] == "0"
    assert figures["chain and projection verify"] == "ok"
