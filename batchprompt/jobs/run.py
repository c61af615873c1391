"""run_job: a file of prompts through the shared engine, journaled, resumable, in OpenAI's shapes."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..api.batch import Batch, Prepared
from ..api.result import Result
from ..api.structured import OutputSpec
from ..api.service import EngineService, get_service
from ..engine import SamplingParams
from ..models.tokenizer import cache_dir
from . import openai_io
from .journal import Journal
from .rows import CHAT, InputError, Row, RowError, Table, read_input

log = logging.getLogger("batchprompt")


@dataclass
class JobOptions:
    input: str
    output: str
    errors: str | None = None  # default: OUTPUT.errors.jsonl
    model: str | None = None
    system: str | None = None  # for rows without a system message
    max_tokens: int = 256  # when a body gives none
    temperature: float = 0.0  # when a body gives none (greedy: see the README)
    seed: int | None = None
    column: str | None = None
    format: str = "openai"  # or "table" for CSV/Parquet input
    dry_run: bool = False
    restart: bool = False
    progress: bool = True
    journal: str | None = None  # default: OUTPUT.journal (or the cache, for stdout)
    calibration_rows: int = 64
    engine_options: dict = field(default_factory=dict)
    # Structured output for rows whose body asks for none (OutputSpec.from_options keywords).
    structured: dict = field(default_factory=dict)


@dataclass
class JobSummary:
    rows: int = 0
    ok: int = 0
    failed: int = 0
    resumed: int = 0  # rows already in the journal when this run began
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    interrupted: bool = False
    already_complete: bool = False
    estimate_seconds: float | None = None  # --dry-run

    def __str__(self) -> str:
        if self.estimate_seconds is not None:
            return (f"dry run: {self.rows} rows ({self.failed} unreadable), {self.prompt_tokens:,} prompt "
                    f"tokens; estimated run time {_duration(self.estimate_seconds)}")
        if self.already_complete:
            return (f"{self.rows} rows: {self.ok} ok, {self.failed} failed, all from an earlier run; "
                    f"{self.prompt_tokens:,} prompt and {self.completion_tokens:,} generated tokens")
        rate = self.completion_tokens / self.seconds if self.seconds else 0.0
        return (f"{self.rows} rows: {self.ok} ok, {self.failed} failed"
                f"{f' ({self.resumed} from an earlier run)' if self.resumed else ''}; "
                f"{self.prompt_tokens:,} prompt and {self.completion_tokens:,} generated tokens "
                f"in {_duration(self.seconds)} ({rate:,.0f} tok/s); prefix-cache hit "
                f"{self.prefix_cache_hit_rate:.0%}")


def _duration(s: float) -> str:
    return f"{s:.1f}s" if s < 120 else f"{s / 60:.1f} min"


def default_errors_path(output: str) -> str | None:
    return None if output == "-" else output + ".errors.jsonl"


def fingerprint(raw: bytes, opts: JobOptions) -> str:
    h = hashlib.sha256(raw)
    h.update(json.dumps([opts.model, opts.system, opts.max_tokens, opts.temperature, opts.seed,
                         opts.column, opts.format, opts.structured], sort_keys=True).encode())
    return h.hexdigest()


def check_writable(path: str) -> None:
    if path == "-":
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise InputError(f"{path}: cannot write the output there: the folder {parent} does not exist")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".batchprompt-check-"):
            pass
    except OSError as e:
        raise InputError(f"{path}: cannot write the output there ({e.strerror})") from e


# ---- request building ---------------------------------------------------------------------------
@dataclass
class Pending:
    row: Row
    n: int
    choices: list[Result | None]


def row_spec(row: Row, opts: JobOptions) -> OutputSpec | None:
    """The row's structured output: OpenAI's response_format, vLLM's guided_* fields or its
    structured_outputs object; the command's --choices/--regex/--json-schema when none."""
    b = row.body
    so = b.get("structured_outputs") or {}
    if not isinstance(so, dict):
        raise ValueError("structured_outputs must be an object such as {\"choice\": [...]}")
    asked = {"choices": b.get("guided_choice", so.get("choice")), "regex": b.get("guided_regex", so.get("regex")),
             "json_schema": b.get("guided_json", so.get("json")),
             "grammar": b.get("guided_grammar", so.get("grammar")), "response_format": b.get("response_format")}
    if all(v is None for v in asked.values()):
        asked = {k: v for k, v in opts.structured.items() if k != "choice_mode"}
    return OutputSpec.from_options(choice_mode=b.get("choice_mode", opts.structured.get("choice_mode")), **asked)


