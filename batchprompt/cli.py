"""The `batchprompt` command line."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
from pathlib import Path

EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
EXIT_STORAGE = 3  # the journal or an output could not be written (a full disk); resumable
EXIT_TERMINATED = 143  # SIGTERM, as a shell reports it (128 + 15); resumable
EXIT_BROKEN_PIPE = 141  # the reader of -o - closed it (128 + SIGPIPE), as `cmd | head` ends cmd

RUN_HELP = """\
Run every row of INPUT through the model and write one result per row.

INPUT formats (by extension; '-' reads JSONL from stdin):
  .jsonl   OpenAI Batch API lines {"custom_id", "method": "POST", "url": "/v1/chat/completions"
           or "/v1/completions", "body": {...}}, or plain lines {"prompt": ...} / {"messages": [...]}
           with an optional "id"
  .csv     with --column naming the prompt column
  .tsv     likewise, tab-separated, no quoting (each line one row)
  .parquet with --column (needs pyarrow)

OUTPUT: OpenAI batch output lines {"id", "custom_id", "response": {"status_code", "request_id",
"body"}, "error"}, in input order; '-' writes stdout. Failed rows go to the errors file
(default OUTPUT.errors.jsonl) with their input line. With CSV/Parquet input, --format table
writes the input table with "result", "finish_reason" and "error" columns.

Structured output: a body's response_format ({"type": "json_schema", "json_schema": {"schema":
...}} or {"type": "json_object"}), or vLLM's guided_choice / guided_regex / guided_json /
guided_grammar or structured_outputs {"choice"|"regex"|"json"|"grammar": ...}; --choices,
--regex and --json-schema apply to rows that ask for none. An answer cut by max_tokens before it
completed its constraint is written as OpenAI and vLLM give it: the partial text with
finish_reason "length" (check it before parsing).

The job is journaled (OUTPUT.journal, SQLite): after a crash, Ctrl-C, SIGTERM or kill -9, run
the same command again to resume: only unfinished rows run. One run at a time per journal: a
second run of the same job exits 2, naming the one that holds it. Exit status: 0 all rows ok,
1 some rows failed, 2 bad input or options (nothing run), 3 the journal or an output could not be
written, e.g. a full disk (resumable), 130 interrupted by Ctrl-C, 143 stopped by SIGTERM
(both resumable), 141 the reader of -o - closed the pipe early (`| head`).
"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Option help wrapped between words only: an example such as --max-num-seqs 64 stays whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    ap = argparse.ArgumentParser(prog="batchprompt", description="Run a language model over many prompts.")
    ap.add_argument("--version", action="version", version=f"batchprompt {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a file of prompts (resumable)", description=RUN_HELP,
                         formatter_class=_HelpFormatter)
    run.add_argument("input", metavar="INPUT", help="input file, or - for stdin (JSONL)")
    run.add_argument("-o", "--output", required=True, metavar="OUTPUT", help="output file, or - for stdout")
    run.add_argument("--model", default=None,
                     help="a .gguf file, a local Hugging Face directory, a hub id (default: the embedded SmolLM2-135M); "
                          "with --endpoints, the name the servers serve it under")
    run.add_argument("--system", default=None, help="system prompt for rows that have none")
    run.add_argument("--max-tokens", type=int, default=256, metavar="N",
                     help="tokens to generate when a row's body gives no max_tokens (default 256)")
    run.add_argument("--temperature", type=float, default=0.0, metavar="T",
                     help="when a row's body gives none (default 0: greedy)")
    run.add_argument("--seed", type=int, default=None, metavar="N", help="when a row's body gives none")
    run.add_argument("--errors", default=None, metavar="ERRORS", help="errors file (default OUTPUT.errors.jsonl)")
    run.add_argument("--column", default=None, metavar="C", help="prompt column of CSV/Parquet input")
    run.add_argument("--format", default="openai", choices=["openai", "table"],
                     help="output shape: OpenAI batch lines (default) or the input table plus result, "
                          "finish_reason and error columns")
    run.add_argument("--journal", default=None,
                     help="journal file (default OUTPUT.journal; with -o -, a file named by the job's input and "
                          "options under $BATCHPROMPT_CACHE or ~/.cache/batchprompt/jobs, which stays there: "
                          "the same pipe run again prints the journaled results)")
    run.add_argument("--dry-run", action="store_true",
                     help="count rows and prompt tokens and estimate the run time from a short calibration: a "
                          "tenth of the rows (4 to 64) run and are not kept (with --endpoints, on the servers)")
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
    add_hardware_arguments(run.add_argument_group("model and hardware"), "a longer row fails alone")
    add_ray_arguments(run.add_argument_group("Ray (engine replicas on a Ray cluster; pip install 'batchprompt[ray]')"))
    add_endpoint_arguments(run.add_argument_group("remote endpoints (OpenAI-compatible servers: vLLM, SGLang, "
                                                  "batchprompt serve)"))
    from .server.command import add_parser as add_serve_parser  # imports no web framework yet
    add_serve_parser(sub)
    return ap



