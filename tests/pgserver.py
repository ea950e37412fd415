"""A throwaway PostgreSQL cluster for the tests: a real server, started once per test session.

``server()`` starts (once) a cluster in a temp dir, owned by a non-root user when the tests run
as root (PostgreSQL refuses to run as root), listening on 127.0.0.1 and a unix socket inside
the temp dir, on a free port; it is stopped and deleted when the session ends. Set
``AIRLOCK_TEST_PG_DSN`` to a DSN of an existing server (a role that may CREATE DATABASE) to use
that instead; such a server is never stopped or restarted by the tests.

Without PostgreSQL binaries the tests that need them skip with the reason, except under CI
(the environment variable ``CI`` set), where a missing server is a failure.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import itertools
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import pytest

__all__ = ["PgServer", "PgUnavailable", "fresh_database", "fresh_schema", "require_server", "server"]

_SERVER_USER = "postgres"
# How long pg_ctl waits for a start or a stop. A start after a crash (stop -m immediate) first
# fsyncs every file of the data directory, which grows by a database per test: some 300 files, and
# all that CREATE DATABASE wrote and the kernel has not yet flushed. On a loaded machine late in a test
# run that took over a minute. The process running pg_ctl gets longer still, so that pg_ctl's
# own error, with the server's log, is what a failure shows.
_PG_CTL_WAIT = 600
_ENV_DSN = "AIRLOCK_TEST_PG_DSN"


class PgUnavailable(RuntimeError):
    """No PostgreSQL server can be had for the tests."""


def _find_bindir() -> Path:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    candidates = sorted(
        glob.glob("/usr/lib/postgresql/*/bin/initdb"),
        key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0,
    )
    if candidates:
        return Path(candidates[-1]).parent
    raise PgUnavailable("no initdb on PATH or in /usr/lib/postgresql/*/bin (apt-get install postgresql)")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run_as() -> pwd.struct_passwd | None:
    """The user the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(_SERVER_USER)
    except KeyError:
        # Debian's postgresql package creates this user; a bare machine gets a system user.
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", _SERVER_USER],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(_SERVER_USER)


@dataclass
class PgServer:
    """One running cluster (or an external server when ``managed`` is false)."""

    dsn: str  # the maintenance database ("postgres") as a superuser
    managed: bool
    bindir: Path | None = None
    root: Path | None = None
    port: int = 0
    user: pwd.struct_passwd | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def datadir(self) -> Path:
        assert self.root is not None
        return self.root / "data"

    @property
    def logfile(self) -> Path:
        assert self.root is not None
        return self.root / "server.log"

    def _cmd(self, *args: str, check: bool = True, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        assert self.bindir is not None
        kwargs: dict[str, object] = {}
        if self.user is not None:
            kwargs = {"user": self.user.pw_uid, "group": self.user.pw_gid, "extra_groups": []}
        return subprocess.run(
            [str(self.bindir / args[0]), *args[1:]],
            check=check,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=str(self.root),
            **kwargs,  # type: ignore[arg-type]
        )

    def start(self) -> None:
        """Start the server (on its port) and wait until it accepts connections."""
        if not self.managed:
            raise PgUnavailable(f"an external server ({_ENV_DSN}) is not started by the tests")
        opts = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1"
            " -c max_connections=200 -c shared_buffers=32MB"
        )
        try:
            self._cmd("pg_ctl", "-D", str(self.datadir), "-l", str(self.logfile), "-o", opts, "-w", "-t",
                      str(_PG_CTL_WAIT), "start", timeout=_PG_CTL_WAIT + 60)
        except subprocess.CalledProcessError as e:
            raise PgUnavailable(f"pg_ctl start failed: {e.stderr.strip()} {self._log_tail()}") from e

    def stop(self, mode: str = "fast") -> None:
        """Stop the server: ``fast`` (disconnect clients, clean shutdown) or ``immediate`` (a crash)."""
        if not self.managed:
            raise PgUnavailable(f"an external server ({_ENV_DSN}) is not stopped by the tests")
        self._cmd("pg_ctl", "-D", str(self.datadir), "-m", mode, "-w", "-t", str(_PG_CTL_WAIT), "stop", check=False,
                  timeout=_PG_CTL_WAIT + 60)

    def restart(self, mode: str = "fast", down_for: float = 0.0) -> None:
        """Stop the server, stay down ``down_for`` seconds, start it again on the same port."""
        self.stop(mode)
        time.sleep(down_for)
        self.start()

    def running(self) -> bool:
        if not self.managed:
            return True
        return self._cmd("pg_ctl", "-D", str(self.datadir), "status", check=False, timeout=600).returncode == 0

    def _log_tail(self) -> str:
        try:
            return self.logfile.read_text()[-2000:]
        except OSError:
            return ""

    def dsn_for(self, dbname: str, **params: str) -> str:
        parts = urlsplit(self.dsn)
        query = "&".join(f"{k}={quote(v)}" for k, v in params.items())
        return urlunsplit((parts.scheme, parts.netloc, "/" + dbname, query, ""))

    def destroy(self) -> None:
        if not self.managed or self.root is None or not self.root.exists():
            return
        self.stop("immediate")
        shutil.rmtree(self.root, ignore_errors=True)


