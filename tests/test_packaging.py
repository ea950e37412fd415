"""The distribution as an installed user meets it: ``python -m cli``, and the pytest plugin that is
loaded in every pytest run of the environment, in projects that have packages of their own named
``journal`` (or ``guard``, ``cli``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

from journal import SQLiteJournal

ROOT = Path(__file__).resolve().parent.parent


def run_module(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_COLOR": "1"})


# -- python -m cli -------------------------------------------------------------------------------


def test_python_m_cli_runs_the_airlock_command(tmp_path: Path) -> None:
    proc = run_module("cli", "--help", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("Usage: python -m cli [OPTIONS] COMMAND [ARGS]...")
    assert "journal" in proc.stdout and "demo" in proc.stdout


def test_python_m_cli_reads_a_journal_and_reports_errors_as_the_command_does(tmp_path: Path) -> None:
    db = tmp_path / "j.db"
    SQLiteJournal(db).close()
    proc = run_module("cli", "journal", "verify", "--db", str(db), cwd=tmp_path)
    assert (proc.returncode, proc.stdout) == (0, f"OK: 0 events, head {'0' * 64}\n"), proc.stderr
    missing = tmp_path / "missing.db"
    proc = run_module("cli", "journal", "stats", "--db", str(missing), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr.startswith("Error: ") and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert not missing.exists()


def test_python_m_cli_passes_on_usage_errors_with_exit_2(tmp_path: Path) -> None:
    proc = run_module("cli", "journal", "resolve", "c1", "--reason", "x", cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "Error: give exactly one of --applied or --not-applied"


# -- the pytest plugin ---------------------------------------------------------------------------


def test_the_plugin_entry_point_names_a_module_outside_the_three_packages() -> None:
    dist = metadata.distribution("airlock-journal")
    plugins = {ep.name: ep.value for ep in dist.entry_points if ep.group == "pytest11"}
    assert plugins == {"airlock_journal": "pytest_airlock_journal"}


def user_project(root: Path, tests: str, *, own_packages: tuple[str, ...] = ()) -> Path:
    """A project at ``root`` with ``tests/test_user.py`` and, for each of ``own_packages``, a package
    of that name of its own."""
    for name in own_packages:
        (root / name).mkdir(parents=True)
        (root / name / "__init__.py").write_text(f"WHOSE = 'the user project'\nNAME = {name!r}\n")
    (root / "tests").mkdir(parents=True)
    (root / "tests" / "test_user.py").write_text(textwrap.dedent(tests))
    (root / "pytest.ini").write_text("[pytest]\npythonpath = .\n")
    return root


def run_pytest(project: Path) -> subprocess.CompletedProcess[str]:
    return run_module("pytest", "-q", "-p", "no:cacheprovider", "tests", cwd=project)


OWN_PACKAGES_TEST = """
    import sys

    import cli
    import guard
    import journal


    def test_the_projects_own_packages_are_the_ones_imported(request):
        assert request.config.pluginmanager.has_plugin("airlock_journal")
        for package in (journal, guard, cli):
            assert package.WHOSE == "the user project", package.__file__


    def test_nothing_of_airlock_is_loaded():
        loaded = {name for name in sys.modules if name.split(".")[0] in ("journal", "guard", "cli")}
        assert loaded == {"journal", "guard", "cli"}
        assert all(getattr(sys.modules[name], "WHOSE", None) == "the user project" for name in loaded)
"""


def test_a_project_with_its_own_journal_guard_and_cli_packages_keeps_them(tmp_path: Path) -> None:
    project = user_project(tmp_path / "project", OWN_PACKAGES_TEST, own_packages=("journal", "guard", "cli"))
    proc = run_pytest(project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout


def test_loading_the_plugin_imports_nothing_of_airlock(tmp_path: Path) -> None:
    project = user_project(tmp_path / "project", """
        import sys


        def test_no_airlock_module_is_imported(request):
            assert request.config.pluginmanager.has_plugin("airlock_journal")
            assert not {name for name in sys.modules if name.split(".")[0] in ("journal", "guard", "cli")}
    """)
    proc = run_pytest(project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_a_project_that_uses_the_fixtures_gets_a_journal_and_an_effect_log(tmp_path: Path) -> None:
    project = user_project(tmp_path / "project", """
        from guard import Airlock, AirlockContext, SecurityPolicy
        from guard.effect_guard import EffectGuard


        def test_a_retried_call_runs_once(airlock_journal, airlock_journal_path, airlock_effects):
            @Airlock(SecurityPolicy(effect_guard=EffectGuard(store=airlock_journal)))
            def charge(account: str) -> dict:
                airlock_effects.record("call_1", account=account)
                return {"charged": account}

            for _ in range(2):
                with AirlockContext(metadata={"tool_call_id": "call_1"}):
                    assert charge("acct_1") == {"charged": "acct_1"}
            assert airlock_effects.count("call_1") == 1
            assert [e.kind for e in airlock_journal.call_events("call_1")] == ["pending", "committed", "replayed"]
            assert airlock_journal_path.exists()
    """)
    proc = run_pytest(project)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout


def test_a_fixture_used_where_the_project_owns_the_name_journal_fails_saying_so(tmp_path: Path) -> None:
    # A module journal.py: under an editable install a package of that name could still be given
    # airlock's submodules by the install's import hook, a module never.
    project = user_project(tmp_path / "project", """
        def test_uses_the_journal_fixture(airlock_journal):
            pass


        def test_uses_the_effect_log(airlock_effects):
            pass


        def test_uses_nothing_of_airlock():
            pass
    """)
    own = project / "journal.py"
    own.write_text("WHOSE = 'the user project'\n")
    proc = run_pytest(project)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "1 passed, 2 errors" in proc.stdout  # the two tests that ask for a fixture cannot be set up
    # Once for each of the two tests' errors (and again in the summary, which pytest does not cut
    # short where the environment variable CI is set).
    said = proc.stdout.count(f"airlock's fixtures need its package 'journal', but in this test run that import "
                             f"name is {own}")
    assert said in (2, 4), proc.stdout
    assert "test_uses_the_journal_fixture" in proc.stdout and "test_uses_the_effect_log" in proc.stdout
    assert "Traceback" not in proc.stdout


# -- types ---------------------------------------------------------------------------------------


def test_the_packages_and_the_plugin_type_check_under_mypy_strict() -> None:
    # The distribution ships py.typed: its users' type checkers read these annotations. The packages
    # and modules checked are pyproject.toml's [tool.mypy] ones: guard, journal, cli and the plugin.
    proc = subprocess.run([sys.executable, "-m", "mypy"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Success: no issues found")
