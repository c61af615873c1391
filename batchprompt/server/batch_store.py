"""The Batch API's records: files and batches, in SQLite (WAL, synchronous=FULL) under
--data-dir, so that they outlive the process. Contents of files live beside it, on disk
(data_dir.py); a batch's finished rows live in its journal (batch_jobs.py).

A file is a row of columns; a batch is its OpenAI object as JSON, with its status in a column
of its own (the batches to resume are found by it). Lists go newest first by a sequence number,
so that `after` is a stable cursor even for records made in the same second."""
from __future__ import annotations

import json
import sqlite3
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ..jobs.ids import is_text
from ..jobs.storage import StorageError

FILE_COLUMNS = ("id", "filename", "purpose", "bytes", "created_at", "status", "batch_id", "kind", "expires_at")
#: Batches whose work is not over: resumed when the server starts.
UNFINISHED = ("validating", "in_progress", "finalizing", "cancelling")
#: Batches whose outputs are written and will not change.
FINAL = ("completed", "failed", "expired", "cancelled")


class UnknownCursor(KeyError):
    """`after` names no record of the list."""


class Store:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()  # one connection, used from the event loop and threads
        try:
            self.db = sqlite3.connect(str(self.path), isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("CREATE TABLE IF NOT EXISTS files (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                            "id TEXT UNIQUE NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL, "
                            "bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, status TEXT NOT NULL, "
                            "batch_id TEXT, kind TEXT)")
            # A deleted file's place in the list, so that a page after it still reads: the openai
            # client's loop that deletes what it lists (`for f in files.list(): files.delete(f.id)`)
            # asks for the page after the file it just deleted, and got a 400.
            self.db.execute("CREATE TABLE IF NOT EXISTS deleted_files (id TEXT PRIMARY KEY, seq INTEGER NOT NULL)")
            self.db.execute("CREATE TABLE IF NOT EXISTS batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, "
                            "id TEXT UNIQUE NOT NULL, status TEXT NOT NULL, input_file_id TEXT NOT NULL, "
                            "data TEXT NOT NULL)")
            # Columns added since the first release: a --data-dir made before gets them, null.
            for table, column, kind in (("files", "expires_at", "INTEGER"), ("batches", "output_expires_s", "INTEGER"),
                                        ("batches", "model_key", "TEXT")):
                if column not in {r[1] for r in self.db.execute(f"PRAGMA table_info({table})")}:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
        except sqlite3.Error as e:
            raise _server_storage_error(self.path, e) from None

    @contextmanager
    def _tx(self, write: bool = False) -> Iterator[sqlite3.Connection]:
        with self._lock:
            try:
                if write:
                    self.db.execute("BEGIN IMMEDIATE")
                yield self.db
                if write:
                    self.db.execute("COMMIT")
            except BaseException as e:
                if self.db.in_transaction:
                    self.db.execute("ROLLBACK")
                if isinstance(e, sqlite3.Error):
                    raise _server_storage_error(self.path, e) from None
                raise

    # ---- files ------------------------------------------------------------------------------
    def add_file(self, record: dict[str, Any]) -> None:
        with self._tx(write=True) as db:
            db.execute(f"INSERT INTO files ({', '.join(FILE_COLUMNS)}) VALUES ({', '.join('?' * len(FILE_COLUMNS))})",
                       [record.get(c) for c in FILE_COLUMNS])

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        if not is_text(file_id):  # a lone surrogate from a JSON body, which SQLite cannot take: no such file
            return None
        with self._tx() as db:
            row = db.execute(f"SELECT {', '.join(FILE_COLUMNS)} FROM files WHERE id = ?", (file_id,)).fetchone()
        return dict(zip(FILE_COLUMNS, row)) if row else None

    def update_file(self, file_id: str, **changes: Any) -> None:
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self._tx(write=True) as db:
            db.execute(f"UPDATE files SET {sets} WHERE id = ?", [*changes.values(), file_id])

    def delete_file(self, file_id: str) -> bool:
        with self._tx(write=True) as db:
            return _delete_file(db, file_id)

    def file_ids(self) -> set[str]:
        with self._tx() as db:
            return {r[0] for r in db.execute("SELECT id FROM files")}

    def list_files(self, after: str | None, limit: int, order: str = "desc",
                   purpose: str | None = None) -> tuple[list[dict[str, Any]], bool]:
        where, params = ("purpose = ?", (purpose,)) if purpose else ("", ())
        rows, more = self._page("files", ", ".join(FILE_COLUMNS), after, limit, order, where, params)
        return [dict(zip(FILE_COLUMNS, r)) for r in rows], more

    # ---- batches ----------------------------------------------------------------------------
    def add_batch(self, batch: dict[str, Any], output_expires_s: int | None = None,
                  model_key: str | None = None) -> None:
        """`output_expires_s`: its output and error files expire that long after they are made
        (OpenAI's output_expires_after); `model_key`: the model that runs it, whatever name it is
        served under. Neither is a field of the Batch object, so both are kept beside it."""
        with self._tx(write=True) as db:
            db.execute("INSERT INTO batches (id, status, input_file_id, data, output_expires_s, model_key) "
                       "VALUES (?, ?, ?, ?, ?, ?)", (batch["id"], batch["status"], batch["input_file_id"],
                                                     json.dumps(batch), output_expires_s, model_key))

    def model_key(self, batch_id: str) -> str | None:
        """The model a batch was made for (None for a batch made before it was kept)."""
        with self._tx() as db:
            row = db.execute("SELECT model_key FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

    def output_expires_s(self, batch_id: str) -> int | None:
        with self._tx() as db:
            row = db.execute("SELECT output_expires_s FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return row[0] if row else None

    def expired_files(self, now: float) -> list[dict[str, Any]]:
        """Files whose expires_at has come."""
        with self._tx() as db:
            rows = db.execute(f"SELECT {', '.join(FILE_COLUMNS)} FROM files WHERE expires_at IS NOT NULL AND "
                              f"expires_at <= ?", (int(now),)).fetchall()
        return [dict(zip(FILE_COLUMNS, r)) for r in rows]

    def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        if not is_text(batch_id):
            return None
        with self._tx() as db:
            row = db.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return json.loads(row[0]) if row else None

    def update_batch(self, batch_id: str, **changes: Any) -> dict[str, Any]:
        """Merge `changes` into the batch, in one transaction; the batch as it is now."""
        with self._tx(write=True) as db:
            return _merge(db, batch_id, changes)

    def finish_batch(self, batch_id: str, sizes: dict[str, int], changes: dict[str, Any],
                     dropped: tuple[str, ...] = ()) -> dict[str, Any]:
        """A batch's end, in one transaction: its files' final sizes, the records of its files
        in `dropped` gone (empty ones, which the batch no longer names), its final status."""
        with self._tx(write=True) as db:
            for file_id, size in sizes.items():
                if file_id in dropped:
                    _delete_file(db, file_id)
                else:
                    db.execute("UPDATE files SET bytes = ?, status = 'processed' WHERE id = ?", (size, file_id))
            return _merge(db, batch_id, changes)

    def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        rows, more = self._page("batches", "data", after, limit, "desc")
        return [json.loads(r[0]) for r in rows], more

    def unfinished_batches(self) -> list[dict[str, Any]]:
        """Oldest first: they resume in the order they were made."""
        with self._tx() as db:
            rows = db.execute(f"SELECT data FROM batches WHERE status IN ({', '.join('?' * len(UNFINISHED))}) "
                              f"ORDER BY seq", UNFINISHED).fetchall()
        return [json.loads(r[0]) for r in rows]

    def batches_reading(self, file_id: str) -> list[str]:
        """Unfinished batches that read `file_id` as their input."""
        with self._tx() as db:
            rows = db.execute(f"SELECT id FROM batches WHERE input_file_id = ? AND status IN "
                              f"({', '.join('?' * len(UNFINISHED))})", (file_id, *UNFINISHED)).fetchall()
        return [r[0] for r in rows]

    # ---- lists ------------------------------------------------------------------------------
    def _page(self, table: str, columns: str, after: str | None, limit: int, order: str,
              where: str = "", params: tuple = ()) -> tuple[list[tuple], bool]:
        """Up to `limit` rows after the record `after`, in `order` ("desc": newest first), and
        whether more follow."""
        conds, args = ([where], list(params)) if where else ([], [])
        with self._tx() as db:
            if after is not None:
                row = db.execute(f"SELECT seq FROM {table} WHERE id = ?", (after,)).fetchone()
                if row is None and table == "files":
                    row = db.execute("SELECT seq FROM deleted_files WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise UnknownCursor(after)
                conds.append("seq < ?" if order == "desc" else "seq > ?")
                args.append(row[0])
            sql = (f"SELECT {columns} FROM {table}{' WHERE ' + ' AND '.join(conds) if conds else ''} "
                   f"ORDER BY seq {'DESC' if order == 'desc' else 'ASC'} LIMIT ?")
            rows = db.execute(sql, [*args, limit + 1]).fetchall()
        return rows[:limit], len(rows) > limit

    def close(self) -> None:
        with self._lock:
            self.db.close()


def _delete_file(db: sqlite3.Connection, file_id: str) -> bool:
    """Delete a file's record, keeping its place in the list for pages that start after it."""
    db.execute("INSERT OR REPLACE INTO deleted_files (id, seq) SELECT id, seq FROM files WHERE id = ?", (file_id,))
    return db.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0


def _merge(db: sqlite3.Connection, batch_id: str, changes: dict[str, Any]) -> dict[str, Any]:
    batch = json.loads(db.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone()[0])
    batch.update(changes)
    db.execute("UPDATE batches SET status = ?, data = ? WHERE id = ?", (batch["status"], json.dumps(batch), batch_id))
    return batch


def _server_storage_error(path: Path, e: sqlite3.Error) -> StorageError:
    """As a job's, in a server's words: a job's message said "run the same command again"."""
    error = StorageError.from_sqlite(path, e)
    error.then = "start the server again (finished requests do not run again)"
    return error