def _start_managed() -> PgServer:
    bindir = _find_bindir()
    user = _run_as()
    # The server's user must reach its data dir: under /tmp, whatever TMPDIR says (it may be private).
    root = Path(tempfile.mkdtemp(prefix="airlock-pg-", dir="/tmp" if user is not None else None))
    if user is not None:
        os.chown(root, user.pw_uid, user.pw_gid)
    root.chmod(0o700)
    srv = PgServer(dsn="", managed=True, bindir=bindir, root=root, user=user)
    try:
        srv._cmd("initdb", "-D", str(srv.datadir), "-A", "trust", "-U", "postgres", "-E", "UTF8",
                 "--locale=C", "--no-sync", timeout=600)
    except subprocess.CalledProcessError as e:
        shutil.rmtree(root, ignore_errors=True)
        raise PgUnavailable(f"initdb failed: {e.stderr.strip()}") from e
    last: Exception | None = None
    for _ in range(5):  # a free port can be taken between the probe and the bind
        srv.port = _free_port()
        try:
            srv.start()
            break
        except PgUnavailable as e:
            last = e
    else:
        shutil.rmtree(root, ignore_errors=True)
        raise PgUnavailable(str(last))
    srv.dsn = f"postgresql://postgres@127.0.0.1:{srv.port}/postgres"
    return srv


_server: PgServer | None = None
_failure: str | None = None
_server_lock = threading.Lock()


def server() -> PgServer:
    """The session's server, started on first use. Raises :class:`PgUnavailable`."""
    global _server, _failure
    with _server_lock:
        if _server is not None:
            return _server
        if _failure is not None:
            raise PgUnavailable(_failure)
        external = os.environ.get(_ENV_DSN)
        try:
            if external:
                _server = PgServer(dsn=external, managed=False)
            else:
                _server = _start_managed()
                atexit.register(_server.destroy)
        except (PgUnavailable, OSError, subprocess.SubprocessError) as e:
            _failure = str(e)
            raise PgUnavailable(_failure) from e
        return _server


def require_server() -> PgServer:
    """The server, or skip the test (fail it under CI) when there is none."""
    try:
        return server()
    except PgUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required under CI: {e}", pytrace=False)
        pytest.skip(f"no PostgreSQL server: {e}")


def shutdown() -> None:
    """Stop and delete the session's cluster (called at the end of the session)."""
    global _server
    with _server_lock:
        if _server is not None:
            _server.destroy()
            _server = None


_names = itertools.count()


def _admin(srv: PgServer, sql: str) -> None:
    import psycopg

    with psycopg.connect(srv.dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql)  # type: ignore[arg-type]


def fresh_database(srv: PgServer | None = None) -> str:
    """The DSN of a new, empty database on the server."""
    srv = srv or require_server()
    name = f"airlock_t{os.getpid()}_{next(_names)}"
    _admin(srv, f'CREATE DATABASE "{name}"')
    return srv.dsn_for(name)


_schema_db: str | None = None


