"""benchmarks/profile_call.py prints, for each store and path, the parts of a guarded call and the
statements it issues, and leaves no journal behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "profile_call.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=300)


def _sections(stdout: str) -> dict[str, str]:
    """The text printed under each store's title line, by title."""
    sections: dict[str, str] = {}
    title = None
    for line in stdout.splitlines():
        if line and not line.startswith(" "):
            title = line
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def _path(section: str, name: str) -> str:
    """The lines of one path (fresh, replay, refusal) of a store's section."""
    found = re.search(rf"^  {name}: .*?(?=^  \w+: |\Z)", section, re.MULTILINE | re.DOTALL)
    assert found is not None, section
    return found.group(0)


def test_each_store_prints_each_path_with_its_parts_and_statements(tmp_path: Path) -> None:
    result = _run("--calls", "20", "--stores", "memory,process", "--dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    sections = _sections(result.stdout)
    memory = next(text for title, text in sections.items() if title.startswith("in-memory store"))
    sqlite = next(text for title, text in sections.items() if title.startswith('SQLiteJournal, durability="process"'))
    for section in (memory, sqlite):
        for name in ("fresh", "replay", "refusal"):
            lines = _path(section, name)
            assert re.search(r"median [\d.]+ us, mean [\d.]+ us unprofiled; the parts add up to [\d.]+ us", lines)
            assert re.search(r"guard \(Python\) +[\d.]+ us +[\d.]+%", lines)
    assert "SQLite statements (C)" not in memory
    # A fresh call is two write transactions (pending, then the outcome); a replay and a refusal one each.
    assert re.search(r"per call: .*COMMIT x2\b", _path(sqlite, "fresh"))
    for name in ("replay", "refusal"):
        lines = _path(sqlite, name)
        assert re.search(r"per call: .*COMMIT x1\b", lines)
        assert re.search(r"SQLite statements \(C\) +[\d.]+ us", lines)
    assert list(tmp_path.iterdir()) == []  # the journals are gone with their directory


def test_an_unknown_store_or_too_few_calls_is_a_usage_error(tmp_path: Path) -> None:
    result = _run("--stores", "memory,redis", "--dir", str(tmp_path))
    assert result.returncode == 2 and "no store named redis" in result.stderr
    result = _run("--calls", "3", "--dir", str(tmp_path))
    assert result.returncode == 2 and "--calls is at least 10" in result.stderr
