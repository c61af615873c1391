"""One batch's work: check its input file, run the requests its journal lacks through the
process's engine, and write its output and error files when it ends.

Durable: every finished request goes to the batch's journal (the jobs' Journal: SQLite, WAL,
synchronous=FULL), committed at least every half second. A server killed mid-batch (kill -9,
a power cut) starts again, finds the batch unfinished, and runs only what the journal lacks;
a server asked to stop (Ctrl-C, SIGTERM) commits what finished and does the same. The
batch's status, timestamps and file ids are in the server's records (batch_store.py).

Ends: completed (every request answered: ok in the output file, failed in the error file);
cancelled (POST .../cancel) or expired (its completion window ran out), which keep every
finished request and give the ones that never ran an error line (batch_cancelled,
batch_expired); failed, when the input file does not check (no request runs)."""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..api.batch import Batch
from ..backends import BULK
from ..jobs import openai_io
from ..jobs.journal import Journal, JournalMismatch
from ..jobs.rows import Row, RowError
from ..jobs.storage import StorageError, write_atomic
from .batch_input import Checked, check_input
from .batch_rows import Plan, plan_rows, refused_line, unfinished_line
from .errors import ApiError

if TYPE_CHECKING:
    from .batch_api import BatchApi

log = logging.getLogger("batchprompt")

FLUSH_EVERY_S = 0.5  # the journal commits at least this often while requests finish
CACHED = "json_extract(record, '$.response.body.usage.prompt_tokens_details.cached_tokens')"


