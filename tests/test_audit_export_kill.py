"""An ``airlock journal export`` killed (SIGKILL) while it writes leaves no file behind: neither a
half export under the output's name nor a ``*.partial`` beside it."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest

from journal import SQLiteJournal
from journal.chain import GENESIS
from journal.export import row_hash
from tests.cli_support import AIRLOCK, ROOT, invoke

EVENTS = 40_000


@pytest.fixture(scope="module")
def large(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A journal of many refusals with large arguments, so that exporting it takes a while: its
    rows written with plain SQL (the schema's own table), each hash by the chain's rule."""
    path = tmp_path_factory.mktemp("large") / "journal.db"
    SQLiteJournal(path).close()
    arguments = orjson.dumps({"note": "x" * 2000}).decode()
    reason = orjson.dumps({"code": "rate_limited", "message": "too many calls"}, option=orjson.OPT_SORT_KEYS).decode()
    owner = orjson.dumps({"host": "h", "pid": 1}, option=orjson.OPT_SORT_KEYS).decode()
    conn = sqlite3.connect(path)
    prev, rows = GENESIS, []
    for seq in range(1, EVENTS + 1):
        at = f"2026-12-01T05:{seq // 600000 % 60:02d}:{seq // 10000 % 60:02d}.{seq % 10000:06d}Z"
        row = (seq, at, None, "refused", "charge", "agent-1", None, arguments, None, None, reason, "guard", 0, owner,
               prev)
        prev = row_hash((*row, ""))
        rows.append((*row, prev))
    conn.executemany(f"INSERT INTO events VALUES ({', '.join('?' * 16)})", rows)
    conn.commit()
    conn.close()
    assert invoke("journal", "verify", "--db", str(path)).exit_code == 0
    return path


def _writing_into(pid: int, directory: Path) -> bool:
    """Whether process ``pid`` holds a file of ``directory`` open (named or not) other than the journal."""
    try:
        links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    except OSError:
        return False
    return any(link.startswith(str(directory) + "/") and "journal.db" not in link for link in links)


def kill_mid_export(command: list[str], directory: Path) -> None:
    """Start ``command`` (an export into ``directory``), stop it once it writes its output there,
    and kill it with SIGKILL; the export was then surely cut mid-way."""
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 120
        while not _writing_into(proc.pid, directory):
            assert proc.poll() is None, f"the export ended before it was caught writing: {proc.stderr.read()!r}"
            assert time.monotonic() < deadline, "the export never began to write"
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGSTOP)
        # Stopped mid-write: its output is not all there yet.
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        if proc.stderr is not None:
            proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("journal.db"))


@pytest.mark.parametrize("signed", [False, True])
def test_a_killed_export_leaves_nothing_behind(large: Path, tmp_path: Path, signed: bool) -> None:
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    output = out_dir / "audit.jsonl"
    extra: list[str] = []
    checks: list[str] = []
    if signed:
        key = tmp_path / "key.pem"
        made = invoke("journal", "keygen", "--output", str(key))
        assert made.exit_code == 0, made.output
        extra, checks = ["--sign", str(key)], ["--public-key", made.stdout.strip()]
    kill_mid_export([AIRLOCK, "journal", "export", "--db", str(large), "--output", str(output), *extra], out_dir)
    assert _leftovers(out_dir) == []

    done = invoke("journal", "export", "--db", str(large), "--output", str(output), *extra)
    assert done.exit_code == 0, done.output
    assert done.stderr.endswith(f"Exported {EVENTS} events to {output}\n")
    checked = invoke("journal", "verify", "--export", str(output), *checks)
    assert checked.exit_code == 0, checked.output


def test_a_killed_export_over_an_older_one_leaves_the_older_one_whole(large: Path, tmp_path: Path) -> None:
    output = tmp_path / "audit.jsonl"
    output.write_bytes(b"the export of yesterday\n")
    kill_mid_export([AIRLOCK, "journal", "export", "--db", str(large), "--output", str(output)], tmp_path)
    assert output.read_bytes() == b"the export of yesterday\n"
    assert _leftovers(tmp_path) == ["audit.jsonl"]


# Where the system has no unnamed files (no O_TMPFILE: not Linux, or a file system without them).
_WITHOUT_UNNAMED_FILES = "import os, sys; del os.O_TMPFILE; from cli.main import main; sys.argv[0] = 'airlock'; main()"


def test_without_unnamed_files_the_next_export_removes_what_a_killed_one_left(large: Path, tmp_path: Path) -> None:
    output = tmp_path / "audit.jsonl"
    airlock = [sys.executable, "-c", _WITHOUT_UNNAMED_FILES]
    kill_mid_export([*airlock, "journal", "export", "--db", str(large), "-o", str(output)], tmp_path)
    left = _leftovers(tmp_path)
    assert len(left) == 1 and left[0].startswith(".audit.jsonl.") and left[0].endswith(".partial")
    (tmp_path / ".other.jsonl.h.1-0123456789abcdef.partial").write_bytes(b"another file's")  # not this export's

    done = subprocess.run([*airlock, "journal", "export", "--db", str(large), "--call", "none", "-o",
                           str(output)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert _leftovers(tmp_path) == [".other.jsonl.h.1-0123456789abcdef.partial", "audit.jsonl"]
