"""The Python examples of docs/approvals.md run as printed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def examples() -> list[str]:
    return re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "approvals.md").read_text(), re.S)


def test_the_first_example_waits_for_approval(tmp_path: Path) -> None:
    code = examples()[0]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "approval_pending"


def test_the_langgraph_example_runs_the_refund_once_after_the_decision(tmp_path: Path) -> None:
    [code] = [c for c in examples() if "langgraph" in c]
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    request_id, messages = done.stdout.strip().splitlines()
    assert re.fullmatch(r"[0-9a-f]{32}", request_id)
    assert messages == """['{"cents":500,"refund_id":"re_1"}']"""
