"""The CLI given what an operator did not mean, or a system that fights back: values out of range,
bytes that are not UTF-8, an --output that names the journal or a FIFO, a full disk on stdout.
Each is one ``Error:`` line and an exit code, never a traceback, and the journal is left alone."""

from __future__ import annotations

import os
import sqlite3
import stat
import subprocess
from pathlib import Path

import orjson
import pytest

from journal import SQLiteJournal
from tests.cli_support import AIRLOCK, count_events, digest, invoke, leave_pending, run_airlock, seed


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seed(path)
    return path


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# -- times and counts out of range ---------------------------------------------------------------

OUT_OF_RANGE = "is out of range: give a time in the years 1 to 9999 (UTC)"


@pytest.mark.parametrize(("command", "flag"), [("show", "--since"), ("export", "--since"), ("export", "--until")])
@pytest.mark.parametrize("moment", [
    "999999999999d",  # more seconds than timedelta holds
    "1000000w",  # before the year 1
    "9" * 5000 + "d",  # more digits than int() reads
    "0001-01-01T00:00:00+01:00",  # the year 0 in UTC
    "9999-12-31T23:59:59-01:00",  # the year 10000 in UTC
])
def test_a_moment_out_of_range_is_a_usage_error(db: Path, command: str, flag: str, moment: str) -> None:
    before = digest(db)
    result = invoke("journal", command, "--db", str(db), flag, moment)
    assert result.exit_code == 2, result.output
    assert last_line(result.stderr) == f"Error: Invalid value for '{flag}': {moment!r} {OUT_OF_RANGE}"
    assert result.stdout == ""
    assert digest(db) == before


@pytest.mark.parametrize("moment", ["0001-01-01T01:00:00+01:00", "0999-12-31", "500000d", "1000-01-01",
                                    "9999-12-31T23:59:59.999999Z"])
def test_the_first_and_last_moments_in_range_are_taken(db: Path, moment: str) -> None:
    since = invoke("journal", "export", "--db", str(db), "--since", moment)
    until = invoke("journal", "export", "--db", str(db), "--until", moment)
    everything = invoke("journal", "export", "--db", str(db))
    assert since.exit_code == until.exit_code == 0, since.output + until.output
    # every event is of now: after the first moment, before the last one
    assert (since.stdout or until.stdout) == everything.stdout
    assert "" in (since.stdout, until.stdout)


@pytest.mark.parametrize("limit", ["9223372036854775807", "99999999999999999999"])
def test_a_limit_beyond_any_journal_shows_every_call(db: Path, limit: str) -> None:
    every = invoke("journal", "show", "--db", str(db), "--json")
    result = invoke("journal", "show", "--db", str(db), "--json", "--limit", limit)
    assert result.exit_code == 0, result.output
    assert result.stdout == every.stdout
    assert len(result.stdout.splitlines()) == 4
    table = invoke("journal", "show", "--db", str(db), "--limit", limit)
    assert table.exit_code == 0 and table.stderr == ""  # the list was not cut, so no note says so
    assert len(table.stdout.splitlines()) == 5


def test_a_limit_of_zero_is_still_a_usage_error(db: Path) -> None:
    result = invoke("journal", "show", "--db", str(db), "--limit", "0")
    assert result.exit_code == 2
    assert last_line(result.stderr) == "Error: Invalid value for '--limit': 0 is not in the range x>=1."


# -- bytes that are not UTF-8 --------------------------------------------------------------------

# click reads a byte of the command line that is not UTF-8 as a lone surrogate (surrogateescape).
NOT_UTF8 = "\udcff"


@pytest.mark.parametrize(("args", "name", "shown"), [
    (["show", "c" + NOT_UTF8], "'[CALL_ID]'", r"c\xff"),
    (["show", "--tool", "t" + NOT_UTF8], "'--tool'", r"t\xff"),
    (["show", "--agent", "a" + NOT_UTF8], "'--agent'", r"a\xff"),
    (["export", "--call", "c" + NOT_UTF8], "'--call'", r"c\xff"),
    (["export", "--tool", "t" + NOT_UTF8], "'--tool'", r"t\xff"),
    (["export", "--agent", "a" + NOT_UTF8], "'--agent'", r"a\xff"),
    (["resolve", "c" + NOT_UTF8, "--applied", "--reason", "r"], "'CALL_ID'", r"c\xff"),
    (["resolve", "call-timeout", "--applied", "--reason", "r" + NOT_UTF8], "'--reason'", r"r\xff"),
    (["resolve", "call-timeout", "--applied", "--reason", "r", "--operator", "o" + NOT_UTF8], "'--operator'",
     r"o\xff"),
    (["resolve", "call-timeout", "--applied", "--reason", "r", "--value", f'"v{NOT_UTF8}"'], "'--value'",
     r'"v\xff"'),
])
def test_an_argument_that_is_not_utf8_is_a_usage_error(db: Path, args: list[str], name: str, shown: str) -> None:
    before = digest(db)
    result = invoke("journal", *args, "--db", str(db))
    assert result.exit_code == 2, result.output
    assert last_line(result.stderr) == f"Error: Invalid value for {name}: '{shown}' is not valid UTF-8"
    assert digest(db) == before