@dataclass
class Counts:
    total: int = 0
    completed: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def json(self) -> tuple[dict[str, int], dict[str, Any]]:
        """(request_counts, usage) as OpenAI's Batch object has them."""
        return ({"total": self.total, "completed": self.completed, "failed": self.failed},
                {"input_tokens": self.prompt_tokens, "input_tokens_details": {"cached_tokens": self.cached_tokens},
                 "output_tokens": self.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": self.prompt_tokens + self.completion_tokens})


class BatchJob:
    def __init__(self, api: "BatchApi", batch: dict[str, Any], resumed: bool = False, ends_at: float | None = None):
        """`ends_at`: when its window ends, to the fraction of a second, where the batch was just
        created (its expires_at is in whole seconds from the second it was created in: a "3s"
        window ended 2.5 s after the create); after a restart, expires_at."""
        self.api, self.id = api, batch["id"]
        self.ends_at = ends_at if ends_at is not None else batch["expires_at"]
        self.resumed = resumed  # begun by a server's start, after an earlier run of it stopped
        self.batch = batch  # as it was when the job began (the store has the current one)
        self.counts = Counts()
        self.ending: str | None = None  # "cancelled" or "expired": the run stops early, and why
        self.finishing = False  # the outputs are being written: a cancel comes too late
        self.lock = asyncio.Lock()  # status changes of this batch, one at a time
        self.task: asyncio.Task | None = None
        self._engine_batch: Batch | None = None
        self._journal: Journal | None = None
        self._expiry: asyncio.TimerHandle | None = None

    # ---- control (on the event loop) ----------------------------------------------------------
    def stop(self, ending: str) -> bool:
        """End the run early (cancelled or expired), keeping what finished; False if too late."""
        if self.finishing or self.ending is not None:
            return self.ending == ending
        self.ending = ending
        batch = self._engine_batch
        if batch is not None:  # its unfinished requests come back 'cancelled' and the run ends
            batch.request_cancel()
        return True

    async def commit(self) -> None:
        """Make every request journaled so far durable now (it is, at the latest, FLUSH_EVERY_S
        later)."""
        if self._journal is not None:
            await self.api.io(self._journal.flush)

    # ---- the run -------------------------------------------------------------------------------
    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        self._expiry = loop.call_at(loop.time() + max(self.ends_at - time.time(), 0),
                                    lambda: self.stop("expired"))
        try:
            await self._run()
        except asyncio.CancelledError:  # the server is stopping: the batch resumes when it starts again
            raise
        except (StorageError, ApiError) as e:  # a full disk, the engine stopped: what is journaled is safe
            log.error("batch %s paused (it resumes when the server starts again): %s", self.id, e)
        except Exception as e:  # noqa: BLE001  (a bug: the batch fails with the reason, the server goes on)
            log.exception("batch %s failed", self.id)
            await self._fail(e)
        finally:
            self._expiry.cancel()
            if self._journal is not None:
                journal, self._journal = self._journal, None
                await asyncio.shield(self.api.io(journal.close))

    async def _fail(self, error: Exception) -> None:
        await self._end_failed([{"code": "internal_error", "line": None, "param": None,
                                 "message": f"{type(error).__name__}: {error}"}])

    async def _end_failed(self, errors: list[dict[str, Any]]) -> None:
        """The batch fails with `errors`; the requests that finished before stay in its output
        and error files (written from the journal, as at a normal end)."""
        if self._engine_batch is not None:  # what is still in the engine stops
            await self._engine_batch.cancel_async()
        sizes: dict[str, int] = {}
        batch = await asyncio.to_thread(self.api.store.get_batch, self.id)
        if batch["output_file_id"] is not None:
            try:
                journal = await self._open_journal()
                sizes = await self.api.io(self._write_files, journal, batch["output_file_id"], batch["error_file_id"])
            except Exception:  # noqa: BLE001  (the batch still fails, below, with no files)
                log.exception("batch %s: the requests that finished could not be written to its files", self.id)
                # Never written: dropped, their ids null (they stayed, as uploaded files of 0 bytes
                # whose content was a 404).
                sizes = {file_id: 0 for file_id in (batch["output_file_id"], batch["error_file_id"]) if file_id}
        await self._record_end(batch, sizes, status="failed", failed_at=int(time.time()), errors=_errors(errors))

    async def _record_end(self, batch: dict[str, Any], sizes: dict[str, int], **changes) -> None:
        """The batch's end in the store: its files' sizes, `changes`, its request counts and usage.
        An output or error file left empty is dropped and its id becomes null, as OpenAI has it
        (no output file when every request failed, no error file when none did)."""
        counts, usage = self.counts.json()
        dropped = tuple(file_id for file_id, size in sizes.items() if size == 0)
        for key in ("output_file_id", "error_file_id"):
            if batch[key] in dropped:
                changes[key] = None
        await asyncio.to_thread(self.api.store.finish_batch, self.id, sizes,
                                dict(changes, request_counts=counts, usage=usage), dropped)
        for file_id in dropped:
            self.api.dir.file_path(file_id).unlink(missing_ok=True)
        log.info("batch %s %s%s", self.id, changes.get("status"),
                 state_detail(dict(batch, request_counts=counts, **changes)))

    async def _run(self) -> None:
        status = self.batch["status"]
        checked = await self._check()
        if not checked.ok:
            if self.batch["output_file_id"] is None:  # never begun: nothing ran, it has no files
                await self.api.update(self.id, status="failed", failed_at=int(time.time()),
                                      errors=_errors(checked.errors))
            else:  # begun before a restart: the requests that finished then stay in its files
                self.counts.total = (self.batch.get("request_counts") or {}).get("total", 0)
                await self._end_failed(checked.errors)
            return
        self.counts.total = len(checked.rows)
        if status == "finalizing":  # killed while writing its outputs: every request is journaled
            await self._finish("completed", checked.rows)
            return
        if status == "cancelling":
            self.ending = "cancelled"
        async with self.lock:
            if self.ending is None and status == "validating":
                await self._begin()
        if self.ending is None:
            await self._compute(checked.rows)
        await self._finish(self.ending or "completed", checked.rows)

    async def _check(self) -> Checked:
        """The input file's requests (read and checked off the event loop)."""
        api, b = self.api, self.batch
        path = api.dir.file_path(b["input_file_id"])
        try:
            raw = await asyncio.to_thread(path.read_bytes)
        except OSError as e:
            return Checked(errors=[{"code": "missing_file", "line": None, "param": "input_file_id",
                                    "message": f"the input file {b['input_file_id']} cannot be read ({e.strerror})"}])
        state = api.state
        # The name the batch was made under counts too: resumed under another --served-model-name
        # (the same model), its rows naming the old one failed as model_not_found.
        names = set(state.model_names) | ({b["model"]} if b.get("model") else set())
        return await asyncio.to_thread(check_input, raw, b["endpoint"], state.model_id, names)

    async def _begin(self) -> None:
        """validating -> in_progress: its output and error files exist from now on."""
        await self.api.ensure_files(self.id)
        counts, usage = self.counts.json()
        await self.api.update(self.id, status="in_progress", in_progress_at=int(time.time()), request_counts=counts,
                              usage=usage)

    async def _open_journal(self) -> Journal:
        if self._journal is None:
            path = self.api.dir.journal_path(self.id)
            fingerprint = f"{self.id}:{self.batch['input_file_id']}"
            try:
                self._journal = await self.api.io(lambda: Journal(path, fingerprint, job_id=self.id))
            except JournalMismatch as e:  # its remedy named run's options (--journal), none of serve's
                raise JournalMismatch(f"the batch's journal cannot be read: {e.problem}; the requests it recorded "
                                      f"are lost: create the batch again") from None
            await self.api.io(self._load_counts, self._journal)
            c = self.counts
            if self.resumed and c.completed + c.failed:
                log.info("batch %s: %d requests journaled before the restart (%d completed, %d failed) are kept, "
                         "not run again", self.id, c.completed + c.failed, c.completed, c.failed)
        return self._journal

    def _load_counts(self, journal: Journal) -> None:
        """Counts of the requests journaled before (an earlier run of this server): on the io thread."""
        c = self.counts
        c.completed, total = journal.counts()
        c.failed = total - c.completed
        c.prompt_tokens, c.completion_tokens = journal.token_counts()
        c.cached_tokens = journal.db.execute(f"SELECT COALESCE(SUM({CACHED}), 0) FROM rows WHERE ok = 1").fetchone()[0]

    def _record(self, journal: Journal, line: int, custom_id: str | None, ok: bool, record: dict,
                prompt: int = 0, completion: int = 0, cached: int = 0) -> None:
        """Journal one answered request and count it (on the io thread)."""
        journal.record(line, custom_id, ok, record, prompt, completion)
        c = self.counts
        if ok:
            c.completed += 1
            c.prompt_tokens, c.completion_tokens, c.cached_tokens = (
                c.prompt_tokens + prompt, c.completion_tokens + completion, c.cached_tokens + cached)
        else:
            c.failed += 1

    def _record_failed(self, journal: Journal, lines: list[tuple[Row | RowError, dict]]) -> None:
        """Journal requests answered by their error lines, in one call (on the io thread): a hop
        to the io thread for each cost 70 us, seconds for a big batch refused or cancelled."""
        for r, line in lines:
            self._record(journal, r.line, r.custom_id, False, line)

    async def _compute(self, rows: list[Row | RowError]) -> None:
        api = self.api
        journal = await self._open_journal()
        done = await api.io(journal.done_lines)
        refused = [(r, refused_line(r, self.id)) for r in rows if isinstance(r, RowError) and r.line not in done]
        await api.io(self._record_failed, journal, refused)  # requests whose body is wrong are answered at once
        todo = [r for r in rows if isinstance(r, Row) and r.line not in done]
        if not todo:
            return
        service = api.state.service()
        tokenizer = service.tokenizer
        plan = await asyncio.to_thread(plan_rows, todo, tokenizer, service.max_model_len, self.id)
        await api.io(self._record_failed, journal, plan.refused)
        if self.ending is not None or not plan.items:
            return
        self._engine_batch = batch = Batch(service, plan.items, priority=BULK)
        flusher = asyncio.ensure_future(self._flush_often(journal))
        try:
            await self._collect(batch, plan, journal, openai_io.TokenPieces.of(tokenizer))
        finally:
            flusher.cancel()
            await asyncio.shield(api.io(journal.flush))  # also when the server stops: what finished is kept

    async def _collect(self, batch: Batch, plan: Plan, journal: Journal, token_text) -> None:
        """Journal each request as its last choice comes in. A choice that comes back cancelled
        (a cancel, an expiry, the server stopping) did not run: its request is not journaled."""
        # A row's answer carries the name its body gave, as the endpoints' do; else the name the batch
        # was made under, also where a restart serves the model by another (--served-model-name).
        created, model = openai_io.now(), self.batch.get("model") or self.api.state.model_id
        async for index, result in batch:
            if result.finish_reason == "cancelled":
                continue
            pending, choice = plan.owners[index]
            pending.choices[choice] = result
            if any(c is None for c in pending.choices):
                continue
            asked = pending.row.body.get("model")  # a name of the model's, as the endpoints answer it
            named = asked if isinstance(asked, str) and asked in self.api.state.model_names else model
            a = openai_io.answer(pending.row, pending.choices, named, created, token_text, self.id)
            await self.api.io(self._record, journal, pending.row.line, pending.row.custom_id, a.ok, a.record,
                              a.prompt_tokens, a.completion_tokens, a.cached_tokens)

    async def _flush_often(self, journal: Journal) -> None:
        while True:
            await asyncio.sleep(FLUSH_EVERY_S)
            await self.api.io(journal.flush)

    async def _finish(self, ending: str, rows: list[Row | RowError]) -> None:
        """Write the outputs from the journal and record the end. Killed half-way, it is done
        again on restart (the batch is still finalizing or cancelling)."""
        api = self.api
        async with self.lock:
            self.finishing = True
        journal = await self._open_journal()
        done = await api.io(journal.done_lines)
        missing = [r for r in rows if r.line not in done]
        if ending == "expired" and not missing:  # the window ran out after every request had finished
            ending = "completed"
        if ending == "completed" and missing:  # the engine stopped under the batch: resume on restart
            log.warning("batch %s: %d requests did not run (the engine stopped); it resumes when the server "
                        "starts again", self.id, len(missing))
            return
        if ending == "completed":
            await api.update(self.id, status="finalizing", finalizing_at=int(time.time()))
        await api.io(self._record_failed, journal, [
            (r, refused_line(r, self.id) if isinstance(r, RowError) else unfinished_line(r, ending, self.id))
            for r in missing])
        batch = await api.ensure_files(self.id)
        sizes = await api.io(self._write_files, journal, batch["output_file_id"], batch["error_file_id"])
        at = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[ending]
        await self._record_end(batch, sizes, status=ending, **{at: int(time.time())})

    def _write_files(self, journal: Journal, output_id: str, error_id: str) -> dict[str, int]:
        """Both files, from the journal, in input order (on the io thread); their sizes."""
        journal.flush()
        sizes = {}
        for file_id, ok in ((output_id, True), (error_id, False)):
            size = 0

            def fill(f, ok=ok) -> None:
                nonlocal size
                for _, row_ok, record in journal.records():
                    if row_ok == ok:
                        data = record.encode("utf-8") + b"\n"
                        f.write(data)
                        size += len(data)
            write_atomic(self.api.dir.file_path(file_id), fill)
            sizes[file_id] = size
        return sizes


def _errors(data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", "data": data}


def state_detail(batch: dict[str, Any]) -> str:
    """What a log line says beside a batch's state: its counts, or why it failed."""
    if batch.get("status") == "failed" and batch.get("errors"):
        data = (batch["errors"] or {}).get("data") or []
        first = data[0].get("message") if data else None
        return f": {first}" + (f" (and {len(data) - 1} more errors)" if len(data) > 1 else "") if first else ""
    c = batch.get("request_counts") or {}
    if not c.get("total"):
        return ""
    counts = f"{c.get('completed', 0)} completed, {c.get('failed', 0)} failed of {c['total']} requests"
    return f" ({counts})"