def add_hardware_arguments(hw, too_long: str) -> None:
    """The engine's model and hardware options, shared by `run` and `serve` (`too_long`: what
    happens to a prompt longer than --max-model-len)."""
    hw.add_argument("--device", default="auto", metavar="DEVICE",
                    help="where the model runs: auto (a CUDA GPU when one is visible, else the CPU), cpu, cuda, "
                         "or cuda:N for GPU N (default auto); e.g. --device cuda:1")
    hw.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="precision of the weights and KV cache (default auto: bfloat16 where the hardware "
                         "supports it, else float32); e.g. --dtype float32")
    hw.add_argument("--max-model-len", type=int, default=None, metavar="N",
                    help="context length in tokens, prompt plus answer (default: the model's own, also the "
                         f"most); {too_long} (context_length_exceeded); e.g. --max-model-len 4096")
    hw.add_argument("--kv-cache-memory", default=None, metavar="SIZE",
                    help="KV cache ceiling: bytes with a unit (4GiB, 512MB, 1.5G; K/M/G/T alone are binary), "
                         "plain bytes, or a share of free memory (0.3 or 30%%; default 25%%); the cache grows "
                         "to what the work needs, up to it; e.g. --kv-cache-memory 8GiB")
    hw.add_argument("--max-num-seqs", type=int, default=None, metavar="N",
                    help="sequences run at once (default 512); e.g. --max-num-seqs 64")


def add_endpoint_arguments(g) -> None:
    g.add_argument("--endpoints", default=None, metavar="HOSTFILE|URL",
                   help="run on these servers instead of a local engine: a file of one endpoint a line (host:port, "
                        "'host port' or a URL; # comments; weight=2 tags), or the servers' URLs themselves, joined "
                        "by commas (http://127.0.0.1:8000/v1); --model names the served model (default: the one "
                        "they serve)")
    g.add_argument("--api-key", default=None, metavar="KEY",
                   help="the servers' API key (default: $BATCHPROMPT_API_KEY, then $OPENAI_API_KEY, if set)")
    g.add_argument("--give-up-after", type=float, default=None, metavar="SECONDS",
                   help="while no endpoint answers, rows wait this long for one to come back, then fail "
                        "with the endpoints' faults in the errors file (default 120)")
    g.add_argument("--request-timeout", type=float, default=None, metavar="SECONDS",
                   help="a request that a server has not answered in this long is tried again (elsewhere where "
                        "another server is up); a row fails after 5 tries (default 300)")
    g.add_argument("--tokenizer", default=None, metavar="NAME",
                   help="the model's tokenizer, which renders the prompts here: a .gguf file, a local Hugging Face "
                        "directory, smollm2-135m, or a hub id (default: the served model's name)")


