"""One run per journal: an exclusive lock on a file beside the journal, held for the whole run.

Without it, two runs of one job both compute every row and race on the outputs, and a
--restart beside a still-running run lets the old run's rows win. flock is released by the
kernel when its process ends, however it ends (kill -9 included), so no stale lock can remain.
The file names its holder (pid, host, start time) for the message a second run prints.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from .storage import StorageError


class JournalBusy(Exception):
    """Another run holds the journal's lock."""


class JobLock:
    def __init__(self, journal_path: str | Path, what: str | None = None):
        """`what`: what the lock guards, as the message of a second run names it (the journal)."""
        self.journal = Path(journal_path)
        self.path = Path(str(journal_path) + ".lock")
        self.what = what or f"the journal {self.journal}"
        self._fd: int | None = None

    def __enter__(self) -> "JobLock":
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            while True:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except OSError as e:
                    holder = _holder(fd)
                    os.close(fd)
                    if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                        raise JournalBusy(
                            f"{self.what} is in use by another batchprompt run ({holder}); wait "
                            f"for it to finish, or stop it (it resumes from the journal) and run again") from None
                    raise
                # The last holder removes the file as it lets go: if that happened between our
                # open and flock, we hold a file no later run will see; take the one at the path.
                if _same_file(fd, self.path):
                    break
                os.close(fd)
        except OSError as e:
            raise StorageError.from_os(self.path, e) from None
        self._fd = fd
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                      "started": time.time()}).encode(), 0)
        except OSError as e:
            self.release()
            raise StorageError.from_os(self.path, e) from None

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)  # while still held, so no run can lock the old file after this
        except OSError:
            pass
        os.close(self._fd)
        self._fd = None


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (st.st_dev, st.st_ino)


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started"]))
        return f"pid {info['pid']} on {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has only just started"
