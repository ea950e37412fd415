"""Values that are legal Python but awkward to store or show: they are keyed, recorded and returned
as the contract says, the same on every store."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

from guard.store import format_at, parse_at

# -- times ------------------------------------------------------------------------------------


def test_a_year_before_1000_has_four_digits_and_sorts_as_a_text() -> None:
    early = datetime(999, 1, 2, 3, 4, 5, 6, tzinfo=UTC)
    assert format_at(early) == "0999-01-02T03:04:05.000006Z"
    assert parse_at(format_at(early)) == early
    moments = [datetime(2026, 12, 1, tzinfo=UTC), early, datetime(1, 1, 1, tzinfo=UTC),
               datetime(1000, 1, 1, tzinfo=UTC)]
    assert sorted(format_at(m) for m in moments) == [format_at(m) for m in sorted(moments)]


def test_an_ordinary_moment_is_written_as_before() -> None:
    # The hash chain covers `at` as exported: the form of every ordinary date stays byte for byte.
    assert format_at(datetime(2026, 12, 1, 5, 23, 6, 123456, tzinfo=UTC)) == "2026-12-01T05:23:06.123456Z"
    assert format_at(datetime(2026, 12, 1, 5, 23, 6, tzinfo=UTC)) == "2026-12-01T05:23:06.000000Z"
    plus_two = timezone(timedelta(hours=2))
    assert format_at(datetime(2026, 1, 1, 1, 0, 0, 7, tzinfo=plus_two)) == "2025-12-31T23:00:00.000007Z"