DB_NOT_UTF8 = ("is not valid UTF-8: name the journal by a path that is "
               "(rename the file, or link to it under a UTF-8 name)")


@pytest.mark.parametrize("command", ["stats", "show", "verify", "export", "rebuild"])
def test_a_journal_path_that_is_not_utf8_is_a_usage_error(tmp_path: Path, command: str) -> None:
    # a real process, so the name reaches the command line as the bytes of the file's name
    path = tmp_path / f"bad{NOT_UTF8}.db"
    seed(path)
    before = digest(path)
    result = run_airlock("journal", command, "--db", str(path))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert last_line(result.stderr) == (f"Error: Invalid value for '--db': "
                                        f"'{tmp_path}/bad\\xff.db' {DB_NOT_UTF8}")
    assert digest(path) == before


def test_a_call_id_of_bytes_that_are_not_utf8_in_a_real_process(db: Path) -> None:
    result = run_airlock("journal", "show", "c" + NOT_UTF8, "--db", str(db))
    assert result.returncode == 2
    assert last_line(result.stderr) == "Error: Invalid value for '[CALL_ID]': 'c\\xff' is not valid UTF-8"


def test_demo_refuses_an_empty_db_as_the_journal_commands_do(tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("demo", "--db", "")
    assert result.exit_code == 2, result.output
    assert last_line(result.stderr) == ("Error: Invalid value for '--db': is empty: give the path of a journal "
                                        "file or a postgresql:// URL")
    assert list(tmp_path.iterdir()) == []


# -- a --value nested too deeply -----------------------------------------------------------------

TOO_DEEP = "Error: Invalid value for '--value': nests arrays or objects too deeply to be stored (at most 250 levels)"


@pytest.mark.parametrize("levels", [251, 300, 1000, 5000])
@pytest.mark.parametrize(("opening", "inside", "closing"), [("[", "", "]"), ('{"a":', "1", "}")])
def test_a_value_nested_too_deeply_is_a_usage_error(db: Path, levels: int, opening: str, inside: str,
                                                    closing: str) -> None:
    value = opening * levels + inside + closing * levels
    before = digest(db)
    result = invoke("journal", "resolve", "call-timeout", "--applied", "--reason", "r", "--value", value,
                    "--db", str(db))
    assert result.exit_code == 2, result.output
    assert last_line(result.stderr) == TOO_DEEP
    assert digest(db) == before


def test_a_value_nested_as_deeply_as_allowed_is_stored_and_shown(db: Path) -> None:
    value = "[" * 250 + "]" * 250
    result = invoke("journal", "resolve", "call-timeout", "--applied", "--reason", "r", "--value", value,
                    "--db", str(db))
    assert result.exit_code == 0, result.output
    for args in (["show", "--json"], ["show", "call-timeout", "--json"], ["export"]):
        shown = invoke("journal", *args, "--db", str(db))
        assert shown.exit_code == 0, (args, shown.output)
        assert value in shown.stdout


def test_a_tool_value_nested_as_deeply_as_it_can_be_stored_is_shown(tmp_path: Path) -> None:
    import orjson

    from guard.store import EffectEvent

    value: object = 1
    for _ in range(254):  # as deep as orjson writes, so as deep as a tool's value is ever stored
        value = [value]
    path = tmp_path / "deep.db"
    with SQLiteJournal(path) as journal:
        journal.append(EffectEvent("pending", "deep", "nest", attempt=1))
        journal.append(EffectEvent("committed", "deep", "nest", attempt=1, value=orjson.dumps(value).decode()))
    for args in (["show", "--json"], ["show", "deep", "--json"]):
        shown = invoke("journal", *args, "--db", str(path))
        assert shown.exit_code == 0, (args, shown.output)
        assert orjson.loads(shown.stdout.splitlines()[0])["value"] == value


# -- export --output that is not an ordinary file ------------------------------------------------


@pytest.mark.parametrize(("name", "what"), [
    ("journal.db", "the journal"),
    ("journal.db-wal", "a file SQLite keeps with the journal"),
    ("journal.db-shm", "a file SQLite keeps with the journal"),
])
def test_export_refuses_to_write_over_the_journal(db: Path, name: str, what: str) -> None:
    with SQLiteJournal(db):  # open for writing elsewhere: its -wal and -shm are beside it
        assert db.with_name(name).exists()
        before = digest(db)
        output = str(db.with_name(name))
        result = invoke("journal", "export", "--db", str(db), "-o", output)
        assert result.exit_code == 2, result.output
        assert last_line(result.stderr) == (f"Error: Invalid value for '--output' / '-o': {output} is {what} {db}: "
                                            "write the export to another file")
        assert digest(db) == before
    assert invoke("journal", "verify", "--db", str(db)).exit_code == 0


@pytest.mark.parametrize("link", ["symlink", "hardlink", "relative"])
def test_export_refuses_the_journal_by_another_name(db: Path, link: str, monkeypatch: pytest.MonkeyPatch) -> None:
    other = db.with_name("other-name.jsonl")
    if link == "symlink":
        other.symlink_to(db)
    elif link == "hardlink":
        other.hardlink_to(db)
    else:
        monkeypatch.chdir(db.parent)
        other = Path("..") / db.parent.name / db.name
    before = digest(db)
    result = invoke("journal", "export", "--db", str(db), "-o", str(other))
    assert result.exit_code == 2, result.output
    assert last_line(result.stderr) == (f"Error: Invalid value for '--output' / '-o': {other} is the journal {db}: "
                                        "write the export to another file")
    assert digest(db) == before


def test_export_writes_into_a_fifo_and_leaves_it_a_fifo(db: Path) -> None:
    fifo = db.with_name("out.fifo")
    os.mkfifo(fifo)
    # The reader is open before the writer, so neither waits; the export fits in the pipe's buffer.
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        result = run_airlock("journal", "export", "--db", str(db), "-o", str(fifo))
        received = b""
        while chunk := os.read(reader, 65536):
            received += chunk
    finally:
        os.close(reader)
    assert result.returncode == 0, result.stderr
    assert result.stderr == f"Exported {count_events(db)} events to {fifo}\n"
    assert stat.S_ISFIFO(fifo.stat().st_mode)
    assert received.decode() == invoke("journal", "export", "--db", str(db)).stdout
    assert list(db.parent.glob("*.partial")) == []


# -- stdout that takes no more -------------------------------------------------------------------

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full here")


def run_into(stdout: int, *args: str) -> subprocess.CompletedProcess[bytes]:
    """The installed ``airlock`` with its stdout on the file descriptor ``stdout``."""
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    return subprocess.run([AIRLOCK, *args], stdout=stdout, stderr=subprocess.PIPE, env=env, timeout=60)


@needs_dev_full
@pytest.mark.parametrize("args", [
    ["journal", "show"], ["journal", "show", "--json"], ["journal", "show", "call-ok"],
    ["journal", "show", "call-ok", "--json"], ["journal", "stats"], ["journal", "stats", "--json"],
    ["journal", "verify"], ["journal", "verify", "--json"], ["journal", "rebuild"],
    ["journal", "resolve", "call-timeout", "--not-applied", "--reason", "r"],
])
def test_a_full_disk_on_stdout_is_one_error_line(db: Path, args: list[str]) -> None:
    with open("/dev/full", "wb") as full:  # only ever stdout, through the descriptor
        result = run_into(full.fileno(), *args, "--db", str(db))
    assert result.returncode == 1
    assert result.stderr.decode() == "Error: the output could not be written: No space left on device\n"


@needs_dev_full
def test_a_full_disk_on_the_stdout_of_the_demo_is_one_error_line(tmp_path: Path) -> None:
    with open("/dev/full", "wb") as full:
        result = run_into(full.fileno(), "demo", "--db", str(tmp_path / "demo.db"))
    assert result.returncode == 1
    assert result.stderr.decode() == "Error: the output could not be written: No space left on device\n"


@pytest.mark.parametrize("args", [["journal", "stats"], ["journal", "show", "--json"], ["journal", "verify"]])
def test_a_pipe_closed_before_the_output_ends_the_command_quietly(db: Path, args: list[str]) -> None:
    reading, writing = os.pipe()
    os.close(reading)  # nobody will read: the first write is EPIPE
    try:
        result = run_into(writing, *args, "--db", str(db))
    finally:
        os.close(writing)
    assert result.returncode == 1
    assert result.stderr == b""


def test_verify_json_of_a_bad_chain_also_prints_the_error_line(db: Path) -> None:
    conn = sqlite3.connect(db)
    try:
        conn.execute("DROP TRIGGER events_no_update")
        conn.execute("UPDATE events SET arguments = '{\"account\":\"acct_1\",\"cents\":5}' WHERE seq = 2")
        conn.commit()
    finally:
        conn.close()
    result = invoke("journal", "verify", "--json", "--db", str(db))
    assert result.exit_code == 1
    problem = "seq 2 has been altered: its hash does not match its fields"
    assert result.stderr == f"Error: {db} does not verify at seq 2: {problem}\n"
    reported = orjson.loads(result.stdout)
    assert (reported["ok"], reported["first_bad_seq"], reported["problem"]) == (False, 2, problem)
    plain = invoke("journal", "verify", "--db", str(db))
    assert plain.exit_code == 1 and plain.stderr == result.stderr


@pytest.mark.parametrize("args", [
    ["journal", "show"], ["journal", "show", "--json"], ["journal", "show", "call-ok"], ["journal", "export"],
    ["journal", "stats", "--json"], ["journal", "verify", "--json"],
])
def test_a_closed_stdout_is_one_error_line(db: Path, args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    result = subprocess.run([AIRLOCK, *args, "--db", str(db)], stderr=subprocess.PIPE, env=env, timeout=60,
                            preexec_fn=lambda: os.close(1))  # started as `airlock ... >&-`
    assert result.returncode == 1
    assert result.stderr.decode().endswith("could not be written: stdout is closed\n"), result.stderr.decode()
    assert result.stderr.decode().count("\n") == 1


def test_export_to_a_file_needs_no_stdout(db: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    out = tmp_path / "out.jsonl"
    result = subprocess.run([AIRLOCK, "journal", "export", "--db", str(db), "-o", str(out)], stderr=subprocess.PIPE,
                            env=env, timeout=60, preexec_fn=lambda: os.close(1))
    assert result.returncode == 0, result.stderr.decode()
    assert out.read_bytes().count(b"\n") == count_events(db)


def test_export_to_a_file_of_a_journal_named_by_a_symlink_loop_says_it_is_a_link_to_nothing(tmp_path: Path) -> None:
    loop = tmp_path / "loop.db"
    loop.symlink_to(loop)
    result = invoke("journal", "export", "--db", str(loop), "-o", str(tmp_path / "x.jsonl"))
    assert result.exit_code == 1
    assert last_line(result.stderr) == (
        f"Error: The journal {loop} is a symbolic link that leads to no file (its target is gone, or the links "
        "go round in a loop).")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["loop.db"]


def test_an_empty_output_is_a_usage_error(db: Path) -> None:
    before = digest(db)
    result = invoke("journal", "export", "--db", str(db), "--output", "")
    assert result.exit_code == 2
    assert last_line(result.stderr) == (
        "Error: Invalid value for '--output' / '-o': is empty: name the file to write the export to")
    assert digest(db) == before


def test_a_value_with_a_key_twice_is_a_usage_error(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    seed(path)
    leave_pending(path, "call-dead")
    before = digest(path)
    result = invoke("journal", "resolve", "call-dead", "--db", str(path), "--applied", "--value",
                    '{"charge_id": "ch_1", "charge_id": "ch_2"}', "--reason", "r")
    assert result.exit_code == 2
    assert last_line(result.stderr).endswith("has the key 'charge_id' twice in one object; write each key once")
    assert digest(path) == before


def test_a_text_of_the_file_that_is_not_utf8_is_one_line_naming_the_damage(tmp_path: Path) -> None:
    path = tmp_path / "j.db"
    seed(path)
    conn = sqlite3.connect(path)
    [(first_hash,)] = conn.execute("SELECT hash FROM events WHERE seq = 1").fetchall()
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    data = bytearray(path.read_bytes())
    where = data.find(first_hash.encode())
    data[where + 10: where + 14] = b"\xff\x0c\x1a\xfe"  # bytes overwritten: no UTF-8, and a form feed
    path.write_bytes(bytes(data))
    for command in (["verify"], ["export"], ["rebuild"], ["show", "--json"]):
        result = invoke("journal", *command, "--db", str(path))
        if command[0] == "show":  # the calls' table holds no hash: it is read as it is
            assert result.exit_code == 0, result.output
            continue
        assert result.exit_code == 1, command
        [line] = result.stderr.splitlines()
        assert line.startswith(f"Error: The journal {path} holds a text that is not UTF-8 in "), line
        assert line.endswith("the file is damaged; restore it from a copy, or read what is left with a tool that "
                             "takes bytes."), line


def test_control_characters_in_an_error_are_written_as_escapes() -> None:
    from cli.options import one_line

    said = one_line("cannot read \x1b[31mred\x1b[0m:\n  line two\x0cpage\u2028sep\x85 \tend")
    assert said == "cannot read \\x1b[31mred\\x1b[0m: line two\\x0cpage\\u2028sep\\x85 \tend"
    assert len(said.splitlines()) == 1


def test_export_to_a_symlink_writes_the_file_it_names_and_keeps_the_link(db: Path, tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    target = tmp_path / "elsewhere" / "trail.jsonl"
    target.write_text("old\n")
    link = tmp_path / "trail.jsonl"
    link.symlink_to(target)
    result = invoke("journal", "export", "--db", str(db), "-o", str(link))
    assert result.exit_code == 0, result.output
    assert link.is_symlink()
    assert target.read_bytes().count(b"\n") == count_events(db)


def test_export_to_dev_stdout_sent_to_a_file_writes_the_file(db: Path, tmp_path: Path) -> None:
    if not os.path.exists("/dev/stdout"):
        pytest.skip("no /dev/stdout here")
    out = tmp_path / "out.jsonl"
    with out.open("wb") as file:
        result = run_into(file.fileno(), "journal", "export", "--db", str(db), "-o", "/dev/stdout")
    assert result.returncode == 0, result.stderr.decode()
    assert out.read_bytes().count(b"\n") == count_events(db)


def test_a_table_cut_short_by_its_reader_is_not_reported_as_whole(tmp_path: Path) -> None:
    # The table is written in one piece, larger than a pipe holds: the reader leaves after a few
    # bytes, and the write comes back short. That must end as a failed write (exit 1), not exit 0.
    from guard.store import EffectEvent
    from journal import SQLiteJournal

    path = tmp_path / "many.db"
    with SQLiteJournal(path, durability="process") as journal:
        for n in range(3000):
            journal.append(EffectEvent("pending", f"call-{n:05d}", "charge", attempt=1))
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    child = subprocess.Popen([AIRLOCK, "journal", "show", "--limit", "5000", "--db", str(path)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert child.stdout is not None and child.stderr is not None
    assert len(child.stdout.read(10)) == 10
    child.stdout.close()
    errors = child.stderr.read()
    assert child.wait(60) == 1
    assert errors == b""  # a reader that left is no error to report, as documented


@pytest.mark.parametrize("args", [["--help"], ["--version"], ["journal", "--help"], ["journal", "show", "--help"]])
def test_help_and_version_that_cannot_be_written_are_one_error_line(args: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if k != "AIRLOCK_JOURNAL"}
    closed = subprocess.run([AIRLOCK, *args], stderr=subprocess.PIPE, env=env, timeout=60,
                            preexec_fn=lambda: os.close(1))
    assert closed.returncode == 1
    assert closed.stderr.decode() == "Error: the output could not be written: stdout is closed\n"
    if os.path.exists("/dev/full"):
        with open("/dev/full", "wb") as full:
            result = run_into(full.fileno(), *args)
        assert result.returncode == 1
        assert result.stderr.decode() == "Error: the output could not be written: No space left on device\n"


def test_export_refuses_the_side_files_of_a_journal_named_through_a_link(db: Path, tmp_path: Path) -> None:
    (tmp_path / "links").mkdir()
    link = tmp_path / "links" / "journal.db"
    link.symlink_to(db)
    before = digest(db)
    for side in ("-wal", "-shm"):
        result = invoke("journal", "export", "--db", str(link), "-o", f"{db}{side}")
        assert result.exit_code == 2, result.output
        assert "a file SQLite keeps with the journal" in result.stderr
    assert digest(db) == before
