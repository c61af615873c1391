"""RayCluster: where and how many engine replicas run, as a provider of a backend.

    lm = bp.LanguageModel.create(system=..., cluster=bp.RayCluster(replicas=4, replica_gpus=1,
                                                                   address="auto"))
    results = lm.batch_prompt(prompts)

`get_backend(model, cluster=RayCluster(...))` calls `as_backend`, which connects to Ray (or
starts a local Ray when there is none and no address is given), starts the replicas (one Ray
actor each, holding one engine) and returns a `RayBackend`. Backends are kept per model and
options while they run, so sessions and jobs on one cluster object share the replicas.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import threading
from typing import Any

log = logging.getLogger("batchprompt")
RAY_MISSING = "Ray is not installed: pip install 'batchprompt[ray]'"
CONNECT_TIMEOUT_S = 5.0  # a head that does not accept a connection in this time is an error
# The batchprompt backends running on Ray in this process (of any RayCluster object): Ray is
# per process, so the Ray that one object started ends only when none is left.
_running: set = set()


class ClusterError(RuntimeError):
    """The replicas cannot run: Ray cannot be reached, or no replica could start."""


def ray_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or blocked install counts as none
        return False


def _address_ray_finds() -> tuple[str, str] | None:
    """(address, where it comes from) of the cluster that ray.init(address=None or "auto") joins:
    RAY_ADDRESS, else the one `ray start` recorded; None where it would start a local Ray."""
    env = os.environ.get("RAY_ADDRESS", "").strip()
    if env == "local":
        return None
    if env and env != "auto":
        return env, "RAY_ADDRESS in the environment"
    try:
        from ray._private.services import find_bootstrap_address  # Ray's own look-up (private: may move)
        found = find_bootstrap_address(None)
    except Exception:  # noqa: BLE001  (another Ray version: Ray looks for itself, as before)
        return None
    return (found, "the cluster that `ray start` recorded on this machine") if found else None


@dataclasses.dataclass
class RayCluster:
    """Engine replicas as Ray actors.

    replicas        how many engines (one Ray actor each, one model load each)
    address         the Ray cluster: None (the one this process is connected to, else Ray's
                    default: RAY_ADDRESS, a cluster started on this machine, or a new local
                    one), "auto" (the one started on this machine with `ray start`),
                    "host:port" (a head's GCS address) or "ray://host:port" (Ray Client)
    replica_cpus    CPUs Ray reserves for each replica (default 1)
    replica_gpus    GPUs for each replica (1: one replica per GPU; Ray sets CUDA_VISIBLE_DEVICES)
    threads         torch threads per replica (default: replica_cpus, at least 1)
    replica_resources  custom Ray resources per replica, e.g. {"bp_slot": 1}, to pin replicas to
                    the nodes that offer them
    max_restarts    times Ray restarts a replica that died (its rows are re-run on the others)
    blocks_in_flight, block_rows  blocks sent ahead to each replica and their largest size:
                    a lost replica costs at most their product in rows re-run
    start_timeout_s how long to wait for the first replica to load
    recover_timeout_s  how long work may wait with no replica ready before it fails
    runtime_env     Ray's runtime_env for the replicas (e.g. {"pip": ["batchprompt"]})
    init_options    more keywords for ray.init when batchprompt connects to or starts Ray
    """

    replicas: int = 1
    address: str | None = None
    replica_cpus: float = 1.0
    replica_gpus: float = 0.0
    threads: int | None = None
    replica_resources: dict[str, float] | None = None
    max_restarts: int = 3
    blocks_in_flight: int = 4
    block_rows: int = 64
    start_timeout_s: float = 600.0
    recover_timeout_s: float = 600.0
    runtime_env: dict | None = None
    init_options: dict | None = None

    def __post_init__(self) -> None:
        # A bool is an int to Python, and a string compared with a number was a bare TypeError.
        for name in ("replicas", "threads", "max_restarts", "blocks_in_flight", "block_rows"):
            value = getattr(self, name)
            if not (value is None and name == "threads") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be a whole number, got {value!r}")
        for name in ("replica_cpus", "replica_gpus", "start_timeout_s", "recover_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be an integer >= 1, got {self.replicas!r}")
        if self.replica_cpus < 0 or self.replica_gpus < 0:
            raise ValueError(f"replica_cpus and replica_gpus must be >= 0, got {self.replica_cpus}, "
                             f"{self.replica_gpus}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be an integer >= 1, got {self.threads!r}")
        if self.max_restarts < -1:
            raise ValueError(f"max_restarts must be >= 0 (or -1: without limit), got {self.max_restarts}")
        if self.blocks_in_flight < 1 or self.block_rows < 1:
            raise ValueError("blocks_in_flight and block_rows must be >= 1")
        if not self.start_timeout_s > 0 or not self.recover_timeout_s > 0:
            raise ValueError("start_timeout_s and recover_timeout_s must be > 0 seconds")
        # _start_lock: one backend starts at a time per model; _lock guards the dict only, so a
        # backend that stops while starting (its dispatch thread calls forget) never waits on
        # the starter, which waits for that thread.
        self._start_lock = threading.Lock()
        self._lock = threading.Lock()
        self._backends: dict[tuple, Any] = {}
        self._started_ray = False

    def as_backend(self, model: Any = None, *, device: str = "auto", dtype: str = "auto",
                   engine_options: dict | None = None):
        """The running backend for `model` on this cluster, started on first use."""
        if not ray_available():
            raise ImportError(RAY_MISSING)
        from ..engine import LLMEngine

        if isinstance(model, LLMEngine) or hasattr(model, "as_backend"):
            raise TypeError("a RayCluster runs a model by name or path (each replica loads its own copy); "
                            f"got {type(model).__name__}")
        from ..device import check_dtype
        from ..engine import EngineConfig

        EngineConfig.from_options(engine_options or {})  # here, at once: not after replicas started
        check_dtype(dtype)
        model = None if model is None else str(model)
        key = (model, device, str(dtype), repr(sorted((engine_options or {}).items())))
        with self._start_lock:
            with self._lock:
                backend = self._backends.get(key)
                other = next((k for k, b in self._backends.items() if k[:3] == key[:3] and k != key and not b.stopped),
                             None)
            if other is not None and (backend is None or backend.stopped):
                # As a local engine refuses them: these replicas would wait for the CPUs that the
                # running ones hold, up to start_timeout_s.
                raise ValueError(f"this cluster already runs {model or 'the embedded model'} with other "
                                 f"engine_options ({other[3]}); give the same ones, or call cluster.shutdown() "
                                 f"first")
            if backend is None or backend.stopped:
                backend = self._start(model, device, dtype, engine_options or {}, key)
                with self._lock:
                    self._backends[key] = backend
            return backend

    @property
    def backends(self) -> list:
        """The running backends of this cluster object (one per model and options): their
        `replicas`, `rows_rerun` and `stats()`."""
        with self._lock:
            return [b for b in self._backends.values() if not b.stopped]

    def shutdown(self) -> None:
        """Stop every backend of this cluster object (their replicas end)."""
        with self._lock:
            backends = list(self._backends.values())
        for b in backends:
            b.shutdown()

    # ---- starting ---------------------------------------------------------------------------
    def _connect(self) -> None:
        import ray

        if ray.is_initialized():
            return
        options = dict(self.init_options or {})
        options.setdefault("logging_level", "WARNING")
        if self.address is None:
            options.setdefault("include_dashboard", False)
        self._check_reachable()
        handlers = _signal_handlers()
        try:
            ray.init(address=self.address, **options)
        except Exception as e:  # noqa: BLE001  (a wrong address, no cluster there, a version mismatch)
            where = f"the Ray cluster at {self.address}" if self.address else "a local Ray"
            if "ray[client]" in str(e):  # a ray:// address: Ray Client is an extra of its own
                hint = "pip install 'ray[client]' for a ray:// address, or give the head's host:port"
            elif (self.address or "").strip() == "auto":  # the hint below is what was given
                hint = "no cluster runs here: run `ray start --head` first, or leave out --address for a local Ray"
            else:
                hint = "give --address auto for the cluster `ray start` runs on this machine, or the head's host:port"
                if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":  # Ray's log says InvalidAuthToken
                    hint += ("; a cluster that `ray start` began checks a token: set RAY_AUTH_MODE=token here, with "
                             "the head's ~/.ray/auth_token on this machine")
            raise ClusterError(f"cannot connect to {where}: {type(e).__name__}: {str(e).strip()[:300]} "
                               f"({hint})") from e
        finally:
            _restore(handlers)
        self._started_ray = True

    def _check_reachable(self) -> None:
        """A head at host:port (or ray://host:port) that does not answer: an error now. (Ray's
        own connect retries for ever, printing only its C++ log, when nothing listens there.)"""
        address = (self.address or "").strip()
        hint = ("is `ray start --head` running there? give the head's host:port, or --address auto for the cluster "
                "`ray start` runs on this machine")
        if address == "local":
            return
        if not address or address == "auto":  # where Ray itself looks: it waited for ever on a stale one
            found = _address_ray_finds()
            if found is None:
                return
            address, source = found
            fix = "unset or fix RAY_ADDRESS" if source.startswith("RAY_ADDRESS") else "`ray stop` forgets it"
            hint = f"the address is {source}: {fix}, or give --address local for a new local Ray"
        hostport = address.split("://", 1)[1] if "://" in address else address
        host, sep, port = hostport.rstrip("/").rpartition(":")
        if not sep or not port.isdigit():
            raise ClusterError(f"cannot read the Ray address {address!r}: give host:port (the head's GCS port, "
                               f"6379 by default), ray://host:port, or auto")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
        except OSError as e:
            raise ClusterError(f"cannot reach the Ray cluster at {address}: {e.strerror or e} ({hint})") from None

    def _check_resources(self) -> None:
        """Replicas that no node of the cluster can hold (more CPUs or GPUs than any node has):
        an error now, instead of actors that wait for ever to be placed. Custom resources are
        left to the start timeout (their nodes may join later)."""
        import ray

        need = {"CPU": float(self.replica_cpus), "GPU": float(self.replica_gpus)}
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if not nodes:
            return
        have = ", ".join(f"{r.get('CPU', 0):g} CPU / {r.get('GPU', 0):g} GPU" for r in nodes)
        if any(all(r.get(k, 0.0) >= v for k, v in need.items()) for r in nodes):
            if any(need.values()):  # how many fit at once: the rest started without a word, and waited
                fit = sum(int(min(r.get(k, 0.0) // v for k, v in need.items() if v > 0)) for r in nodes)
                if fit < self.replicas:
                    log.warning("the Ray cluster holds %d of the %d replicas asked for at once (its nodes have: "
                                "%s); the others wait for room", fit, self.replicas, have)
            return
        raise ClusterError(f"no node of the Ray cluster can hold a replica of {need['CPU']:g} CPU and "
                           f"{need['GPU']:g} GPU (its nodes have: {have}); lower --replica-cpus/--replica-gpus "
                           f"(replica_cpus=/replica_gpus=) or add nodes that have them")

    def _start(self, model: str | None, device: str, dtype: str, engine_options: dict, key: tuple):
        import ray

        from .backend import RayBackend
        from .replica import Replica

        self._connect()
        self._check_resources()
        threads = self.threads or max(1, int(self.replica_cpus))
        options: dict[str, Any] = dict(num_cpus=self.replica_cpus, num_gpus=self.replica_gpus,
                                       max_restarts=self.max_restarts, max_task_retries=0,
                                       max_concurrency=1000, scheduling_strategy="SPREAD")
        if self.replica_resources:
            options["resources"] = dict(self.replica_resources)
        if self.runtime_env:
            options["runtime_env"] = self.runtime_env
        actor = ray.remote(Replica).options(**options)
        handles = [actor.remote(model, device, dtype, engine_options, threads) for _ in range(self.replicas)]

        def forget() -> None:
            with self._lock:
                if backend_ref[0] is not None and self._backends.get(key) is backend_ref[0]:
                    del self._backends[key]
            _running.discard(backend_ref[0])
            self._release_ray()

        backend_ref: list = [None]
        backend = RayBackend(handles, lambda info: driver_tokenizer(model, info),
                             blocks_in_flight=self.blocks_in_flight, block_rows=self.block_rows,
                             start_timeout_s=self.start_timeout_s, recover_timeout_s=self.recover_timeout_s,
                             on_shutdown=forget)
        backend_ref[0] = backend
        _running.add(backend)
        return backend

    def _release_ray(self) -> None:
        """The Ray this object started (a local one, or its connection to a cluster) ends with the
        last batchprompt backend on it: bp.shutdown() left a local Ray's processes (its GCS,
        raylet and agents, a few hundred MB) running until the process exited."""
        import ray

        if not self._started_ray or _running:
            return
        self._started_ray = False
        if ray.is_initialized():
            ray.shutdown()


def driver_tokenizer(model: str | None, info):
    """The model's tokenizer on the driver, without its weights: prompts are rendered here (one
    place renders chat templates) and only token ids travel to the replicas."""
    from pathlib import Path

    from ..models import resolve_model
    from ..models.loader import EMBEDDED_NAMES, ModelSource
    from ..models.tokenizer import Tokenizer

    if model is None or model.lower() in EMBEDDED_NAMES or Path(model).expanduser().exists():
        source = resolve_model(model)
    else:  # a hub id: the tokenizer's files only (each replica downloads the weights itself)
        from huggingface_hub import snapshot_download

        path = snapshot_download(model, allow_patterns=["*.json", "*.jinja", "tokenizer*"])
        source = ModelSource("hf_dir", Path(path), model)
    return Tokenizer.load(source, info.eos_token_ids)


#: The signals whose handlers Ray's start replaces with its own (a C++ handler that prints a
#: stack and dies: a SIGTERM to `run --ray` exited 15, or aborted, with no summary).
KEPT_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _signal_handlers() -> dict[int, object]:
    """This process's Python handlers of KEPT_SIGNALS (none off the main thread, where they
    cannot be set)."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.getsignal(sig) for sig in KEPT_SIGNALS}


def _restore(handlers: dict[int, object]) -> None:
    """Set each handler again: Python's own, which Ray's start replaced underneath it."""
    for sig, handler in handlers.items():
        if handler is not None:
            signal.signal(sig, handler)
