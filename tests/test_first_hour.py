"""A newcomer's first hour, as the README tells it: on a fresh copy of the checkout, in a shell with
no environment of ours active, the set-up command as printed, the Quickstart, then the runbook's
commands and the ones the demo prints, each exactly as printed.

Slow (it makes a virtual environment and installs the project into it, from pip's cache when it
can), but part of the default run: it is the one test that takes nothing from this environment.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RUNBOOK = (ROOT / "docs" / "runbook.md").read_text()

pytestmark = pytest.mark.slow

# What a clone holds that a newcomer's copy would not: environments, caches, journals.
_NOT_IN_A_CLONE = shutil.ignore_patterns(".venv*", ".git", "__pycache__", "*.egg-info", ".pytest_cache",
                                         ".mypy_cache", ".ruff_cache", ".hypothesis", ".pgtest", "build", "dist",
                                         "*.db", "*.db-wal", "*.db-shm")


def section(text: str, title: str) -> str:
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


def command_lines(block: str) -> list[str]:
    """The commands of a shell block, each as printed (a line ending in a backslash goes on)."""
    return [line for line in re.sub(r"\\\n\s*", " ", block).splitlines() if line.strip()]


def newcomers_shell() -> dict[str, str]:
    """The environment of a fresh login shell: the system's PATH, no virtual environment active, no
    journal named; pip's cache (under HOME) kept, so the install can be quick."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("VIRTUAL_ENV", "PYTHONPATH", "AIRLOCK_JOURNAL", "PYTHONHOME") and not k.startswith("PYTEST")}
    venv_bin = str(Path(sys.executable).parent)
    env["PATH"] = os.pathsep.join(p for p in os.environ.get("PATH", "/usr/bin:/bin").split(os.pathsep)
                                  if p and p != venv_bin)
    return env


@pytest.fixture(scope="module")
def clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("python3", path=newcomers_shell()["PATH"]) is None:
        pytest.skip("no python3 on the system PATH, which the README's set-up command runs")
    target = tmp_path_factory.mktemp("newcomer") / "airlock-journal"
    shutil.copytree(ROOT, target, ignore=_NOT_IN_A_CLONE)
    return target


def run_as_printed(clone: Path, script: str) -> subprocess.CompletedProcess[str]:
    """``script`` in one bash session in the clone, stopping at the first command that fails."""
    return subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=clone, env=newcomers_shell(),
                          capture_output=True, text=True, timeout=900)


MARKER = "=== step "


@pytest.fixture(scope="module")
def first_session(clone: Path) -> tuple[list[str], subprocess.CompletedProcess[str]]:
    """One shell session on the fresh clone: the README's set-up command, the Quickstart run as the
    README says, then the runbook's commands, each as printed. (The steps, the finished session.)"""
    [setup] = command_lines(blocks(section(README, "Two commands"), "sh")[0])
    [quickstart] = blocks(section(README, "Quickstart"), "python")
    (clone / "quickstart.py").write_text(quickstart)
    runbook = section(README, "Operator runbook")
    [choose] = re.findall(r"`(export AIRLOCK_JOURNAL=[^`]+)`", runbook)
    operator = command_lines(blocks(runbook, "sh")[0])
    assert len(operator) >= 4 and all(line.startswith("airlock journal ") for line in operator)
    steps = [setup, "python quickstart.py", "airlock journal show --limit 1", choose, *operator]
    script = "\n".join(f"echo '{MARKER}{n}'\n{step}" for n, step in enumerate(steps))
    return steps, run_as_printed(clone, script)


def test_the_readme_takes_a_newcomer_from_clone_to_the_runbook(
    first_session: tuple[list[str], subprocess.CompletedProcess[str]],
) -> None:
    steps, done = first_session
    failed_at = steps[max(0, done.stdout.count(MARKER) - 1)]
    assert done.returncode == 0, (failed_at, done.stdout[-3000:], done.stderr[-3000:])
    outputs = dict(zip(steps, done.stdout.split(MARKER)[1:], strict=True))
    setup = steps[0]
    assert setup.startswith("python3 -m venv .venv") and setup.endswith("airlock demo")
    assert "call_r1_2" in outputs[setup]  # the demo ran, in the shell the set-up left
    assert "charged once" in outputs["python quickstart.py"]  # the Quickstart says that it worked
    assert "committed" in outputs["airlock journal show --limit 1"]  # and its call is in the default journal
    by_args = {" ".join(step.split("#")[0].split()): out for step, out in outputs.items()}
    assert "call_r1_2" in by_args["airlock journal show --status unknown"]
    assert "unknown" in by_args["airlock journal show call_r1_2"] and "key" in by_args["airlock journal show call_r1_2"]


def test_the_commands_the_demo_prints_work_as_printed(
    clone: Path, first_session: tuple[list[str], subprocess.CompletedProcess[str]],
) -> None:
    _, done = first_session
    demo = done.stdout.split(MARKER)[1]
    shown = re.findall(r"`(airlock journal [^`]+)`", demo)
    # The resolve it prints, from its first line through the lines its backslashes continue.
    printed = re.findall(r"^ *(airlock journal resolve (?:[^\n]*\\\n)*[^\n]*)", demo, re.M)
    # A template with a word to fill in (`reconcile --with MODULE`) is advice, not a command to run.
    commands = [c for c in [*shown, *printed] if not re.search(r"\b[A-Z]{2,}(?:_[A-Z]+)*\b", c)]
    assert any(" show " in c for c in commands) and any(" resolve " in c for c in commands), demo
    # In a new shell, as the README says: the environment activated first.
    again = run_as_printed(clone, "\n".join([". .venv/bin/activate", *commands]))
    assert again.returncode == 0, (commands, again.stderr[-3000:])
    assert "Appended seq" in again.stdout and "committed by operator:" in again.stdout


def test_the_runbooks_listing_of_many_stuck_calls_runs_as_printed(
    clone: Path, first_session: tuple[list[str], subprocess.CompletedProcess[str]],
) -> None:
    stuck = section(RUNBOOK, "When many calls are stuck at once")
    lines = command_lines(blocks(stuck, "sh")[0])
    if shutil.which("jq", path=newcomers_shell()["PATH"]) is None:
        lines = [line for line in lines if "| jq" not in line]
    # A new shell; the demo once more, so that a call is stuck whatever the tests before settled.
    script = "\n".join([". .venv/bin/activate", "airlock demo > /dev/null", "export AIRLOCK_JOURNAL=airlock-demo.db",
                        *lines])
    done = run_as_printed(clone, script)
    assert done.returncode == 0, (lines, done.stderr[-3000:])
    assert done.stderr == ""  # nothing was left out of the lists
    listed = (clone / "stuck.csv").read_text().splitlines()
    assert listed[0].startswith("call_id,tool,status,") and any(",unknown," in row for row in listed[1:])


def test_the_setup_command_activates_the_environment_in_the_users_shell() -> None:
    [setup] = command_lines(blocks(section(README, "Two commands"), "sh")[0])
    # Activating must happen in the user's own shell, and before the commands that need `airlock`.
    assert ". .venv/bin/activate &&" in setup and shlex.split(setup)[0] == "python3"
