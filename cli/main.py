"""The ``airlock`` command: ``airlock journal ...`` for operators, ``airlock demo`` to see it work."""

from __future__ import annotations

import logging

import click

from .copy import copy
from .demo import demo
from .journal import journal
from .options import Group

# A pool that replaces a connection the server dropped logs a warning; a command retries and
# reports what matters itself, on one line, so the driver's log lines are not printed.
logging.getLogger("psycopg").addHandler(logging.NullHandler())


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="airlock-journal", prog_name="airlock")
def main() -> None:
    """At-most-once dispatch for an agent's tools: inspect and settle its effect journal.

    Example:

    \b
        airlock demo

    \b
        airlock journal show --status unknown --db airlock-demo.db
    """


journal.add_command(copy)
main.add_command(journal)
main.add_command(demo)

# sqlite-utils style name for the same group
cli = main

__all__ = ["cli", "main"]
