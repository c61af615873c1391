"""`batchprompt serve` (and `python -m batchprompt.server`): the OpenAI-compatible server.

Ctrl-C or SIGTERM stop it cleanly: new requests get 503, requests in flight are cancelled in
the engine (each answers 503, a stream ends with an error event), transfers still waiting on
their client are cut (transfers.py), async batches are cancelled, the engine is released, and
the command exits 0."""
from __future__ import annotations

import argparse
import logging
import os
import sys

SERVE_HELP = """\
Serve the model over HTTP, OpenAI-compatible: /v1/models, /v1/completions, /v1/chat/completions
(stream: true for server-sent events), OpenAI's Batch API (/v1/files, /v1/batches: durable, kept
in --data-dir, resumed after a restart), and the batch endpoints /v1/batch/sync, /v1/batch/async,
/v1/batch/{id}, /v1/batch/stats. /health, /ready and /metrics (Prometheus) need no key.

Every request, and every in-process caller of the same model, is batched by one engine.
Listens on 127.0.0.1 unless --host says otherwise; with --api-key (or $BATCHPROMPT_API_KEY)
every /v1 route needs the header Authorization: Bearer KEY. Ctrl-C or SIGTERM stop it: requests
in flight are cancelled (503; an upload still arriving a second later too, a download still
being sent 8 s later is cut), unfinished Batch API batches resume at the next start, and it
exits 0.
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    """The `serve` subcommand of the `batchprompt` command."""
    parser = subparsers.add_parser("serve", help="serve the model over HTTP (OpenAI-compatible)",
                                   description=SERVE_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .config import DEFAULT_BATCH_RETENTION_S, DEFAULT_MAX_BATCHES, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_FILE_BYTES

    p.add_argument("--model", default=None,
                   help="a .gguf file, a local Hugging Face directory, a hub id (default: the embedded SmolLM2-135M)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) a request's \"model\" may give, as vLLM's option: /v1/models lists each, "
                        "and an answer carries the one its request gave (the first where it gave none; default: "
                        "the model's own name, e.g. smollm2-135m)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require Authorization: Bearer KEY on /v1 routes (default: $BATCHPROMPT_API_KEY, if set)")
    p.add_argument("--data-dir", default=None, metavar="DIR",
                   help="where the Batch API keeps its files, batches and journals, across restarts (default "
                        "$XDG_DATA_HOME/batchprompt/server, i.e. ~/.local/share/batchprompt/server); one server "
                        "per directory")
    p.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES, metavar="N",
                   help=f"refuse Batch API uploads larger than this with 413 (default {DEFAULT_MAX_FILE_BYTES:,})")
    # The engine's options, as `batchprompt run` takes them (checked by the same code in cli.py).
    from ..cli import add_hardware_arguments
    add_hardware_arguments(p, "a longer request is refused with 400")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, metavar="N",
                   help=f"refuse request bodies larger than this with 413 (default {DEFAULT_MAX_BODY_BYTES:,})")
    p.add_argument("--batch-retention", type=float, default=DEFAULT_BATCH_RETENTION_S, metavar="SECONDS",
                   help=f"keep a finished async batch this long (default {DEFAULT_BATCH_RETENTION_S:.0f})")
    p.add_argument("--max-batches", type=int, default=DEFAULT_MAX_BATCHES, metavar="N",
                   help=f"keep at most this many async batches (default {DEFAULT_MAX_BATCHES})")
    p.add_argument("--priority-slowdown", default=None, metavar="X",
                   help="while chat and completion requests run beside Batch API rows or async batches, they "
                        "run inside the batch's long steps (paused between layers), and a step that carries "
                        "both stays within X times what they alone would take (default 2; 'off': neither, "
                        "chats wait for the step under way: the batch's throughput first)")
    p.add_argument("--no-priority", action="store_true",
                   help="run Batch API rows and async batches first come, first served with chat and "
                        "completion requests (by default those go first, without starving the batches)")
    p.add_argument("--allowed-origins", default="", metavar="ORIGINS",
                   help="web pages allowed to call the API from a browser (CORS), comma-joined, e.g. "
                        "http://localhost:3000, or '*' for any page (default: none; a browser page on another "
                        "origin cannot read the answers)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])


def run(args: argparse.Namespace) -> int:
    """Serve until Ctrl-C or SIGTERM (then 0); 2 for bad options or a model that cannot be found."""
    from ..cli import _check_device, _engine_options
    from ..models import ModelNotFoundError
    from .config import ServerConfig

    level = getattr(logging, args.log_level.upper())
    logging.basicConfig(level=level, format=LOG_FORMAT, datefmt=LOG_DATE)
    for handler in logging.getLogger().handlers:  # `batchprompt`'s main set up its own format first
        handler.setFormatter(logging.Formatter(LOG_FORMAT, LOG_DATE))
    logging.getLogger("batchprompt").setLevel(level)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        device = _check_device(args.device)
        engine_options = _engine_options(args, device)  # --max-model-len, --max-num-seqs, --kv-cache-memory
        engine_options.update(_priority_options(args))
        config = ServerConfig(model=args.model, served_model_names=tuple(args.served_model_name or ()),
                              host=args.host, port=args.port,
                              # --api-key "" (a variable that is not set, say) is refused, not taken as no
                              # key; so is a BATCHPROMPT_API_KEY set to "" (unset it to serve without one)
                              api_key=args.api_key if args.api_key is not None else
                              os.environ.get("BATCHPROMPT_API_KEY"),
                              data_dir=args.data_dir, device=device, dtype=args.dtype, engine_options=engine_options,
                              max_body_bytes=args.max_body_bytes, batch_retention_s=args.batch_retention,
                              max_batches=args.max_batches, max_file_bytes=args.max_file_bytes,
                              allowed_origins=tuple(o.strip().rstrip("/") for o in args.allowed_origins.split(",")
                                                    if o.strip()))
        return serve(config, args.log_level)
    except (ValueError, ModelNotFoundError) as e:
        return _fail(str(e))


def _priority_options(args: argparse.Namespace) -> dict:
    """EngineConfig fields from --no-priority and --priority-slowdown, checked now."""
    opts: dict = {}
    if args.no_priority:
        opts["priority_scheduling"] = False
    text = args.priority_slowdown
    if text is not None:
        if text.strip().lower() in ("off", "none"):
            opts["priority_slowdown"] = None
        else:
            try:
                value = float(text)
            except ValueError:
                value = float("nan")
            if not value > 1:
                raise ValueError(f"--priority-slowdown must be a number above 1 (e.g. 2) or 'off', got {text!r}")
            opts["priority_slowdown"] = value
    return opts


#: How long a stopping server waits for its engine thread to end after the HTTP side has closed.
ENGINE_STOP_S = 10.0
HURRIED_STOP_S = 2.0  # after a second Ctrl-C


def serve(config, log_level: str = "info") -> int:
    import uvicorn

    from ..api import shutdown
    from ..jobs.sigterm import sigterm_as_interrupt
    from .app import create_app
    from .lifecycle import Server
    from .state import ServerState

    log = logging.getLogger("batchprompt")
    state = ServerState(config)  # an unknown model fails here
    cannot = _cannot_listen(config.host, config.port)
    if cannot:  # before the model loads (a minute on a big one), not after
        return _fail(cannot)
    if config.api_key is None and not config.loopback:  # once it can listen there (not before an error)
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model",
                    config.host)
    log.info("loading %s", state.model_id)
    try:
        with sigterm_as_interrupt():  # Ctrl-C or SIGTERM while loading: stop, as cleanly
            state.load()
    except KeyboardInterrupt:
        print("batchprompt: stopped while loading the model", file=sys.stderr)
        shutdown(state.model_key)
        return 0
    app = create_app(config, state)
    server = Server(uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level,
                                   timeout_graceful_shutdown=30, lifespan="on", log_config=_uvicorn_log_config()),
                    state)
    try:
        server.run()
    finally:
        forced = _stop_engine(state.model_key, log, HURRIED_STOP_S if server.hurried else ENGINE_STOP_S)
    return 130 if forced or server.hurried else 0


#: A service's log lines carry the time, as vLLM's do (when a load, a stop or a batch's change of
#: state happened could not be told).
LOG_FORMAT = "%(asctime)s batchprompt: %(levelname)s: %(message)s"
LOG_DATE = "%Y-%m-%d %H:%M:%S"


def _uvicorn_log_config() -> dict:
    """uvicorn's own logging set-up, its lines (access lines too) with the time in front."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    config = copy.deepcopy(LOGGING_CONFIG)
    for formatter in config.get("formatters", {}).values():
        if "fmt" in formatter:
            formatter["fmt"] = "%(asctime)s " + formatter["fmt"]
            formatter["datefmt"] = LOG_DATE
    return config


