"""The store's sqlite metadata: ``Db``, its connections and transactions.

The statements are ``Tx`` (``store.db_tx``), the one repository that owns every SQL
statement; the tables, their version and migrations are ``store.db_schema``.
``Db.read()`` and ``Db.write()`` hand out a ``Tx``; nothing else in preheat writes SQL
against ``store.db``.

Every call opens its own connection (WAL mode, 30 s busy timeout), so one ``NodeStore``
can be used from several threads and several processes can share one store. Writes that
must decide on a consistent view (reserving space, evicting) run in ``BEGIN IMMEDIATE``.
These calls block (up to the busy timeout): async callers run them in a thread.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

from preheat.errors import CacheError
from preheat.store.db_schema import VERSION, create, migrate_from_0
from preheat.store.db_tx import Tx

__all__ = ["Db"]


class Db:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Switching to WAL needs a moment alone with the file; two processes opening a new
        # store at once may see SQLITE_BUSY here even with a busy timeout, so retry.
        for attempt in range(50):
            try:
                with self.connect() as con:
                    if con.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                        con.execute("PRAGMA journal_mode=WAL")
                    self._upgrade(con)
                return
            except sqlite3.OperationalError as exc:
                if ("locked" not in str(exc) and "busy" not in str(exc)) or attempt == 49:
                    raise
                time.sleep(0.02 * (attempt + 1))

    def _upgrade(self, con: sqlite3.Connection) -> None:
        """Create the schema, or migrate an older one in place (one transaction)."""
        if con.execute("PRAGMA user_version").fetchone()[0] == VERSION:
            return
        con.execute("BEGIN IMMEDIATE")
        try:
            version = int(con.execute("PRAGMA user_version").fetchone()[0])
            if version > VERSION:
                raise CacheError(
                    f"{self.path} has schema version {version}, newer than this preheat "
                    f"understands ({VERSION}); upgrade preheat, or use another --store"
                )
            tables = {
                str(r[0]) for r in con.execute("SELECT name FROM sqlite_master WHERE type='table'")
            }
            if version < 2 and tables:
                migrate_from_0(con, tables)
            # 2 -> 3 only adds tables: create below makes them
            create(con)
            con.execute(f"PRAGMA user_version={VERSION}")
        except BaseException:
            con.execute("ROLLBACK")
            raise
        con.execute("COMMIT")

    @contextlib.contextmanager
    def connect(self) -> Iterator[sqlite3.Connection]:
        """An autocommit connection, closed on exit."""
        con = sqlite3.connect(self.path, timeout=30, isolation_level=None)
        try:
            con.execute("PRAGMA synchronous=NORMAL")
            con.execute("PRAGMA foreign_keys=OFF")
            yield con
        finally:
            con.close()

    @contextlib.contextmanager
    def read(self) -> Iterator[Tx]:
        """Statements on an autocommit connection (each one sees the latest commit)."""
        with self.connect() as con:
            yield Tx(con)

    @contextlib.contextmanager
    def write(self) -> Iterator[Tx]:
        """A ``BEGIN IMMEDIATE`` transaction: one writer at a time across processes."""
        with self.connect() as con:
            con.execute("BEGIN IMMEDIATE")
            try:
                yield Tx(con)
            except BaseException:
                con.execute("ROLLBACK")
                raise
            con.execute("COMMIT")
