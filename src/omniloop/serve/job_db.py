"""``JobDatabase``: the SQLite file behind ``omniloop serve --job-store PATH`` (standard
library ``sqlite3``), one row per job: its record, the ``OmniRequest`` it ran (so a restart
can re-queue it) and, once it is over, its event history and the paths of its output files.

Rows are written at the job's status changes, not at every step. The store is opened
before the model loads: a path that is a directory, an unreadable or corrupt file, or a
SQLite file of something else is a ``JobStoreError`` (a ValueError) naming the path.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

APP = "omniloop-jobs"
SCHEMA_VERSION = 2
COLUMNS = ("id", "kind", "model", "prompt", "geometry", "created_at", "status", "progress", "completed_at", "error",
           "metrics", "request", "events", "outputs", "restarts", "resumed_from")
_JSON = {"geometry", "metrics", "events", "outputs"}
_INTEGER = {"created_at", "progress", "completed_at", "restarts", "resumed_from"}
# version 2 added: restarts (times the job ran again after the server died), resumed_from (the
# step its loop resumed from); a version 1 store gains them on open
_ADDED_IN_2 = ("restarts", "resumed_from")
_SCHEMA = f"""
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT NOT NULL UNIQUE,
                   {", ".join(f"{c} {'INTEGER' if c in _INTEGER else 'TEXT'}" for c in COLUMNS[1:])});
INSERT INTO meta VALUES ('app', '{APP}'), ('schema_version', '{SCHEMA_VERSION}');
"""


class JobStoreError(ValueError):
    """The job store cannot be used; the message names the path and what to do."""


class JobDatabase:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser()
        self._db = self._open()

    def _fail(self, why: str) -> JobStoreError:
        return JobStoreError(f"job store {self.path}: {why}; move it away or pass another --job-store path")

    def _open(self) -> sqlite3.Connection:
        if self.path.is_dir():
            raise self._fail("is a directory, not a SQLite file")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._fail(f"its directory cannot be created ({e.strerror})") from None
        try:
            # autocommit (one statement, one transaction); opened before the event loop starts,
            # then used by the loop's thread alone, one call at a time
            db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            check = db.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise self._fail(f"the SQLite file is corrupt ({check})")
            tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            if not tables:
                db.executescript(_SCHEMA)
            else:
                self._check_schema(db, tables)
            db.execute("PRAGMA journal_mode=WAL")  # a SIGKILL mid-write loses at most that write
        except sqlite3.DatabaseError as e:  # "file is not a database", "database disk image is malformed"
            raise self._fail(f"not a readable SQLite database ({e})") from None
        except OSError as e:
            raise self._fail(f"cannot be opened ({e.strerror})") from None
        return db

    def _check_schema(self, db: sqlite3.Connection, tables: set[str]) -> None:
        meta = dict(db.execute("SELECT key, value FROM meta")) if "meta" in tables else {}
        if meta.get("app") != APP or "jobs" not in tables:
            raise self._fail(f"is a SQLite database, but not an omniloop job store (tables {sorted(tables)})")
        if meta.get("schema_version") == "1":  # one transaction: a crash leaves version 1 or 2, whole
            db.execute("BEGIN")
            for column in _ADDED_IN_2:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {column} INTEGER")
            db.execute("UPDATE meta SET value = ? WHERE key = 'schema_version'", (str(SCHEMA_VERSION),))
            db.execute("COMMIT")
            return
        if meta.get("schema_version") != str(SCHEMA_VERSION):
            raise self._fail(f"has job-store schema version {meta.get('schema_version')}; this omniloop reads "
                             f"version {SCHEMA_VERSION}")

    # -- rows -------------------------------------------------------------------------------
    def insert(self, record: dict[str, Any]) -> None:
        values = [self._encode(c, record.get(c)) for c in COLUMNS]
        self._db.execute(f"INSERT INTO jobs ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})", values)

    def update(self, job_id: str, fields: dict[str, Any]) -> None:
        names = [c for c in COLUMNS[1:] if c in fields]
        values = [self._encode(c, fields[c]) for c in names]
        self._db.execute(f"UPDATE jobs SET {', '.join(f'{c} = ?' for c in names)} WHERE id = ?", [*values, job_id])

    def delete(self, job_id: str) -> None:
        self._db.execute("DELETE FROM jobs WHERE id = ?", (job_id,))

    def rows(self) -> list[dict[str, Any]]:
        """Every job, oldest first."""
        cursor = self._db.execute(f"SELECT {', '.join(COLUMNS)} FROM jobs ORDER BY seq")
        return [{c: self._decode(c, v) for c, v in zip(COLUMNS, row)} for row in cursor]

    def close(self) -> None:
        self._db.close()

    @staticmethod
    def _encode(column: str, value: Any) -> Any:
        return json.dumps(value) if column in _JSON and value is not None else value

    @staticmethod
    def _decode(column: str, value: Any) -> Any:
        return json.loads(value) if column in _JSON and value is not None else value
