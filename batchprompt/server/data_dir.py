"""The server's data directory (--data-dir): what the Batch API keeps across restarts.

    DIR/server.lock                   held while a server uses DIR; a second server exits 2
    DIR/meta.sqlite                   files and batches (SQLite, WAL, synchronous=FULL)
    DIR/files/<file id>               file contents, under ids the server makes
    DIR/batches/<batch id>.journal    each batch's finished rows (the jobs' Journal)

A client's file name is kept as a label only; no path is ever built from what a client sends.
The default is $XDG_DATA_HOME/batchprompt/server (~/.local/share/batchprompt/server): uploads
and outputs are a user's data, not a cache that may be cleared at any time."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import time
from pathlib import Path

from ..jobs.storage import remove_stale_temps


class DataDirError(ValueError):
    """The data directory cannot be used (a ValueError: the command exits 2 with its message)."""


def default_data_dir() -> Path:
    root = os.environ.get("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return Path(root) / "batchprompt" / "server"


class DataDir:
    def __init__(self, root: str | Path | None):
        self.root = Path(root).expanduser() if root else default_data_dir()
        self.files = self.root / "files"
        self.batches = self.root / "batches"
        self.meta = self.root / "meta.sqlite"
        if self.root.exists() and not self.root.is_dir():  # it said "cannot create it (File exists)"
            raise DataDirError(f"--data-dir {self.root}: this is a file, not a directory; give a directory "
                               f"(it is made if missing)")
        try:
            for folder in (self.root, self.files, self.batches):
                folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise DataDirError(f"--data-dir {self.root}: cannot create it ({e.strerror}); "
                               f"give a directory this user can write") from None
        self._lock_fd: int | None = None
        self._lock()
        remove_stale_temps(self.files)  # a killed server's, each a whole copy of a file: this one holds the lock

    def file_path(self, file_id: str) -> Path:
        """Where a file's contents are: `file_id` is one the server made (looked up first)."""
        return self.files / file_id

    def journal_path(self, batch_id: str) -> Path:
        return self.batches / f"{batch_id}.journal"

    def _lock(self) -> None:
        """One server per data directory: two would both run the same batches. flock is
        released by the kernel however the process ends (kill -9 included)."""
        path = self.root / "server.lock"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise DataDirError(f"--data-dir {self.root}: cannot write it ({e.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise DataDirError(f"--data-dir {self.root} is in use by another batchprompt server ({holder}); "
                                   f"stop it, or give this server another --data-dir") from None
            raise DataDirError(f"--data-dir {self.root}: cannot lock it ({e.strerror})") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "started": time.time()}).encode(), 0)
        self._lock_fd = fd

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the lock goes with the descriptor
            self._lock_fd = None


def _holder(fd: int) -> str:
    try:
        info = json.loads(os.pread(fd, 4096, 0))
        return f"pid {info['pid']}, started {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(info['started']))}"
    except (OSError, ValueError, KeyError, TypeError):
        return "it has only just started"