def _endpoint_pool(args: argparse.Namespace):
    """The EndpointPool of --endpoints; None without it (ValueError: a bad hostfile, no server)."""
    flags = {"--api-key": args.api_key, "--give-up-after": args.give_up_after,
             "--request-timeout": args.request_timeout, "--tokenizer": args.tokenizer}
    if args.endpoints is None:
        for flag, value in flags.items():
            if value is not None:
                raise ValueError(f"{flag} needs --endpoints")
        return None
    # The servers' own choices: ignored here, they would only have locked the journal (--dtype).
    local = {"--device": args.device != "auto", "--dtype": args.dtype != "auto",
             "--kv-cache-memory": args.kv_cache_memory is not None, "--max-num-seqs": args.max_num_seqs is not None}
    for flag, given in local.items():
        if given:
            raise ValueError(f"{flag} sets up a local engine; with --endpoints the servers run the model as they "
                             f"were started: leave {flag} out (or give it to the servers)")
    from .remote import EndpointPool, PoolError

    for flag in ("--give-up-after", "--request-timeout"):
        value = flags[flag]
        if value is not None and not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag} must be a finite number of seconds > 0, got {value:g}")
    key = args.api_key or os.environ.get("BATCHPROMPT_API_KEY") or os.environ.get("OPENAI_API_KEY") or None
    options = {name: value for name, value in (("give_up_after", args.give_up_after), ("timeout", args.request_timeout),
                                                ("tokenizer", args.tokenizer)) if value is not None}
    try:
        pool = EndpointPool(args.endpoints, model=args.model, api_key=key, max_model_len=args.max_model_len,
                            **options)
    except PoolError as e:
        raise ValueError(f"--endpoints {args.endpoints}: {e}") from None
    try:
        pool.tokenizer  # now: a tokenizer that cannot load is an error before any work, not a traceback
    except PoolError as e:
        pool.close()
        raise ValueError(str(e)) from None
    return pool


def add_ray_arguments(g) -> None:
    g.add_argument("--ray", action="store_true",
                   help="run the model as engine replicas on Ray (same outputs, journal and resume; a lost replica's "
                        "rows run again on the others)")
    g.add_argument("--address", default=None, metavar="ADDR",
                   help="the Ray cluster: auto (the one `ray start` runs on this machine), host:port of its head, or "
                        "ray://host:port (default: RAY_ADDRESS, else a cluster `ray start` runs here, else a new local Ray)")
    g.add_argument("--replicas", type=int, default=None, metavar="N", help="engine replicas (default 1)")
    g.add_argument("--replica-cpus", type=float, default=None, metavar="C",
                   help="CPUs Ray reserves per replica; also its torch threads, at least 1 (default 1; 0, as in "
                        "Ray: reserve none, so replicas beyond the CPUs share them)")
    g.add_argument("--replica-gpus", type=float, default=None, metavar="G",
                   help="GPUs per replica (1: one replica per GPU; default 0)")


def _ray_cluster(args: argparse.Namespace):
    """The RayCluster of --ray and its options; None without --ray (ValueError: a bad option)."""
    given = [f for f, v in (("--address", args.address), ("--replicas", args.replicas),
                            ("--replica-cpus", args.replica_cpus), ("--replica-gpus", args.replica_gpus)) if v is not None]
    if not args.ray:
        if given:
            raise ValueError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --ray")
        return None
    from .ray.cluster import RAY_MISSING, RayCluster, ray_available

    if not ray_available():
        raise ValueError(f"--ray: {RAY_MISSING}")
    opts = {k: v for k, v in (("address", args.address), ("replicas", args.replicas),
                              ("replica_cpus", args.replica_cpus), ("replica_gpus", args.replica_gpus)) if v is not None}
    try:
        return RayCluster(**opts)
    except ValueError as e:
        raise ValueError(f"--ray: {e}") from None


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args, unknown = ap.parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's ("usage: batchprompt [-h] ... {run,serve}")
        commands = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction))
        commands.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.WARNING, format="batchprompt: %(levelname)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.command == "serve":
        from .server.command import run as serve
        return serve(args)
    return run_command(args)


