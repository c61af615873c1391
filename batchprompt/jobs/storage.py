"""Writing a job's files: outputs replaced atomically, and one error for any write that failed.

An output is written to a temp file with a unique name in the output's folder (two runs never
share one), fsynced, renamed over the output, and the folder is fsynced so that the rename
itself survives a power cut. The temp file is removed on every failure. A failed write of the
journal or of an output (a full disk above all) becomes StorageError, which the command prints
as one message and exits with its own status: the rows already journaled are safe.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import sqlite3
import stat
from pathlib import Path
from typing import BinaryIO, Callable

NO_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
SQLITE_FULL = 13  # the result code behind "database or disk is full"


class StorageError(Exception):
    """A write to `path` failed. `no_space`: the disk (or quota) is full. The job fills in
    `journal` and `rows_safe`/`rows` so the message can say what is kept."""

    def __init__(self, path: str | Path, reason: str, no_space: bool):
        super().__init__(path, reason, no_space)
        self.path, self.reason, self.no_space = str(path), reason, no_space
        self.journal: str | None = None
        self.rows_safe: int | None = None
        self.rows: int | None = None
        self.then = "run the same command again to resume (finished rows do not run again)"  # a job's words

    @classmethod
    def from_os(cls, path: str | Path, e: OSError) -> "StorageError":
        return cls(path, e.strerror or str(e), e.errno in NO_SPACE_ERRNOS)

    @classmethod
    def from_sqlite(cls, path: str | Path, e: sqlite3.Error) -> "StorageError":
        full = getattr(e, "sqlite_errorcode", None) == SQLITE_FULL or "full" in str(e)
        return cls(path, str(e), full)

    def __str__(self) -> str:
        what = (f"no space left on the device holding {self.path}" if self.no_space
                else f"cannot write {self.path} ({self.reason})")
        kept = ""
        if self.journal is not None and self.rows_safe is not None:
            kept = f"; {self.rows_safe} of {self.rows} rows are safe in the journal {self.journal}"
        fix = "Free some space" if self.no_space else "Fix that"
        return f"{what}{kept}. {fix}, then {self.then}"


def is_stream(path: str | Path) -> bool:
    """Whether `path` is a character device or a FIFO (through links): /dev/null, a terminal, a pipe.
    Such a path is written through as a stream, never replaced (as root, `-o /dev/null` made
    /dev/null a regular file; a FIFO's reader got nothing and waited)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def write_atomic(path: str | Path, fill: Callable[[BinaryIO], None]) -> None:
    """Replace the file at `path` (through links: the link stays) by what `fill` writes to the
    binary file it is given, all or nothing; a stream (`is_stream`) is written through."""
    if is_stream(path):
        try:
            with open(path, "wb") as f:
                fill(f)
        except BrokenPipeError:  # its reader left: as on stdout (`| head`), not a storage fault
            raise
        except OSError as e:
            raise StorageError.from_os(Path(path), e) from None
        return
    dest = Path(os.path.realpath(path))  # a link to the output was replaced by a file of its own
    fd, tmp = _create_temp(dest)
    try:
        try:  # the file it replaces keeps its mode (a private 0600 output became 0644)
            os.fchmod(fd, stat.S_IMODE(os.stat(dest).st_mode))
        except FileNotFoundError:
            pass
        with os.fdopen(fd, "wb") as f:
            fill(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise StorageError.from_os(dest, e) from None
        raise
    try:
        fsync_dir(dest.parent)
    except OSError as e:
        raise StorageError.from_os(dest.parent, e) from None


def _create_temp(dest: Path) -> tuple[int, str]:
    """A new file beside `dest`, with the permissions a plain open would give (mkstemp's are
    0600: the output would lose its usual mode)."""
    for _ in range(100):
        tmp = str(dest.with_name(f"{dest.name}.{secrets.token_hex(4)}.tmp"))
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
        except OSError as e:
            raise StorageError.from_os(dest, e) from None
    raise StorageError(dest, "no unused temp file name", False)


def remove_stale_temps(folder: str | Path, name: str | None = None) -> int:
    """Remove the temp files that write_atomic left in `folder` (those of the file `name`, or of
    any file) when its process was killed between writing and renaming (each a whole copy of the
    file); returns how many. Call it only while holding what makes this process their one writer
    (a run's lock on its output, a server's on its data directory)."""
    folder = Path(folder)
    pattern = re.compile((".+" if name is None else re.escape(name)) + r"\.[0-9a-f]{8}\.tmp")  # _create_temp's
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for found in names:
        if pattern.fullmatch(found):
            try:
                os.unlink(folder / found)
                removed += 1
            except OSError:
                pass
    return removed


def fsync_dir(folder: str | Path) -> None:
    fd = os.open(str(folder), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
