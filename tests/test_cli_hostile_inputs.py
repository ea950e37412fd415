"""The CLI given what an operator did not mean, or a system that fights back: values out of range,
bytes that are not UTF-8, an --output that names the journal or a FIFO, a full disk on stdout.
Each is one ``Error:`` line and an exit code, never a traceback, and the journal is left alone."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cli_support import digest, invoke, seed


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "journal.db"
    seed(path)
    return path


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


# -- times and counts out of range ---------------------------------------------------------------

OUT_OF_RANGE = "is out of range: give a time in the years 1000 to 9999 (UTC)"


@pytest.mark.parametrize(("command", "flag"), [("show", "--since"), ("export", "--since"), ("export", "--until")])
@pytest.mark.parametrize("moment", [
    "999999999999d",  # more seconds than timedelta holds
    "1000000w",  # before the year 1
    "9" * 5000 + "d",  # more digits than int() reads
    "0001-01-01T00:00:00+01:00",  # the year 0 in UTC
    "9999-12-31T23:59:59-01:00",  # the year 10000 in UTC
    "0999-12-31T23:59:59Z",  # a three-digit year, which stored times cannot be compared with
    "500000d",
])
def test_a_moment_out_of_range_is_a_usage_error(db: Path, command: str, flag: str, moment: str) -> None:
    before = digest(db)
    result = invoke("journal", command, "--db", str(db), flag, moment)
    assert result.exit_code == 2, result.output
    assert last_line(result.stderr) == f"Error: Invalid value for '{flag}': {moment!r} {OUT_OF_RANGE}"
    assert result.stdout == ""
    assert digest(db) == before


@pytest.mark.parametrize("moment", ["1000-01-01", "9999-12-31T23:59:59.999999Z"])
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
