"""The SQLite journal's schema, at the path it had before the stores became packages:
the same module as :mod:`journal.sqlite.schema`."""

import sys

from .sqlite import schema

sys.modules[__name__] = schema