def fresh_schema(srv: PgServer | None = None) -> str:
    """The DSN of a new, empty schema (the connection's search_path) in one shared test database.

    Much cheaper than a database; the contract suite and the state machine make one per store.
    """
    global _schema_db
    import psycopg

    srv = srv or require_server()
    with _server_lock:
        if _schema_db is None:
            _schema_db = f"airlock_schemas{os.getpid()}"
            _admin(srv, f'CREATE DATABASE "{_schema_db}"')
    name = f"s{next(_names)}"
    dsn = srv.dsn_for(_schema_db)
    with psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(f'CREATE SCHEMA "{name}"')  # type: ignore[arg-type]
    return srv.dsn_for(_schema_db, options=f"-csearch_path={name}")


@contextlib.contextmanager
def server_down(srv: PgServer, mode: str = "fast") -> Iterator[None]:
    """Stop the server for the ``with`` block; it is started again on the way out, whatever happens."""
    srv.stop(mode)
    try:
        yield
    finally:
        srv.start()


def own_cluster() -> PgServer:
    """A cluster of the calling test's own, which it may stop, freeze or limit (the session's never
    is); skipped without PostgreSQL, a failure under CI. The caller destroys it."""
    try:
        return _start_managed()
    except PgUnavailable as e:
        if os.environ.get("CI"):
            pytest.fail(f"PostgreSQL is required under CI: {e}", pytrace=False)
        pytest.skip(f"no PostgreSQL server: {e}")


def server_pids(srv: PgServer) -> list[int]:
    """The postmaster, then every process it started (its backends and workers)."""
    postmaster = int((srv.datadir / "postmaster.pid").read_text().split()[0])
    children = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{entry}/stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == postmaster:
                    children.append(int(entry))
    return [postmaster, *children]


@contextlib.contextmanager
def frozen(srv: PgServer) -> Iterator[None]:
    """The whole server stopped by SIGSTOP for the ``with`` block, resumed by SIGCONT whatever happens."""
    pids = server_pids(srv)
    assert len(pids) > 3, pids
    try:
        os.kill(pids[0], signal.SIGSTOP)  # the postmaster first: no process starts after it stops
        pids = server_pids(srv)  # listed again: a backend listed before may have ended since
        for pid in pids[1:]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        yield
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PgServer]:
    """The session's PostgreSQL server (skipped without one; a failure under CI)."""
    yield require_server()


@pytest.fixture(scope="session", autouse=True)
def _pg_shutdown() -> Iterator[None]:
    """Stop the session's cluster, if one was started, when the session ends."""
    yield
    shutdown()


@pytest.fixture
def pg_dsn(pg_server: PgServer) -> str:
    """The DSN of a fresh, empty database for one test."""
    return fresh_database(pg_server)


def make_old_journal(dsn: str, version: int, events: list[Any]) -> None:
    """In the (empty) schema of ``dsn``: a journal as version ``version`` of the library made it,
    holding the stored ``events`` (a real log, in ``seq`` order) and their projection."""
    import psycopg

    from journal.postgres import schema as pg_schema
    from journal.projection import fold
    from journal.rows import CALL_COLUMNS, EVENT_COLUMNS, call_row, event_row

    with psycopg.connect(dsn) as conn:
        for step in range(1, version + 1):
            for statement in pg_schema.MIGRATIONS[step]:
                conn.execute(statement.encode())
        conn.execute(b"INSERT INTO airlock_journal_meta (id, application, schema_version) VALUES (1, %s, %s)",
                     (pg_schema.APPLICATION, version))
        with conn.cursor() as cur:
            cur.executemany(f"INSERT INTO events ({', '.join(EVENT_COLUMNS)}) "
                            f"VALUES ({', '.join(['%s'] * len(EVENT_COLUMNS))})".encode(),
                            [event_row(e) for e in events])
            cur.executemany(f"INSERT INTO calls ({', '.join(CALL_COLUMNS)}) "
                            f"VALUES ({', '.join(['%s'] * len(CALL_COLUMNS))})".encode(),
                            [call_row(r) for r in fold(events).values()])
        if events:
            conn.execute(b"UPDATE chain_head SET seq = %s, hash = %s WHERE id = 1",
                         (events[-1].seq, events[-1].hash))
