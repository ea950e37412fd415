"""What the PostgreSQL store's own tests share: a cluster of a module's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pgserver import PgServer, own_cluster


@pytest.fixture(scope="module")
def own_server() -> Iterator[PgServer]:
    """A cluster of the module's own: its tests may stop, freeze or limit it."""
    srv = own_cluster()
    try:
        yield srv
    finally:
        srv.destroy()
