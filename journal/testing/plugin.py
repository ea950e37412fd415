"""The pytest fixtures of ``journal.testing``, defined in the plugin module ``pytest_airlock_journal``.

The plugin (entry point ``pytest11``) is that top-level module rather than this one, so that loading it
imports nothing of ``journal`` until a fixture is used; they are re-exported here for a ``conftest.py``
that imports them by hand.
"""

from pytest_airlock_journal import airlock_effects, airlock_journal, airlock_journal_path

__all__ = ["airlock_effects", "airlock_journal", "airlock_journal_path"]
