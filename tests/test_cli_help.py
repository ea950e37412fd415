"""What a new operator reads first: every command's summary whole in --help, and the README naming
the extra each optional part needs and how to turn on shell completion."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.cli_support import invoke

ROOT = Path(__file__).resolve().parents[1]


def test_no_command_summary_is_cut() -> None:
    for group in ((), ("journal",)):
        shown = invoke(*group, "--help")
        assert shown.exit_code == 0
        commands = shown.stdout.split("Commands:", 1)[1]
        assert "..." not in commands
        # Each summary is a whole sentence: it ends with its full stop, however it wraps.
        summaries = re.split(r"\n  (?=\S)", "\n" + commands.strip("\n"))
        assert all(s.strip().endswith(".") for s in summaries if s.strip())


def test_the_readme_names_each_extra_and_shell_completion() -> None:
    readme = (ROOT / "README.md").read_text()
    for extra in ("postgres", "sign", "otel", "web", "langgraph", "openai-agents", "pydantic-ai", "mcp"):
        assert f"`{extra}`" in readme, extra
    assert "_AIRLOCK_COMPLETE=bash_source airlock" in readme
    airlock = Path(sys.executable).parent / "airlock"  # the console script, as a shell runs it
    completion = subprocess.run([str(airlock)], env={**os.environ, "_AIRLOCK_COMPLETE": "bash_source"},
                                capture_output=True, text=True, timeout=120)
    assert completion.returncode == 0 and "_airlock_completion" in completion.stdout
