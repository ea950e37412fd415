"""The README's examples run as printed: the Quickstart, and the runbook's commands after the demo."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def section(title: str) -> str:
    text = README.read_text()
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_the_quickstart_runs_as_printed(tmp_path: Path) -> None:
    [code] = re.findall(r"```python\n(.*?)```", section("Quickstart"), re.S)
    script = tmp_path / "quickstart.py"
    script.write_text(code)
    for _ in range(2):  # a second run, on the journal the first left, as a user would try it
        done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True,
                              timeout=120, env={**os.environ, "PYTHONPATH": str(README.parent)})
        assert done.returncode == 0, done.stderr
    assert (tmp_path / "airlock-journal.db").exists()


def test_the_runbooks_commands_work_on_the_demos_journal(tmp_path: Path) -> None:
    runbook = section("Operator runbook")
    commands = [line.split("#")[0].split() for line in re.findall(r"^airlock journal [^\n]+", runbook, re.M)]
    assert len(commands) >= 4
    airlock = Path(sys.executable).with_name("airlock")
    env = {**os.environ, "AIRLOCK_JOURNAL": "airlock-demo.db"}  # as the runbook says to, after the demo
    assert subprocess.run([str(airlock), "demo"], cwd=tmp_path, capture_output=True, timeout=120).returncode == 0
    outputs = {}
    for command in commands:
        done = subprocess.run([str(airlock), *command[1:]], cwd=tmp_path, capture_output=True, text=True,
                              env=env, timeout=120)
        assert done.returncode == 0, (command, done.stderr)
        outputs[" ".join(command[2:])] = done.stdout
    assert "call_r1_2" in outputs["show --status unknown"]
    assert "unknown" in outputs["show call_r1_2"]