def run_command(args: argparse.Namespace) -> int:
    from .api.service import EngineOptionsConflict
    from .engine.config import EngineConfigError
    from .jobs import InputError, JobOptions, JournalMismatch, run_job
    from .jobs.lock import JournalBusy
    from .jobs.sigterm import sigterm_as_interrupt
    from .jobs.storage import StorageError
    from .models import ModelNotFoundError
    from .ray.cluster import ClusterError  # imports no Ray

    if args.max_tokens < 1:
        return _fail(f"--max-tokens must be >= 1, got {args.max_tokens}")
    from .engine import SamplingParams
    # The engine's own checks (NaN, inf from 1e400, negative, a seed beyond 64 bits), before any work.
    for flag, value in (("--temperature", args.temperature), ("--seed", args.seed)):
        try:
            SamplingParams(**{flag[2:]: value})
        except (TypeError, ValueError) as e:
            return _fail(f"{flag} {value}: {e}")
    try:
        structured = _structured_options(args)
    except ValueError as e:
        return _fail(str(e))
    try:
        if args.endpoints is not None and args.ray:  # before either starts (the pool waits for its servers)
            raise ValueError("give --endpoints or --ray, not both")
        if args.endpoints is not None and structured.get("choice_mode") == "score":  # before the pool's wait
            raise ValueError("--choice-mode score needs the engine's label scoring, which OpenAI-compatible "
                             "servers do not offer: leave --choice-mode out (decode) with --endpoints")
        cluster = _ray_cluster(args)
        with sigterm_as_interrupt(hold_after=True):  # Ctrl-C or SIGTERM while the pool waits for its servers
            pool = _endpoint_pool(args)
        if pool is not None:
            cluster, args.model = pool, pool.model  # the served model (also in the journal's fingerprint)
        # With --ray the device is the replicas' (checked there, where the GPUs are), not this machine's.
        device = _check_device(args.device) if cluster is None else args.device.strip().lower()
        engine_options = _engine_options(args, device if cluster is None else "auto")
    except ValueError as e:
        return _fail(str(e))
    except KeyboardInterrupt as e:  # while the pool waited for its servers: nothing computed yet
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"\n{'stopped by SIGTERM' if signum == signal.SIGTERM else 'interrupted'} before any row ran "
              f"(while waiting for the endpoints)", file=sys.stderr)
        return _interrupted_exit(signum)
    opts = JobOptions(input=args.input, output=args.output, errors=args.errors, model=args.model,
                      system=args.system, max_tokens=args.max_tokens, temperature=args.temperature,
                      seed=args.seed, column=args.column, format=args.format, dry_run=args.dry_run,
                      restart=args.restart, progress=not args.no_progress, journal=args.journal,
                      device=device, dtype=args.dtype, engine_options=engine_options, structured=structured,
                      cluster=cluster)
    try:
        with sigterm_as_interrupt(hold_after=True):  # a second signal, even as the summary prints: ignored
            summary = run_job(opts)
    except (InputError, ModelNotFoundError, JournalMismatch, JournalBusy, EngineConfigError,
            EngineOptionsConflict) as e:
        return _fail(str(e))
    except ClusterError as e:  # --ray: Ray cannot be reached, or no replica could start
        return _fail(str(e))
    except StorageError as e:
        print(f"batchprompt: error: {e}", file=sys.stderr)
        return EXIT_STORAGE
    except BrokenPipeError:  # `-o - | head -1`: the reader left (the journal keeps every row), as SIGPIPE ends a tool
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error flushing stdout at exit
        return EXIT_BROKEN_PIPE
    except KeyboardInterrupt as e:  # during loading: nothing computed yet
        signum = getattr(e, "signum", signal.SIGINT)
        print(f"\n{'stopped by SIGTERM' if signum == signal.SIGTERM else 'interrupted'} before any row ran",
              file=sys.stderr)
        return _interrupted_exit(signum)
    print(summary, file=sys.stderr)
    if summary.interrupted:
        return _interrupted_exit(summary.interrupted_by)
    # A dry run's status is the job's as it would end: rows that cannot run, or that failed before;
    # or every row it timed failed (a pool whose servers all fail: `--dry-run && run` went on).
    failed = summary.failed or summary.resumed_failed or summary.calibration_error
    return EXIT_ROWS_FAILED if failed else EXIT_OK


def _interrupted_exit(signum: int) -> int:
    return EXIT_TERMINATED if signum == signal.SIGTERM else EXIT_INTERRUPTED


def _check_device(text: str) -> str:
    """--device as the engine takes it. A GPU that is not there fails now, before any work."""
    import torch

    device = text.strip().lower()
    if device in ("auto", "cpu"):
        return device
    m = re.fullmatch(r"cuda(?::(\d+))?", device)
    if m is None:
        raise ValueError(f"--device {text}: not a device; give auto, cpu, cuda, or cuda:N for GPU N")
    if not torch.cuda.is_available():
        why = "this PyTorch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device {text}: {why}; use --device cpu (or auto)")
    count = torch.cuda.device_count()
    if m.group(1) is not None and int(m.group(1)) >= count:
        raise ValueError(f"--device {text}: there is no GPU {m.group(1)}; this machine shows {count} "
                         f"(cuda:0 to cuda:{count - 1})")
    return device


