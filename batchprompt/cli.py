"""The `batchprompt` command line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path

EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STORAGE = 3  # the journal or an output could not be written (a full disk); resumable
EXIT_TERMINATED = 143  # SIGTERM, as a shell reports it (128 + 15); resumable

RUN_HELP = """\
Run every row of INPUT through the model and write one result per row.

INPUT formats (by extension; '-' reads JSONL from stdin):
  .jsonl   OpenAI Batch API lines {"custom_id", "method": "POST", "url": "/v1/chat/completions"
           or "/v1/completions", "body": {...}}, or plain lines {"prompt": ...} / {"messages": [...]}
           with an optional "id"
  .csv     with --column naming the prompt column
  .parquet with --column (needs pyarrow)

OUTPUT: OpenAI batch output lines {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}, in input order; '-' writes stdout. Failed rows go to the errors file
(default OUTPUT.errors.jsonl) with their input line. With CSV/Parquet input, --format table
writes the input table with "result" and "error" columns.

Structured output: a body's response_format ({"type": "json_schema", "json_schema": {"schema":
...}} or {"type": "json_object"}), or vLLM's guided_choice / guided_regex / guided_json /
guided_grammar or structured_outputs {"choice"|"regex"|"json"|"grammar": ...}; --choices,
--regex and --json-schema apply to rows that ask for none. An answer cut by max_tokens before it
completed its constraint is an error for that row.

