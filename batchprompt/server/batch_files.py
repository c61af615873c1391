"""The Batch API's files: uploads (purpose "batch") and each batch's output and error files.

An upload is stored under an id the server makes (DIR/files/file-...), written to a temp file,
fsynced and renamed, and only then recorded. A batch's output and error files exist from the
moment it is in progress: until the batch ends, their contents are the rows its journal holds
(committed at least every half second), in input order; once it ends they are written out to
disk, whole, and never change again."""
from __future__ import annotations

import re
import secrets
import shutil
import sqlite3
import time
from pathlib import Path
from typing import Any, BinaryIO

from ..jobs.storage import write_atomic
from .errors import ApiError

PURPOSES = ("batch",)  # what this server keeps files for (OpenAI has more, for its other APIs)


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


FILE_NAME = re.compile(r"file-[0-9a-f]{24}")  # new_file_id's


def file_json(record: dict[str, Any], size: int | None = None) -> dict[str, Any]:
    """OpenAI's File object; `size` for a batch's file that is still being written."""
    return {"id": record["id"], "object": "file", "bytes": record["bytes"] if size is None else size,
            "created_at": record["created_at"], "filename": record["filename"], "purpose": record["purpose"],
            "status": record["status"], "expires_at": record.get("expires_at"), "status_details": None}


def check_purpose(purpose: Any) -> str:
    if purpose is None:
        raise ApiError(400, "purpose is required: send purpose=batch with the file", "missing_purpose", "purpose")
    if purpose not in PURPOSES:
        raise ApiError(400, f"purpose {purpose!r} is not supported: this server keeps files for the Batch API "
                            f"only; send purpose=batch", "invalid_purpose", "purpose")
    return purpose


def save_upload(src: BinaryIO, dest: Path) -> None:
    """Copy an upload to its place, all or nothing (blocking: call from a thread)."""
    src.seek(0)
    write_atomic(dest, lambda f: shutil.copyfileobj(src, f, 1 << 20))


def new_record(file_id: str, filename: str, purpose: str, size: int, batch_id: str | None = None,
               kind: str | None = None, expires_s: int | None = None) -> dict[str, Any]:
    """`expires_s`: the file is deleted that long after it is made (None: kept until deleted)."""
    now = int(time.time())
    return {"id": file_id, "filename": filename[:255] or "upload.jsonl", "purpose": purpose, "bytes": size,
            "created_at": now, "status": "processed" if kind is None else "uploaded",
            "batch_id": batch_id, "kind": kind, "expires_at": None if expires_s is None else now + expires_s}


#: OpenAI's bounds for expires_after.seconds: an hour to 30 days.
EXPIRES_S = (3600, 30 * 24 * 3600)


def expires_after(anchor: Any, seconds: Any, field: str) -> int | None:
    """OpenAI's `{"anchor": "created_at", "seconds": N}` (files.create's expires_after, or
    batches.create's output_expires_after) as seconds; None where neither part is given."""
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise ApiError(400, f"{field}.anchor must be \"created_at\" (the only anchor), got {anchor!r}",
                       "invalid_parameter", field)
    if isinstance(seconds, str) and seconds.strip().isdigit():  # a multipart form sends text
        seconds = int(seconds)
    if not (isinstance(seconds, int) and not isinstance(seconds, bool) and EXPIRES_S[0] <= seconds <= EXPIRES_S[1]):
        raise ApiError(400, f"{field}.seconds must be a whole number of seconds from {EXPIRES_S[0]} (an hour) to "
                            f"{EXPIRES_S[1]} (30 days), got {seconds!r}", "invalid_parameter", field)
    return seconds


# ---- a running batch's files, read from its journal -------------------------------------------
def _read_only(journal: Path) -> sqlite3.Connection | None:
    """A reader of the journal beside its writer (WAL: it sees what is committed)."""
    if not journal.exists():
        return None
    try:
        return sqlite3.connect(journal.resolve().as_uri() + "?mode=ro", uri=True)
    except sqlite3.Error:
        return None


def journal_lines(journal: Path, ok: bool) -> bytes:
    """The output (ok) or error lines committed so far, in input order (blocking)."""
    db = _read_only(journal)
    if db is None:
        return b""
    try:
        rows = db.execute("SELECT record FROM rows WHERE ok = ? ORDER BY line", (int(ok),)).fetchall()
    except sqlite3.OperationalError:  # its tables are not made yet
        return b""
    finally:
        db.close()
    return b"".join(r[0].encode("utf-8") + b"\n" for r in rows)


def journal_size(journal: Path, ok: bool) -> int:
    """The size journal_lines would have (blocking)."""
    db = _read_only(journal)
    if db is None:
        return 0
    try:
        row = db.execute("SELECT COALESCE(SUM(LENGTH(CAST(record AS BLOB)) + 1), 0) FROM rows WHERE ok = ?",
                         (int(ok),)).fetchone()
    except sqlite3.OperationalError:
        return 0
    finally:
        db.close()
    return int(row[0])