def row_params(row: Row, opts: JobOptions) -> tuple[SamplingParams, int]:
    """The row's sampling parameters: its body's fields, the command's options as defaults."""
    b = row.body
    max_tokens = b.get("max_completion_tokens", b.get("max_tokens")) or opts.max_tokens
    temperature = b.get("temperature", opts.temperature)
    seed = b.get("seed", opts.seed)
    n = b.get("n", 1) or 1
    if not isinstance(n, int) or not 1 <= n <= 128:
        raise ValueError(f"n must be an integer from 1 to 128, got {n!r}")
    stop = b.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=float(temperature if temperature is not None else opts.temperature),
        top_p=float(b.get("top_p") if b.get("top_p") is not None else 1.0), top_k=int(b.get("top_k") or 0),
        seed=seed, stop=tuple(stop), logprobs=bool(b.get("logprobs")))
    return params, n


def render(row: Row, tokenizer, system: str | None) -> list[int]:
    """Chat rows through the chat template (with `system` when they have none); completion
    rows as raw text."""
    if row.url == CHAT:
        return tokenizer.encode_prompt(row.messages, system)
    return tokenizer.encode(row.prompt)


class JobRun:
    def __init__(self, opts: JobOptions, out=None):
        self.opts = opts
        self.out = out or sys.stderr  # where a person reads progress and the summary

    def say(self, message: str) -> None:
        print(message, file=self.out, flush=True)

    # ---- the job ----------------------------------------------------------------------------
    def run(self) -> JobSummary:
        opts = self.opts
        table = read_input(opts.input, opts.column)  # a missing or unreadable input fails here
        if opts.format == "table" and table.format == "jsonl":
            raise InputError("--format table applies to CSV and Parquet input; JSONL input gives OpenAI lines")
        if opts.format not in ("openai", "table"):
            raise InputError(f"--format must be 'openai' or 'table', got {opts.format!r}")
        errors_path = opts.errors or default_errors_path(opts.output)
        check_writable(opts.output)
        if errors_path:
            check_writable(errors_path)
        from ..models import resolve_model
        model_source = resolve_model(opts.model)  # an unknown model fails before any work
        self.model_path = str(model_source.path)  # resolved once (a hub id is not looked up again)

        if opts.dry_run:
            return self.dry_run(table)
        fp = fingerprint(table.raw, opts)
        journal_path = opts.journal or (cache_dir() / "jobs" / f"{fp[:16]}.sqlite" if opts.output == "-"
                                        else opts.output + ".journal")
        journal = Journal(journal_path, fp, restart=opts.restart)
        try:
            return self._run(table, journal, model_source.name, errors_path)
        finally:
            journal.close()

    def _run(self, table: Table, journal: Journal, model_name: str, errors_path: str | None) -> JobSummary:
        opts = self.opts
        summary = JobSummary(rows=len(table.rows))
        done = journal.done_lines()
        summary.resumed = len(done)
        if journal.get("complete") == "1" and len(done) == len(table.rows) and self._outputs_exist(errors_path):
            summary.ok, _ = journal.counts()
            summary.failed = summary.rows - summary.ok
            summary.already_complete = True
            summary.prompt_tokens, summary.completion_tokens = journal.token_counts()
            where = "written again to stdout from the journal" if opts.output == "-" else f"in {opts.output}"
            self.say(f"already complete: {summary.rows} rows {where} (journal {journal.path}); nothing "
                     f"to run (use --restart to run it again)")
            if opts.output == "-":
                self._write_outputs(table, journal, errors_path)
            return summary
        if done:
            self.say(f"resuming: {len(done)} of {len(table.rows)} rows are already done (journal {journal.path})")
        for r in table.rows:  # unreadable rows are answered now
            if isinstance(r, RowError) and r.line not in done:
                journal.record(r.line, r.custom_id, False, openai_io.row_error_line(r))
                done.add(r.line)
        todo = [r for r in table.rows if isinstance(r, Row) and r.line not in done]

        interrupted = False
        t0 = time.perf_counter()
        if todo:
            service = get_service(self.model_path, engine_options=opts.engine_options)
            self.say(f"model {model_name} ready in {time.perf_counter() - t0:.1f}s; {len(todo)} rows to run")
            t0 = time.perf_counter()
            stats0 = _stats_snapshot(service)
            interrupted = self._compute(service, todo, journal, model_name, len(table.rows), len(done),
                                        sum(isinstance(r, RowError) for r in table.rows))
            s = service.engine.stats
            pt, cached = s.prompt_tokens - stats0[0], s.cached_prompt_tokens - stats0[1]
            summary.prefix_cache_hit_rate = cached / pt if pt else 0.0
        journal.flush()
        summary.seconds = time.perf_counter() - t0
        ok, total = journal.counts()
        summary.ok, summary.failed = ok, total - ok
        summary.prompt_tokens, summary.completion_tokens = journal.token_counts()
        if interrupted:
            summary.interrupted = True
            self.say(f"\ninterrupted: {total} of {len(table.rows)} rows are done and kept in {journal.path}. "
                     f"Run the same command again to resume.")
            return summary
        journal.set("complete", "1")
        self._write_outputs(table, journal, errors_path)
        return summary

    def _outputs_exist(self, errors_path: str | None) -> bool:
        return self.opts.output == "-" or (Path(self.opts.output).is_file() and
                                           (errors_path is None or Path(errors_path).is_file()))

    def _prepare(self, service: EngineService, todo: list[Row], journal: Journal | None):
        """Flat items for the batch (n per row, identical deterministic requests once each)."""
        tok = service.engine.tokenizer
        items: list[Prepared] = []
        owners: list[list[tuple[Pending, int]]] = []  # per item: (row, choice index) it answers
        shared: dict[str, int] = {}
        for row in todo:
            try:
                params, n = row_params(row, self.opts)
                spec = row_spec(row, self.opts)
                if spec is not None:
                    params = spec.sampling_params(params, tok)
                ids = render(row, tok, self.opts.system)
            except (TypeError, ValueError, KeyError) as e:
                if journal is not None:
                    journal.record(row.line, row.custom_id, False, openai_io.error_line(
                        row.line, row.custom_id, "invalid_request", f"line {row.line}: {e}"))
                continue
            p = Pending(row, n, [None] * n)
            for choice in range(n):
                cp = params
                if n > 1 and params.seed is not None:
                    cp = SamplingParams(**{**asdict(params), "seed": params.seed + choice})
                deterministic = cp.greedy or cp.seed is not None
                key = json.dumps([ids, asdict(cp), choice if not cp.greedy else 0]) if deterministic else None
                if key is not None and key in shared:
                    owners[shared[key]].append((p, choice))
                    continue
                if key is not None:
                    shared[key] = len(items)
                items.append(Prepared(len(items), ids, cp, spec=spec))
                owners.append([(p, choice)])
        return items, owners

    def dry_run(self, table: Table) -> JobSummary:
        """Count rows and prompt tokens; time a short calibration run; estimate the whole job."""
        opts = self.opts
        rows = [r for r in table.rows if isinstance(r, Row)]
        summary = JobSummary(rows=len(table.rows), failed=len(table.rows) - len(rows))
        service = get_service(self.model_path, engine_options=opts.engine_options)
        tok = service.engine.tokenizer
        for r in rows:
            try:
                summary.prompt_tokens += len(render(r, tok, opts.system))
            except (TypeError, ValueError, KeyError):
                summary.failed += 1
        sample = rows[:opts.calibration_rows]
        items, _ = self._prepare(service, sample, None)
        t0 = time.perf_counter()
        Batch(service, items).wait()
        per_row = (time.perf_counter() - t0) / max(len(sample), 1)
        summary.estimate_seconds = per_row * len(rows)
        summary.seconds = time.perf_counter() - t0
        self.say(f"calibration: {len(sample)} rows in {summary.seconds:.1f}s; larger batches run faster per "
                 f"row, so the estimate is an upper bound")
        return summary

    def _compute(self, service: EngineService, todo: list[Row], journal: Journal, model_name: str,
                 total_rows: int, done_rows: int, errors: int = 0) -> bool:
        items, owners = self._prepare(service, todo, journal)
        bar = None
        if self.opts.progress:
            from tqdm import tqdm
            bar = tqdm(total=total_rows, initial=done_rows, unit="row", dynamic_ncols=True, file=self.out,
                       smoothing=0.1)
        batch = Batch(service, items)
        created = openai_io.now()
        tok = service.engine.tokenizer
        token_text = lambda t: tok.decode([t])  # noqa: E731
        tokens = 0
        t0 = time.perf_counter()
        try:
            for index, result in batch:
                for p, choice in owners[index]:
                    p.choices[choice] = result
                    if any(c is None for c in p.choices):
                        continue
                    failed = next((c for c in p.choices if c.error is not None), None)
                    if failed is not None:
                        errors += 1
                        code = "context_length_exceeded" if "shorten the prompt" in failed.error else "request_failed"
                        journal.record(p.row.line, p.row.custom_id, False, openai_io.error_line(
                            p.row.line, p.row.custom_id, code, f"line {p.row.line}: {failed.error}"))
                    else:
                        body = openai_io.response_body(p.row, p.choices, model_name, created, token_text)
                        journal.record(p.row.line, p.row.custom_id, True, openai_io.output_line(p.row, body),
                                       body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"])
                    tokens += sum(c.usage.completion_tokens for c in p.choices)
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix_str(f"{tokens / (time.perf_counter() - t0):,.0f} tok/s, {errors} errors",
                                            refresh=False)
        except KeyboardInterrupt:
            batch.cancel()
            return True
        finally:
            journal.flush()
            if bar is not None:
                bar.close()
        return False

    # ---- outputs ----------------------------------------------------------------------------
    def _write_outputs(self, table: Table, journal: Journal, errors_path: str | None) -> None:
        if self.opts.format == "table":
            self._write_table(table, journal)
            ok_lines = None
        else:
            ok_lines = (rec for _, ok, rec in journal.records() if ok)
        err_lines = (rec for _, ok, rec in journal.records() if not ok)
        if ok_lines is not None:
            _write_lines(self.opts.output, ok_lines)
        if errors_path:
            _write_lines(errors_path, err_lines)
        else:  # stdout output: errors go to stderr
            for rec in err_lines:
                print(rec, file=sys.stderr)

    def _write_table(self, table: Table, journal: Journal) -> None:
        import pyarrow as pa

        texts: dict[int, str | None] = {}
        errs: dict[int, str | None] = {}
        for line, ok, rec in journal.records():
            obj = json.loads(rec)
            texts[line] = _answer_text(obj) if ok else None
            errs[line] = None if ok else obj["error"]["message"]
        n = table.table.num_rows
        out = table.table.append_column("result", pa.array([texts.get(i) for i in range(1, n + 1)], pa.string()))
        out = out.append_column("error", pa.array([errs.get(i) for i in range(1, n + 1)], pa.string()))
        dest = self.opts.output
        tmp = dest + ".tmp" if dest != "-" else None
        if table.format == "parquet":
            import pyarrow.parquet as pq
            pq.write_table(out, tmp or sys.stdout.buffer)
        else:
            import pyarrow.csv as pacsv
            pacsv.write_csv(out, tmp or sys.stdout.buffer)
        if tmp:
            os.replace(tmp, dest)


def _answer_text(line: dict) -> str:
    body = line["response"]["body"]
    choice = body["choices"][0]
    return choice["message"]["content"] if body["object"] == "chat.completion" else choice["text"]


def _write_lines(path: str, records) -> None:
    """Write JSON lines atomically (temp file, fsync, rename), or to stdout for '-'."""
    if path == "-":
        for rec in records:
            sys.stdout.write(rec + "\n")
        sys.stdout.flush()
        return
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        for rec in records:
            f.write(rec + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _stats_snapshot(service: EngineService) -> tuple[int, int]:
    s = service.engine.stats
    return s.prompt_tokens, s.cached_prompt_tokens


def run_job(opts: JobOptions, out=None) -> JobSummary:
    return JobRun(opts, out).run()