The job is journaled (OUTPUT.journal, SQLite): after a crash, Ctrl-C, SIGTERM or kill -9, run
the same command again to resume: only unfinished rows run. One run at a time per journal: a
second run of the same job exits 2, naming the one that holds it. Exit status: 0 all rows ok,
1 some rows failed, 2 bad input or options (nothing run), 3 the journal or an output could not be
written, e.g. a full disk (resumable), 130 interrupted by Ctrl-C, 143 stopped by SIGTERM
(both resumable).
"""


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="batchprompt", description="Run a language model over many prompts.")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a file of prompts (resumable)", description=RUN_HELP,
                         formatter_class=argparse.RawDescriptionHelpFormatter)
    run.add_argument("input", metavar="INPUT", help="input file, or - for stdin (JSONL)")
    run.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="output file, or - for stdout")
    run.add_argument("--model", default=None,
                     help="a .gguf file, a local Hugging Face directory, a hub id (default: the embedded SmolLM2-135M)")
    run.add_argument("--system", default=None, help="system prompt for rows that have none")
    run.add_argument("--max-tokens", type=int, default=256, metavar="N",
                     help="tokens to generate when a row's body gives no max_tokens (default 256)")
    run.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="when a row's body gives none (default 0: greedy)")
    run.add_argument("--seed", type=int, default=None, metavar="N", help="when a row's body gives none")
    run.add_argument("--errors", default=None, metavar="ERRORS", help="errors file (default OUTPUT.errors.jsonl)")
    run.add_argument("--column", default=None, metavar="C", help="prompt column of CSV/Parquet input")
    run.add_argument("--format", default="openai", choices=["openai", "table"],
                     help="output shape: OpenAI batch lines (default) or the input table plus a result column")
    run.add_argument("--journal", default=None, help="journal file (default OUTPUT.journal)")
    run.add_argument("--dry-run", action="store_true",
                     help="count rows and prompt tokens and estimate the run time from a short calibration")
    run.add_argument("--restart", action="store_true", help="discard the journal and start over")
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--choices", default=None, metavar="A,B,...",
                     help="answer with exactly one of these labels (comma-separated, or a JSON list)")
    run.add_argument("--choice-mode", default=None, choices=["decode", "score"],
                     help="how --choices picks a label: constrained decoding (default) or the "
                          "log-likelihood of each label (also gives each label's probability)")
    run.add_argument("--regex", default=None, metavar="RE", help="every answer matches this regular expression")
    run.add_argument("--json-schema", default=None, metavar="FILE|JSON",
                     help="every answer is JSON valid against this schema (a file or inline JSON)")
    run.add_argument("--max-num-seqs", type=int, default=None, help="engine: sequences run at once (default 512)")
    run.add_argument("--kv-cache-memory", type=int, default=None, metavar="BYTES",
                     help="engine: KV cache ceiling in bytes (default: a quarter of free memory)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="batchprompt: %(levelname)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    from .jobs import InputError, JobOptions, JournalMismatch, run_job
    from .jobs.lock import JournalBusy
    from .jobs.sigterm import sigterm_as_interrupt
    from .jobs.storage import StorageError
    from .models import ModelNotFoundError

    if args.max_tokens < 1:
        return _fail(f"--max-tokens must be >= 1, got {args.max_tokens}")
    from .engine import SamplingParams
    try:  # the engine's own checks (NaN, inf from 1e400, negative, a seed beyond 64 bits), before any work
        SamplingParams(temperature=args.temperature, seed=args.seed)
    except (TypeError, ValueError) as e:
        return _fail(f"--temperature {args.temperature} / --seed {args.seed}: {e}")
    try:
        structured = _structured_options(args)
    except ValueError as e:
        return _fail(str(e))
    engine_options = {k: v for k, v in (("max_num_seqs", args.max_num_seqs),
                                        ("kv_cache_memory", args.kv_cache_memory)) if v is not None}
    opts = JobOptions(input=args.input, output=args.output, errors=args.errors, model=args.model,
                      system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                      seed=args.seed, column=args.column, format=args.format, dry_run=args.dry_run,
                      restart=args.restart, progress=not args.no_progress, journal=args.journal,
                      engine_options=engine_options, structured=structured)
    try:
        with sigterm_as_interrupt():
            summary = run_job(opts)
    except (InputError, ModelNotFoundError, JournalMismatch, JournalBusy) as e:
        return _fail(str(e))
    except StorageError as e:
        print(f"batchprompt: error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    except KeyboardInterrupt as e:  # during loading: nothing computed yet
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"\n{'stopped by SIGTERM' if signum == signal.SIGTERM else 'interrupted'} before any row ran",
              file=sys.stderr)
        return _interrupted_exit(signum)
    print(summary, file=sys.stderr)
    if summary.interrupted:
        return _interrupted_exit(summary.interrupted_by)
    return EXIT_ROWS_FAILED if summary.failed else EXIT_OK


def _interrupted_exit(signum: int) -> int:
    return EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED


def _structured_options(args: argparse.Namespace) -> dict:
    """--choices / --choice-mode / --regex / --json-schema as OutputSpec keywords, checked now."""
    from .api.structured import OutputSpec

    opts: dict = {}
    if args.choices is not None:
        text = args.choices.strip()
        if text.startswith("["):
            try:
                opts["choices"] = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"--choices {args.choices}: not a valid JSON list ({e}); give a JSON list "
                                 f"such as '[\"spam\", \"ham\"]' or comma-separated labels such as spam,ham") from None
        else:
            opts["choices"] = [c.strip() for c in text.split(",")]
    if args.choice_mode is not None:
        opts["choice_mode"] = args.choice_mode
    if args.regex is not None:
        opts["regex"] = args.regex
    if args.json_schema is not None:
        source = args.json_schema
        if not source.lstrip().startswith("{"):
            try:
                source = Path(source).read_text()
            except OSError as e:
                raise ValueError(f"--json-schema {args.json_schema}: cannot read it ({e.strerror}); "
                                 f"give a file or inline JSON") from None
        try:
            opts["json_schema"] = json.loads(source)
        except json.JSONDecodeError as e:
            raise ValueError(f"--json-schema {args.json_schema}: not valid JSON ({e})") from None
    try:
        OutputSpec.from_options(**opts)
    except ValueError as e:
        raise ValueError(f"structured output: {e}") from None
    return opts


def _fail(message: str) -> int:
    print(f"batchprompt: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
