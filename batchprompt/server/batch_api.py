"""BatchApi: OpenAI's Files and Batches over the server's data directory.

Records (files, batches) are in SQLite under --data-dir and survive the process; each batch
that has not ended has a job (batch_job.py) running it through the process's one engine. When
the server starts, the batches it left unfinished (killed, or stopped) resume from their
journals. One thread does every journal write, so that no commit's fsync holds the event loop."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from ..jobs.ids import is_text
from ..jobs.storage import StorageError
from . import batch_files
from .batch_files import FILE_NAME
from .batch_input import ENDPOINTS
from .batch_job import BatchJob, Counts, state_detail
from .batch_store import FINAL, Store, UnknownCursor
from .data_dir import DataDir, DataDirError
from .errors import ApiError

if TYPE_CHECKING:
    from .config import ServerConfig
    from .state import ServerState

log = logging.getLogger("batchprompt")

WINDOW = re.compile(r"([0-9]+)([smhd])")
MAX_WINDOW_S = 365 * 86400
UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
SWEEP_EVERY_S = 60.0  # how often expired files are looked for (and at the start)


class BatchApi:
    def __init__(self, config: "ServerConfig", state: "ServerState"):
        self.config, self.state = config, state
        self.dir = DataDir(config.data_dir)  # a second server on the same directory stops here
        try:
            self.store = Store(self.dir.meta)
        except StorageError as e:
            self.dir.close()
            raise DataDirError(f"--data-dir {self.dir.root}: {e}") from None
        self._remove_unrecorded_files()
        self._io = ThreadPoolExecutor(1, thread_name_prefix="batchprompt-batch-io")
        self.jobs: dict[str, BatchJob] = {}
        self._sweeper: asyncio.Task | None = None

    def _remove_unrecorded_files(self) -> None:
        """An upload is renamed into place, then recorded: a kill between the two left a whole
        file that no call lists or deletes (and its client never learned its id). Such files are
        removed at start, while this server holds the directory's lock."""
        known = self.store.file_ids()
        for path in self.dir.files.iterdir():
            if FILE_NAME.fullmatch(path.name) and path.name not in known and path.is_file():
                with contextlib.suppress(OSError):
                    size = path.stat().st_size
                    path.unlink()
                    log.info("removed %s (%d bytes): an upload cut off before it was recorded", path, size)

    async def io(self, fn: Callable, *args) -> Any:
        """Run `fn` on the journal thread (every Journal is made and used there)."""
        return await asyncio.get_running_loop().run_in_executor(self._io, fn, *args)

    async def update(self, batch_id: str, **changes: Any) -> dict[str, Any]:
        batch = await asyncio.to_thread(self.store.update_batch, batch_id, **changes)
        if "status" in changes:  # one log line per change of state, with its counts
            log.info("batch %s %s%s", batch_id, changes["status"], state_detail(self.view(batch)))
        return batch

    # ---- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        """Resume the batches an earlier run of the server left unfinished."""
        resumed = 0
        for batch in await asyncio.to_thread(self.store.unfinished_batches):
            if not await self._same_model(batch):
                log.warning("batch %s was made for the model %s, not %s: it resumes when a server with that "
                            "model uses this --data-dir", batch["id"], batch.get("model"), self.state.model_id)
                continue
            # Its counts as of its last change of state: those of the journal are logged once it is read.
            log.info("batch %s resumes (%s)", batch["id"], batch["status"])
            self._spawn(batch, resumed=True)
            resumed += 1
        if resumed:
            log.info("resuming %d unfinished batch(es) from %s", resumed, self.dir.root)
        self._sweeper = asyncio.ensure_future(self._sweep_often())

    async def _same_model(self, batch: dict[str, Any]) -> bool:
        """Whether this server runs the model the batch was made for: the same model files,
        whatever name they are served under now (--served-model-name); a batch made before the
        files were kept, by a name of this server's model (the embedded model's names included)."""
        key = await asyncio.to_thread(self.store.model_key, batch["id"])
        if key is not None:
            return key == self.state.model_key
        name = batch.get("model")
        if name in self.state.model_names:
            return True
        from ..models.loader import EMBEDDED_NAMES, ModelNotFoundError, embedded_model_path

        try:
            return str(name).lower() in EMBEDDED_NAMES and self.state.model_key == str(embedded_model_path())
        except ModelNotFoundError:  # the embedded model is not installed: this server runs another
            return False

    async def _sweep_often(self) -> None:
        while True:
            try:
                await self.sweep(time.time())
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001  (a disk error: the next sweep tries again)
                log.exception("deleting expired files failed")
            await asyncio.sleep(SWEEP_EVERY_S)

    async def sweep(self, now: float) -> list[str]:
        """Delete the files whose expires_at has come (files.create's expires_after, a batch's
        output_expires_after), except those a batch still running reads or writes: they go at
        the first sweep after it ends. The ids deleted."""
        gone = []
        for record in await asyncio.to_thread(self.store.expired_files, now):
            if await self._in_use(record) is None:
                await asyncio.to_thread(self.store.delete_file, record["id"])
                self.dir.file_path(record["id"]).unlink(missing_ok=True)
                log.info("file %s expired (expires_at %d): deleted", record["id"], record["expires_at"])
                gone.append(record["id"])
        return gone

    async def _in_use(self, record: dict[str, Any]) -> str | None:
        """Why the file cannot be deleted now (a batch that has not ended reads or writes it)."""
        file_id = record["id"]
        if await self._live_journal(record) is not None:
            return (f"the file {file_id} is the {record['kind']} file of the batch {record['batch_id']}, which has "
                    f"not ended; cancel the batch or wait for it")
        readers = await asyncio.to_thread(self.store.batches_reading, file_id)
        if readers:
            return (f"the file {file_id} is the input of the batch {readers[0]}, which has not ended; cancel the "
                    f"batch or wait for it")
        return None

    def _spawn(self, batch: dict[str, Any], resumed: bool = False, ends_at: float | None = None) -> None:
        job = BatchJob(self, batch, resumed, ends_at)
        self.jobs[job.id] = job
        job.task = asyncio.ensure_future(job.run())
        job.task.add_done_callback(lambda _: self.jobs.pop(job.id, None))

    async def close(self) -> None:
        """Stop every job (what finished is committed; the batches resume at the next start)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        tasks = [j.task for j in self.jobs.values() if j.task is not None and not j.task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=30)
        await asyncio.to_thread(self._io.shutdown, True)
        self.store.close()
        self.dir.close()

    def running(self) -> int:
        return len(self.jobs)

    # ---- files -------------------------------------------------------------------------------
    async def get_file(self, file_id: str) -> dict[str, Any]:
        record = await asyncio.to_thread(self.store.get_file, file_id)
        if record is None:
            raise ApiError(404, f"no file {file_id!r} (GET /v1/files lists them)", "file_not_found", "file_id")
        return record

    async def file_object(self, record: dict[str, Any]) -> dict[str, Any]:
        journal = await self._live_journal(record)
        if journal is None:
            return batch_files.file_json(record)
        size = await asyncio.to_thread(batch_files.journal_size, journal, record["kind"] == "output")
        return batch_files.file_json(record, size)

    async def _live_journal(self, record: dict[str, Any]):
        """The journal a batch's file is read from while the batch runs; None once it is on disk."""
        if record["kind"] is None:
            return None
        batch = await asyncio.to_thread(self.store.get_batch, record["batch_id"])
        if batch is None or batch["status"] in FINAL:
            return None
        return self.dir.journal_path(record["batch_id"])

    async def live_content(self, record: dict[str, Any]) -> bytes | None:
        """A running batch's output or error lines so far; None when the file is on disk."""
        journal = await self._live_journal(record)
        if journal is None:
            return None
        return await asyncio.to_thread(batch_files.journal_lines, journal, record["kind"] == "output")

    async def delete_file(self, file_id: str) -> dict[str, Any]:
        record = await self.get_file(file_id)
        in_use = await self._in_use(record)
        if in_use:
            raise ApiError(409, in_use, "file_in_use", "file_id")
        await asyncio.to_thread(self.store.delete_file, file_id)
        self.dir.file_path(file_id).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}

    # ---- batches -----------------------------------------------------------------------------
    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        file_id, endpoint = body["input_file_id"], body["endpoint"]
        record = await asyncio.to_thread(self.store.get_file, file_id)
        if record is None:
            raise ApiError(404, f"no file {file_id!r}: upload the requests with POST /v1/files (purpose=batch) and "
                                f"give its id", "file_not_found", "input_file_id")
        if record["purpose"] != "batch":
            raise ApiError(400, f"the file {file_id} is a {record['purpose']} file, not an upload with purpose=batch",
                           "invalid_input_file", "input_file_id")
        if endpoint not in ENDPOINTS:
            raise ApiError(400, f"endpoint {endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                           "invalid_endpoint", "endpoint")
        window = window_seconds(body["completion_window"])
        metadata = check_metadata(body.get("metadata"))
        asked = body.get("output_expires_after") or {}
        output_expires_s = batch_files.expires_after(asked.get("anchor"), asked.get("seconds"), "output_expires_after")
        self.state.service()  # 503 while loading or shutting down
        exact = time.time()
        now = int(exact)
        counts, usage = Counts().json()
        batch = {"id": "batch_" + secrets.token_hex(16), "object": "batch", "endpoint": endpoint, "errors": None,
                 "input_file_id": file_id, "completion_window": body["completion_window"], "status": "validating",
                 "output_file_id": None, "error_file_id": None, "created_at": now, "in_progress_at": None,
                 "expires_at": now + window, "finalizing_at": None, "completed_at": None, "failed_at": None,
                 "expired_at": None, "cancelling_at": None, "cancelled_at": None, "request_counts": counts,
                 "metadata": metadata, "model": self.state.model_id, "usage": usage}
        await asyncio.to_thread(self.store.add_batch, batch, output_expires_s, self.state.model_key)
        log.info("batch %s created: %s from file %s, window %s", batch["id"], endpoint, file_id,
                 body["completion_window"])
        self._spawn(batch, ends_at=exact + window)
        return batch

    async def get_batch(self, batch_id: str) -> dict[str, Any]:
        batch = await asyncio.to_thread(self.store.get_batch, batch_id)
        if batch is None:
            raise ApiError(404, f"no batch {batch_id!r} (GET /v1/batches lists them)", "batch_not_found", "batch_id")
        return self.view(batch)

    def view(self, batch: dict[str, Any]) -> dict[str, Any]:
        """The batch with its running job's counts (the store has them as of the last change)."""
        job = self.jobs.get(batch["id"])
        if job is not None and batch["status"] not in FINAL and job.counts.total:
            batch = dict(batch)
            batch["request_counts"], batch["usage"] = job.counts.json()
        return batch

    async def list_batches(self, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
        try:
            batches, more = await asyncio.to_thread(self.store.list_batches, after, limit)
        except UnknownCursor:
            raise ApiError(400, f"after={after!r} names no batch; give the id of the last batch of the previous "
                                f"page", "invalid_cursor", "after") from None
        return [self.view(b) for b in batches], more

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        batch = await self.get_batch(batch_id)
        if batch["status"] in FINAL:
            if batch["status"] == "cancelled":
                return batch
            raise ApiError(409, f"the batch {batch_id} has already ended ({batch['status']}); nothing to cancel",
                           "batch_ended", "batch_id")
        job = self.jobs.get(batch_id)
        if job is None:
            raise ApiError(409, f"the batch {batch_id} is not running in this server now (it was made for the "
                                f"model {batch.get('model')}, or the engine stopped under it); start a server with "
                                f"that model on this --data-dir to resume it", "batch_not_running", "batch_id")
        async with job.lock:
            if job.finishing and job.ending != "cancelled":
                raise ApiError(409, f"the batch {batch_id} is ending ({job.ending or 'completed'}): its outputs are "
                                    f"being written", "batch_ended", "batch_id")
            if job.stop("cancelled") and batch["status"] != "cancelling":
                batch = self.view(await self.update(batch_id, status="cancelling", cancelling_at=int(time.time())))
        # The requests this answer counts as finished are kept whatever comes next: a kill -9 just
        # after the cancel lost those not committed yet, and a cancelled batch never runs them again.
        await job.commit()
        # As OpenAI answers: `cancelling` at once; the batch turns `cancelled` once its requests
        # in flight are stopped and its files are written (a poll sees it).
        return batch

    async def ensure_files(self, batch_id: str) -> dict[str, Any]:
        """The batch, with output and error files (made now for one cancelled before it began)."""
        batch = await asyncio.to_thread(self.store.get_batch, batch_id)
        if batch["output_file_id"] is not None:
            return batch
        ids = {}
        expires_s = await asyncio.to_thread(self.store.output_expires_s, batch_id)
        for kind in ("output", "error"):
            ids[f"{kind}_file_id"] = file_id = batch_files.new_file_id()
            await asyncio.to_thread(self.store.add_file, batch_files.new_record(
                file_id, f"{batch_id}_{kind}.jsonl", "batch_output", 0, batch_id, kind, expires_s))
        return await self.update(batch_id, **ids)


def window_seconds(window: str) -> int:
    """A completion window ("24h", as OpenAI takes it; also "30m", "90s", "2d")."""
    m = WINDOW.fullmatch(window)
    if m is None:
        raise ApiError(400, f"completion_window {window!r} is not a duration: give \"24h\" (or a number with s, m, "
                            f"h or d)", "invalid_completion_window", "completion_window")
    seconds = int(m.group(1)) * UNIT_S[m.group(2)]
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ApiError(400, f"completion_window {window!r} is out of range: give a duration from 1s to 365d "
                            f"(OpenAI takes \"24h\")", "invalid_completion_window", "completion_window")
    return seconds


def check_metadata(metadata: Any) -> dict[str, str] | None:
    """OpenAI's rule: at most 16 pairs, keys up to 64 characters, values up to 512."""
    if metadata is None:
        return None
    rule = "metadata takes at most 16 pairs of strings, keys up to 64 characters and values up to 512"
    if len(metadata) > 16:
        raise ApiError(400, f"{rule}; it has {len(metadata)} pairs", "invalid_metadata", "metadata")
    for k, v in metadata.items():
        if not is_text(k) or not is_text(v):  # a lone surrogate (JSON's "\ud800"): stored, it was a 500
            name = k.encode("utf-8", "backslashreplace").decode()[:40]
            raise ApiError(400, f"metadata must be Unicode text: {'the key' if not is_text(k) else 'the value of'} "
                                f"'{name}' holds a lone surrogate",
                           "invalid_metadata", "metadata")
        if len(k) > 64:
            raise ApiError(400, f"{rule}; the key {k[:20]!r}... has {len(k)} characters", "invalid_metadata",
                           "metadata")
        if len(v) > 512:
            raise ApiError(400, f"{rule}; the value of {k!r} has {len(v)} characters", "invalid_metadata",
                           "metadata")
    return metadata
