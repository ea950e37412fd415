"""Opening a PostgreSQL journal: the database's encoding, the schema the session reaches, and what
it holds; and taking away again a journal whose log is empty."""

from __future__ import annotations

from typing import NamedTuple

from psycopg import errors as pg_errors

from ..errors import JournalError, JournalNotFound, NewerSchema, NotAJournal
from . import schema as pg_schema
from .datastore import Conn, PostgresDatastore, log
from .sealing import hold_log

__all__ = ["Opened", "Opener"]

# The server encodings that store the UTF-8 the journal sends unchanged.
_SERVER_ENCODINGS = frozenset({"UTF8", "SQL_ASCII"})


class Opened(NamedTuple):
    """What opening found: the journal's schema, and the seq of the log's head then."""

    schema: str
    head_seq: int


class Opener:
    """What a schema holds, checked before anything is written; the journal made or migrated when allowed."""

    def __init__(self, datastore: PostgresDatastore) -> None:
        self._datastore = datastore
        self.name = datastore.name
        self.schema = ""

    def open(self, *, create: bool) -> Opened:
        """Check the database and the schema the login reaches, make or migrate the journal there
        where ``create`` allows, and learn where the log's head is and whether sessions may make
        the server-side append (on a connection of its own: the pool is made for the schema found)."""
        with self._datastore.session("open the journal") as conn:
            self._check_encoding(conn)
            self.schema = self._schema(conn)
            self._open_schema(conn, create=create)
            head = int((conn.execute("SELECT seq FROM chain_head WHERE id = 1").fetchone() or (0,))[0])
            may_make_temporary = conn.execute(
                "SELECT has_database_privilege(current_database(), 'TEMPORARY')").fetchone()
            if may_make_temporary != (True,):
                self._datastore.no_server_append("the login may not make temporary objects in the database")
            return Opened(self.schema, head)

    def remove_if_empty(self) -> bool:
        """Drop the journal's tables and functions, when its log holds no event (the log locked
        meanwhile, so no append comes between); returns whether it did."""

        def work(conn: Conn) -> bool:
            hold_log(conn)  # an event still in the inbox is sealed into the log, which is then not empty
            conn.execute(b"LOCK TABLE events IN ACCESS EXCLUSIVE MODE")
            if conn.execute(b"SELECT EXISTS (SELECT 1 FROM events)").fetchone() != (False,):
                return False  # someone began to use it meanwhile: left as it is
            for statement in pg_schema.REMOVE:
                conn.execute(statement.encode())
            return True

        return self._datastore.write("remove the journal", work, pipeline=False, retry=False)

    def _check_encoding(self, conn: Conn) -> None:
        """Refuse, before anything is written, a database that cannot hold every UTF-8 text."""
        database, encoding = conn.execute(
            "SELECT current_database(), current_setting('server_encoding')").fetchone() or ("", "")
        # SQL_ASCII converts nothing: the UTF-8 bytes the journal sends are stored as they are.
        # Any other encoding refuses the texts it has no character for ("€" in LATIN1).
        if encoding not in _SERVER_ENCODINGS:
            raise JournalError(
                f"cannot open the journal {self.name}: its database {database} has the encoding {encoding}, "
                "which cannot hold every text of a journal; use a UTF8 database "
                "(CREATE DATABASE ... ENCODING 'UTF8' TEMPLATE template0)"
            )

    def _open_schema(self, conn: Conn, *, create: bool) -> None:
        """Check what the schema holds; make or migrate the journal's tables when allowed.

        Changes nothing in a schema that holds anything but a journal of this version or older.
        """
        version = self._inspect(conn)
        if version == pg_schema.SCHEMA_VERSION:
            return
        if not create:
            if version == 0:
                raise JournalNotFound(f"the journal {self.name} does not exist: the database holds no journal")
            raise JournalError(
                f"the journal {self.name} has schema version {version}; open it writable once "
                f"to migrate it to version {pg_schema.SCHEMA_VERSION}"
            )
        with conn.transaction():
            # Replicas that start together migrate one at a time; the others then find it done.
            conn.execute("SELECT pg_advisory_xact_lock(hashtext('airlock-journal:' || current_schema()))")
            version = self._inspect(conn)
            for target in range(version + 1, pg_schema.SCHEMA_VERSION + 1):
                for statement in pg_schema.MIGRATIONS[target]:
                    conn.execute(statement.encode())
                if target == 1:
                    conn.execute(
                        "INSERT INTO airlock_journal_meta (id, application, schema_version) VALUES (1, %s, %s)",
                        (pg_schema.APPLICATION, target),
                    )
                else:
                    conn.execute("UPDATE airlock_journal_meta SET schema_version = %s", (target,))
            if version < pg_schema.SCHEMA_VERSION:
                log.info("journal %s migrated from schema version %d to %d", self.name, version,
                         pg_schema.SCHEMA_VERSION)

    def _schema(self, conn: Conn) -> str:
        """The journal's schema: the first of the search_path (after a leading ``$user`` that names no
        schema), which must be the one the session's statements reach; raises if it is not.

        PostgreSQL's current_schema() skips a schema that does not exist or that the login may not
        use: replicas whose logins differ there would each write a journal of their own.
        """
        setting, current, login = conn.execute(
            "SELECT current_setting('search_path'), current_schema(), current_user").fetchone() or ("", None, "")
        names = pg_schema.search_path_schemas(setting)
        if names[:1] == [pg_schema.USER_SCHEMA]:
            exists = conn.execute("SELECT EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)", (login,))
            names[0:1] = [login] if exists.fetchone() == (True,) else []
        if not names:
            raise JournalNotFound(f"the journal {self.name} does not exist: its search_path names no schema")
        schema = names[0]
        if current == schema:
            return schema
        exists, usable = conn.execute(
            "SELECT n.oid IS NOT NULL, coalesce(has_schema_privilege(n.oid, 'USAGE'), false) "
            "FROM (SELECT 1) AS one LEFT JOIN pg_namespace n ON n.nspname = %s", (schema,)).fetchone() or (False, False)
        if not exists:
            raise JournalNotFound(f"the journal {self.name} does not exist: the schema {schema}, the first of its "
                                  "search_path, does not exist; create it first (CREATE SCHEMA)")
        if not usable:
            raise JournalError(f"cannot open the journal {self.name}: the login {login} lacks USAGE on the schema "
                               f"{schema}, the first of its search_path; grant it (GRANT USAGE ON SCHEMA)")
        raise JournalError(f"cannot open the journal {self.name}: its statements reach the schema {current}, "
                           f"not {schema}, the first of its search_path")

    def _inspect(self, conn: Conn) -> int:
        """The journal's schema version (0: an empty schema); raises for anything else."""
        schema = self.schema
        relations = [
            r[0] for r in conn.execute(
                "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
                "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f') ORDER BY c.relname", (schema,)
            ).fetchall()
        ]
        if not relations:
            return 0
        if "airlock_journal_meta" not in relations:
            shown = ", ".join(relations[:5]) + (", ..." if len(relations) > 5 else "")
            raise NotAJournal(
                f"{self.name} is not an airlock journal: schema {schema} holds other tables ({shown}); "
                "it was left unchanged (use an empty database, or another schema via search_path)"
            )
        unlike = (f"{self.name} is not an airlock journal: its table airlock_journal_meta is not a journal's "
                  "meta table; it was left unchanged")
        try:
            row = conn.execute("SELECT application, schema_version FROM airlock_journal_meta WHERE id = 1").fetchone()
        except (pg_errors.UndefinedColumn, pg_errors.DatatypeMismatch, pg_errors.UndefinedFunction) as e:
            raise NotAJournal(unlike) from e  # other columns: another application's table of that name
        if row is None or row[0] != pg_schema.APPLICATION:
            raise NotAJournal(f"{self.name} is not an airlock journal: its meta table names "
                              f"{row[0] if row else 'no application'!r}; it was left unchanged")
        try:
            version = int(row[1])
        except (ValueError, TypeError) as e:
            raise NotAJournal(unlike) from e
        if version > pg_schema.SCHEMA_VERSION:
            raise NewerSchema(
                f"the journal {self.name} has schema version {version}, newer than this library's "
                f"{pg_schema.SCHEMA_VERSION}; upgrade airlock-journal to open it (it was left unchanged)"
            )
        missing = [t for t in pg_schema.tables_of(version) if t not in relations]
        if missing:
            raise NotAJournal(f"{self.name} is a damaged journal: it lacks the tables {', '.join(missing)}; "
                              "it was left unchanged")
        return version
