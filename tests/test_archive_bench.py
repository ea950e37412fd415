"""benchmarks/archive_bench.py runs on a small journal and prints each of its figures."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "archive_bench.py"


def test_the_archive_benchmark_prints_its_figures() -> None:
    result = subprocess.run([sys.executable, str(SCRIPT), "--events", "2000"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("journal: 2,000 events, 1,000 calls")
    assert lines[1].startswith("verify (whole journal):") and "events/s" in lines[1] and "peak" in lines[1]
    assert lines[2].startswith("archive (verify, write, commit, vacuum):") and "(1,800 events moved)" in lines[2]
    assert any(line.startswith("guarded calls made during the archive") for line in lines)
    assert any(line.startswith("file: ") and "MiB after" in line for line in lines)
    assert lines[-1].startswith("verify (archive + journal):")
