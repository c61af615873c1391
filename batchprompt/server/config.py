"""ServerConfig: what `batchprompt serve` was asked for, checked once."""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

#: Request bodies above this are refused with 413 (a list of prompts, a long chat).
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
#: Async batches: finished ones are kept this long for GET /v1/batch/{id} ...
DEFAULT_BATCH_RETENTION_S = 3600.0
#: ... and at most this many batches are kept at all (running and finished).
DEFAULT_MAX_BATCHES = 1000
#: Batch API uploads (POST /v1/files) above this are refused with 413 (OpenAI's limit).
DEFAULT_MAX_FILE_BYTES = 200 * 2**20


@dataclass(frozen=True)
class ServerConfig:
    model: str | None = None  # as `LanguageModel.create(model=...)` takes it; None: the embedded model
    # vLLM's --served-model-name: the names a request's "model" may give; the first is the one
    # listed and answered. () : the model's own name (and what --model said).
    served_model_names: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    data_dir: str | None = None  # the Batch API's files and batches; None: data_dir.default_data_dir()
    device: str = "auto"  # as `batchprompt run --device`: auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # auto, bfloat16, float16, float32
    engine_options: dict = field(default_factory=dict)  # EngineConfig fields (max_num_seqs, ...)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    batch_retention_s: float = DEFAULT_BATCH_RETENTION_S
    max_batches: int = DEFAULT_MAX_BATCHES
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    # Browser origins allowed to call the API (CORS); () serves no CORS headers, ("*",) any origin.
    allowed_origins: tuple[str, ...] = ()
    # Webhooks of async batches: attempts, the first wait between them (doubling), per-attempt timeout.
    webhook_attempts: int = 5
    webhook_backoff_s: float = 1.0
    webhook_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        _check(1 <= self.port <= 65535 or self.port == 0, f"--port must be from 1 to 65535, got {self.port}")
        _check(all(isinstance(n, str) and n.strip() for n in self.served_model_names),
               f"--served-model-name takes non-blank names, got {list(self.served_model_names)!r}")
        _check(self.max_body_bytes >= 1024, f"--max-body-bytes must be at least 1024, got {self.max_body_bytes}")
        _check(self.batch_retention_s > 0, f"--batch-retention must be > 0 seconds, got {self.batch_retention_s}")
        _check(self.max_batches >= 1, f"--max-batches must be >= 1, got {self.max_batches}")
        _check(self.max_file_bytes >= 1024, f"--max-file-bytes must be at least 1024, got {self.max_file_bytes}")
        _check(self.api_key is None or self.api_key.strip() != "",
               "--api-key (or $BATCHPROMPT_API_KEY) must not be blank: give the key (a shell variable given to it "
               "may be unset), or leave --api-key out to serve without one")
        _check(self.webhook_attempts >= 1, "webhook_attempts must be >= 1")
        for origin in self.allowed_origins:
            _check(origin == "*" or (origin.startswith(("http://", "https://")) and origin.count("/") == 2),
                   f"--allowed-origins takes '*' or origins such as http://localhost:3000 (scheme, host, port; "
                   f"no path), comma-joined; got {origin!r}")

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach the server."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:  # a host name
            return False


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