def _stop_engine(model_key, log: logging.Logger, timeout: float = ENGINE_STOP_S) -> bool:
    """The engine's threads end and its memory is freed; an engine thread stuck in a step is not
    waited for beyond ENGINE_STOP_S (what finished is journaled already). A second Ctrl-C while
    this waits stops the wait (True), with one line instead of a traceback."""
    from ..api import shutdown

    try:
        shutdown(model_key, timeout=timeout)
        return False
    except KeyboardInterrupt:
        log.warning("stopped at once by another Ctrl-C: finished Batch API rows are journaled, and unfinished "
                    "batches resume at the next start")
        return True


def _cannot_listen(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now, and what to do, or None. Bound as uvicorn
    binds it (with SO_REUSEADDR, so a port in TIME_WAIT passes), then released for it. A --host
    that is no address of this machine is told as such: "stop what holds it, or choose another
    --port" was the answer to --host 999.1.1.1."""
    import errno
    import socket

    where = f"cannot listen on {host}:{port}"
    not_here = (f"{where}: --host {host} is not an address of this machine; give 127.0.0.1 (this machine only), "
                f"0.0.0.0 (every interface) or one of its own addresses")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"{not_here} ({e.strerror or e})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno == errno.EADDRNOTAVAIL:
                return f"{not_here} ({e.strerror})"
            if e.errno == errno.EACCES:
                return f"{where} ({e.strerror}): ports below 1024 need root; choose another --port, such as 8000"
            return f"{where} ({e.strerror or e}): stop what holds it, or choose another --port"
    return None


def _fail(message: str) -> int:
    print(f"batchprompt: error: {message}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchprompt.server", description=SERVE_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))
