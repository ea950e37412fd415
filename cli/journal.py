"""``airlock journal ...``: inspect calls, settle the ones in doubt, export and verify the audit trail.

The group only: each command lives in the module named for what it does and is registered here,
but for ``copy``, which cli.main registers.
"""

from __future__ import annotations

import click

from . import approvals, archive, audit, reconcile
from .console import serve
from .options import Group, default_operator
from .resolve import resolve
from .show import show
from .stats import stats
from .trail import export, rebuild, verify

__all__ = ["default_operator", "journal"]


@click.group(cls=Group)
def journal() -> None:
    """Inspect and settle the calls in an effect journal, and export or verify its audit trail.

    The journal is --db, else $AIRLOCK_JOURNAL, else ./airlock-journal.db; a postgresql:// URL
    names a PostgreSQL journal. Commands that only read never create or change it.

    Example:

    \b
        airlock journal show --status unknown
    """


journal.add_command(show)
journal.add_command(resolve)
journal.add_command(export)
journal.add_command(verify)
journal.add_command(rebuild)
journal.add_command(stats)
journal.add_command(audit.keygen)
journal.add_command(reconcile.reconcile)
journal.add_command(audit.checkpoint)
journal.add_command(archive.archive)
journal.add_command(approvals.approvals)
journal.add_command(approvals.approve)
journal.add_command(approvals.deny)
journal.add_command(serve)
