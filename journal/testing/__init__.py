"""A test kit for code guarded by airlock: journals, effect counts, lost responses, kill points, faults.

Its fixtures are also a pytest plugin (entry point ``airlock_journal``, the module
``pytest_airlock_journal``), so they are there in every test; loading the plugin imports nothing of
this package until a fixture is used.
"""

from .effects import EffectLog, lost_response
from .faults import database_full, read_only, write_lock_held
from .killpoints import KILL_POINTS, KillPoints, die, remove_postgres_kill_point
from .plugin import airlock_effects, airlock_journal, airlock_journal_path
from .strategies import OUTCOMES, TOOLS, CallStep, PlayReport, call_ids, call_sequences, json_values, play

__all__ = [
    "KILL_POINTS",
    "OUTCOMES",
    "TOOLS",
    "CallStep",
    "EffectLog",
    "KillPoints",
    "PlayReport",
    "airlock_effects",
    "airlock_journal",
    "airlock_journal_path",
    "call_ids",
    "call_sequences",
    "database_full",
    "die",
    "json_values",
    "lost_response",
    "play",
    "read_only",
    "remove_postgres_kill_point",
    "write_lock_held",
]
