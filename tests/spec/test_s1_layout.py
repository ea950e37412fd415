"""Section 1 of the behaviour contract, layout and dependencies: the import direction and the distribution.

Written against the behaviour contract alone: public names only, and only what the contract states."""

from __future__ import annotations

import re
import subprocess

from guard.effect_guard import (
    EffectStore,
)
from tests.spec.support import (
    PYTHON,
)

# --------------------------------------------------------------------------------------------------------------
# 1. layout and import direction


def test_guard_imports_neither_journal_nor_cli_nor_any_sdk() -> None:
    code = (
        "import sys, guard, guard.effect_guard\n"
        "bad = [m for m in ('journal', 'cli', 'openai', 'anthropic', 'mcp', 'psycopg') if m in sys.modules]\n"
        "print(bad)\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_journal_does_not_import_cli() -> None:
    code = "import sys, journal\nprint('cli' in sys.modules, any(m.startswith('cli.') for m in sys.modules))\n"
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False False"


def test_effect_store_is_a_protocol() -> None:
    assert getattr(EffectStore, "_is_protocol", False) is True


def test_distribution_metadata() -> None:
    from importlib import metadata

    dist = metadata.distribution("airlock-journal")
    assert dist.metadata["Requires-Python"].replace(" ", "") == ">=3.11"
    requires = dist.requires or []
    base = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requires if "extra ==" not in r}
    assert base == {"orjson", "click", "sqlite-utils"}
    pg = [r for r in requires if r.lower().startswith("psycopg") and "extra ==" in r]
    assert any('extra == "postgres"' in r for r in pg)
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts == {"airlock": "cli.main:main"}


def test_adapters_import_neither_journal_nor_cli() -> None:
    code = (
        "import sys, guard.adapters.openai, guard.adapters.anthropic, guard.adapters.mcp\n"
        "print([m for m in sys.modules if m.split('.')[0] in ('journal', 'cli')])\n"
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
