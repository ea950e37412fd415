"""The PostgreSQL journal's schema, at the path it had before the stores became packages:
the same module as :mod:`journal.postgres.schema`."""

import sys

from .postgres import schema

sys.modules[__name__] = schema