def _engine_options(args: argparse.Namespace, device: str) -> dict:
    """EngineConfig fields from --max-model-len, --kv-cache-memory and --max-num-seqs, checked now."""
    from .engine.config import EngineConfig

    opts: dict = {}
    if args.max_num_seqs is not None:
        if args.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {args.max_num_seqs}")
        opts["max_num_seqs"] = args.max_num_seqs
    if args.max_model_len is not None:
        if args.max_model_len < 2:  # a prompt of one token and one generated
            raise ValueError(f"--max-model-len must be >= 2 (tokens of prompt plus answer), got {args.max_model_len}")
        opts["max_model_len"] = args.max_model_len
    if args.kv_cache_memory is not None:
        opts.update(_kv_options(args.kv_cache_memory, device))
    EngineConfig(**opts)  # anything else the engine would refuse, refused now
    return opts


def _kv_options(text: str, device: str) -> dict:
    """--kv-cache-memory as EngineConfig's kv_cache_memory (bytes) or kv_memory_fraction."""
    from .device import available_memory, resolve_device
    from .units import format_bytes, parse_memory

    try:  # 0.95: EngineConfig's bound on the share; the rest is for the weights and activations
        size, fraction = parse_memory(text, max_fraction=0.95)
    except ValueError as e:
        raise ValueError(f"--kv-cache-memory {e}") from None
    if size is None:
        return {"kv_memory_fraction": fraction}
    dev = resolve_device(device)
    free = available_memory(dev)
    if size > free:  # not refused: the cache grows only as far as the work needs
        logging.getLogger("batchprompt").warning("--kv-cache-memory %s is more than the %s free on %s now; a "
                                                 "large job may run out of memory", text, format_bytes(free), dev)
    return {"kv_cache_memory": size}


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
        if args.choices is None:  # it picks among --choices' labels: alone it would do nothing, unsaid
            raise ValueError(f"--choice-mode {args.choice_mode} needs --choices (the labels it picks from); "
                             f"give --choices A,B,... with it, or leave --choice-mode out")
        opts["choice_mode"] = args.choice_mode
    if args.regex is not None:
        opts["regex"] = args.regex
    if args.json_schema is not None:
        source = args.json_schema
        if not source.lstrip().startswith("{") and source.strip() not in ("true", "false"):  # JSON Schema's booleans
            try:
                source = Path(source).read_text()
            except OSError as e:
                try:  # inline JSON that is not an object: `[]` said "No such file or directory"
                    json.loads(source)
                except ValueError:
                    raise ValueError(f"--json-schema {args.json_schema}: cannot read it ({e.strerror}); "
                                     f"give a file or inline JSON") from None
                raise ValueError(f"--json-schema {args.json_schema}: a JSON schema is a JSON object "
                                 f"('{{\"type\": ...}}'), inline or in a file") from None
        from .jobs.rows import json_loads

        try:
            opts["json_schema"] = json_loads(source)  # nested too deeply: this error, not a RecursionError
        except json.JSONDecodeError as e:
            if e.msg.startswith("nested too deeply"):  # valid JSON, too deep for the parser ("line 1 column 1")
                raise ValueError(f"--json-schema {args.json_schema}: nested too deeply for the JSON parser; for a "
                                 f"recursive structure, refer to a definition with $ref") from None
            raise ValueError(f"--json-schema {args.json_schema}: not valid JSON ({e})") from None
    try:
        OutputSpec.from_options(**opts)
    except ValueError as e:
        # Named as the command line gave it: "bad regex (fix it): ..." is --regex's
        flag = {"regex": "--regex", "json_schema": "--json-schema", "choices": "--choices"}
        given = " and ".join(flag[k] for k in opts if k in flag)
        raise ValueError(f"{given or 'structured output'}: {e}") from None
    return opts


def _fail(message: str) -> int:
    print(f"batchprompt: error: {message}", file=sys.stderr)
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
