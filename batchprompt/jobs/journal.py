"""Journal: every finished row, in SQLite (WAL, synchronous=FULL), so a killed job resumes.

A row is written once, keyed by its input line; a commit makes a group of rows durable. After
`kill -9`, the rows committed are kept and the others run again: no row is lost and none
appears twice, because the output files are written from the journal at the end.

A failed write (a full disk above all) rolls its transaction back and raises StorageError: the
rows committed before it stay, the ones it held run again. Text is stored as valid UTF-8 even
when a row's id holds a lone surrogate (it is kept with JSON escapes).
"""
from __future__ import annotations

import json
import secrets
import sqlite3
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, NoReturn

from .ids import is_text
from .storage import StorageError


class JournalMismatch(Exception):
    """The journal was started for a different input or different options, or is none of ours.
    `problem`: what is wrong with it, without the command's remedy (a server says its own)."""

    def __init__(self, message: str, problem: str | None = None):
        super().__init__(message)
        self.problem = problem or message


def _settings_json(settings: dict[str, object]) -> str:
    return json.dumps(settings, sort_keys=True, default=str)


class Journal:
    def __init__(self, path: str | Path, fingerprint: str, restart: bool = False,
                 commit_every: int = 64, commit_seconds: float = 0.5, job_id: str | None = None,
                 settings: dict[str, object] | None = None, legacy: str | tuple[str, ...] | None = None,
                 read_only: bool = False):
        """`settings`: what the fingerprint was made of, by name (kept, so that a mismatch can
        say which of them changed). `legacy`: the same job's fingerprint(s) as older batchprompts
        made it; a journal that holds one is this job's (and takes the new one). `read_only`: an
        existing journal, checked as a run would check it and read, never written (a dry run)."""
        self.path = Path(path)
        self._pending: list[tuple[int, str | None, int, str, int, int]] = []
        try:
            if not read_only:
                self.path.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StorageError.from_os(self.path, e) from None
        try:
            if read_only:
                # Without a -wal beside it every row is in the file itself: read it as immutable, so
                # that SQLite makes no -wal and -shm beside it (a dry run left them behind).
                settled = not Path(f"{self.path}-wal").exists()
                uri = self.path.resolve().as_uri() + ("?immutable=1" if settled else "?mode=ro")
                self.db = sqlite3.connect(uri, uri=True, isolation_level=None)
            else:
                self.db = sqlite3.connect(str(self.path), isolation_level=None)
        except sqlite3.OperationalError as e:
            raise StorageError.from_sqlite(self.path, e) from None
        self._check_is_a_journal()
        if read_only:
            self._check_job(fingerprint, restart, settings, legacy)
            self.job_id = self.get("job_id") or ""
            return
        with self._writing():
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=FULL")
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT)")
            self.db.execute("CREATE TABLE IF NOT EXISTS rows (line INTEGER PRIMARY KEY, custom_id TEXT, "
                            "ok INTEGER NOT NULL, record TEXT NOT NULL, "
                            "prompt_tokens INTEGER NOT NULL DEFAULT 0, completion_tokens INTEGER NOT NULL DEFAULT 0)")
        other = self._check_job(fingerprint, restart, settings, legacy)
        if restart or other:  # other: an empty journal, taken over (nothing is lost)
            with self._writing():
                self.db.execute("DELETE FROM rows")
                self.db.execute("DELETE FROM meta")
        self.set("fingerprint", fingerprint)
        if settings is not None:
            self.set("settings", _settings_json(settings))
        #: This job's own id (kept across resumes; new with restart): it scopes the ids of its
        #: lines. A caller with an id of its own (the server: the batch's) gives it.
        self.job_id = job_id or self.get("job_id") or secrets.token_hex(8)
        self.set("job_id", self.job_id)
        self.commit_every, self.commit_seconds = commit_every, commit_seconds
        self._last_commit = time.monotonic()

    def _check_job(self, fingerprint: str, restart: bool, settings: dict[str, object] | None,
                   legacy: str | tuple[str, ...] | None) -> bool:
        """Refuse a journal of another job that holds rows (unless `restart`); whether it was
        begun for another input or options."""
        if self.get("fingerprint") is None and not restart and not self.empty():  # its meta table was lost
            self._refuse(f"the journal {self.path} holds rows but no record of the job they belong to "
                         f"(damaged, or not made by batchprompt)", "give another --journal, or --restart to start over")
        olds = legacy if isinstance(legacy, tuple) else (legacy,)
        other = self.get("fingerprint") not in (None, fingerprint, *olds)  # begun for another input or options
        if other and not restart and not self.empty():
            changed = self._changed(settings)
            self._refuse(
                f"the journal {self.path} belongs to a different input or different options ("
                + (f"changed since the job began: {changed}" if changed else
                   "the input file, or an option such as --model, --system, --max-tokens or --temperature, "
                   "changed since the job began")
                + ")", "run with the job's first options to resume, or --restart to start over")
        return other

    def _check_is_a_journal(self) -> None:
        """A file that is not SQLite, or a database of something else, is refused, not written
        into (a traceback, or tables added to the user's own database)."""
        try:
            tables = {r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        except sqlite3.DatabaseError as e:
            self._refuse(f"{self.path} is not a batchprompt journal ({e})",
                         "give another --journal, or move that file away")
        foreign = sorted(tables - {"meta", "rows"})
        if foreign:
            self._refuse(f"{self.path} is a database with other tables ({', '.join(foreign[:5])}), not a batchprompt "
                         f"journal", "give another --journal")

    def _refuse(self, problem: str, remedy: str | None = None) -> NoReturn:
        """Close the database and raise JournalMismatch("problem: remedy"): this job cannot use it."""
        self.db.close()
        raise JournalMismatch(f"{problem}: {remedy}" if remedy else problem, problem) from None

    def empty(self) -> bool:
        """No row recorded, pending ones included: a run that stopped before any row (a bad option
        found as the model loaded) left it, and a run with other options may take it over, losing
        nothing."""
        return not self._pending and self.db.execute("SELECT 1 FROM rows LIMIT 1").fetchone() is None

    def _changed(self, settings: dict[str, object] | None) -> str:
        """The settings that differ from the journal's, as "name (was → now)"; "" where the
        journal kept none (begun by an older batchprompt) or none differs by name."""
        try:
            before = json.loads(self.get("settings") or "null")
        except ValueError:
            before = None
        if not isinstance(before, dict) or settings is None:
            return ""
        now = json.loads(_settings_json(settings))
        shown = lambda v: "not given" if v is None else json.dumps(v)  # noqa: E731  (not "null")
        return ", ".join(f"{k} ({shown(before.get(k))} → {shown(now.get(k))})"
                         for k in sorted(set(before) | set(now)) if before.get(k) != now.get(k))

    def get(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def set(self, key: str, value: str) -> None:
        with self._writing():
            self.db.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (key, value))

    @contextmanager
    def _writing(self):
        """A write: on any failure its transaction is rolled back (so the next write can begin
        one); a failure of the database or the disk becomes StorageError."""
        try:
            yield
        except BaseException as e:
            if self.db.in_transaction:
                try:
                    self.db.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            if isinstance(e, sqlite3.OperationalError):
                raise StorageError.from_sqlite(self.path, e) from None
            raise

    def done_lines(self) -> set[int]:
        """The lines recorded, those not yet committed included (committed first: every read of
        the journal sees every row recorded before it)."""
        self.flush()
        return {r[0] for r in self.db.execute("SELECT line FROM rows")}

    def record(self, line: int, custom_id: str | None, ok: bool, record: dict[str, Any],
               prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
        self._pending.append((line, _text(custom_id), int(ok), record_json(record), prompt_tokens, completion_tokens))
        if len(self._pending) >= self.commit_every:
            self.flush()
        else:
            self.flush_due()

    def flush_due(self) -> None:
        """Commit the pending rows if the last commit is `commit_seconds` old. A caller whose rows
        may stop coming for a while (the rest of the job is one long prompt) calls this on a
        timer, so a finished row waits at most about that long to become durable."""
        if self._pending and time.monotonic() - self._last_commit >= self.commit_seconds:
            self.flush()

    def flush(self) -> None:
        if self._pending:
            try:
                with self._writing():
                    self.db.execute("BEGIN IMMEDIATE")
                    self.db.executemany("INSERT OR IGNORE INTO rows VALUES (?, ?, ?, ?, ?, ?)", self._pending)
                    self.db.execute("COMMIT")
            except StorageError:
                self._pending.clear()  # not durable: these rows run again next time
                raise
            self._pending.clear()
        self._last_commit = time.monotonic()

    def records(self) -> Iterator[tuple[int, bool, str]]:
        """(line, ok, JSON record) in input order."""
        self.flush()
        for line, ok, record in self.db.execute("SELECT line, ok, record FROM rows ORDER BY line"):
            yield line, bool(ok), record

    def counts(self) -> tuple[int, int]:
        """(rows ok, rows in all)."""
        self.flush()
        ok, total = self.db.execute("SELECT COALESCE(SUM(ok), 0), COUNT(*) FROM rows").fetchone()
        return int(ok), int(total)

    def token_counts(self) -> tuple[int, int]:
        """(prompt, completion) tokens of the rows that succeeded."""
        self.flush()
        p, c = self.db.execute("SELECT COALESCE(SUM(prompt_tokens), 0), COALESCE(SUM(completion_tokens), 0) "
                               "FROM rows WHERE ok = 1").fetchone()
        return int(p), int(c)

    def close(self) -> None:
        try:
            self.flush()
        finally:
            self.db.close()


def record_json(record: dict[str, Any]) -> str:
    """The record as JSON, readable UTF-8; escaped (\\ud800) where it holds a lone surrogate."""
    text = json.dumps(record, ensure_ascii=False)
    return text if is_text(text) else json.dumps(record, ensure_ascii=True)


def _text(s: str | None) -> str | None:
    return s if s is None or is_text(s) else s.encode("utf-8", "backslashreplace").decode("utf-8")
