"""EngineConfig: the engine's knobs, validated once."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# The fields that take whole numbers (None where the field allows it).
_WHOLE_NUMBERS = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory",
                  "max_starved_steps")


#: max_num_batched_tokens where the config leaves it None, by device type (vLLM's offline
#: default is 8,192 too). On the H100, 8,192 ran the spam workload 1.6x faster than 2,048.
DEFAULT_BATCHED_TOKENS = {"cpu": 2048, "cuda": 8192}


class EngineConfigError(ValueError):
    """An engine option that cannot work with this model (a context longer than the model's,
    a KV cache too small for one request of it): refused at start, as vLLM refuses to start."""


@dataclass(frozen=True)
class EngineConfig:
    """`kv_cache_memory` is a ceiling in bytes (None: a share of free memory); the cache grows
    to what the work needs, up to it. `block_size` is small because attention gathers keys by
    slot: a small block costs nothing there and lets a prefix be shared up to its last few
    tokens."""

    block_size: int = 4
    # Enough sequences that short requests keep every step full of prefill work.
    max_num_seqs: int = 512
    # Tokens a step may compute. None: the device's default (DEFAULT_BATCHED_TOKENS), set by
    # the engine: a GPU runs a step of 8,192 tokens in about the time the CPU takes for a few.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_memory: int | None = None
    kv_memory_fraction: float = 0.25  # of free memory, when kv_cache_memory is None
    enable_prefix_caching: bool = True
    watermark: float = 0.01  # share of blocks kept free when admitting new requests
    # Structured output: append the tokens a grammar forces without a decode step for each.
    jump_forward: bool = True
    # Priority classes (a request's `priority`, higher first; see scheduler.py). False: one
    # first-come queue for every request, whatever its priority.
    priority_scheduling: bool = True
    # While requests of a higher priority are in the engine (and for a second after), a step
    # takes lower-priority tokens only up to this many times the time the higher ones would
    # take alone, from the measured step times (e.g. 2.0: a short chat request beside a big
    # batch runs at most about twice as slow). The same switch lets a service run them inside
    # the lower classes' long steps (LLMEngine.step's pause). None: neither (the batch first).
    priority_slowdown: float | None = 2.0
    # A priority class that got no token for this many steps in a row, while higher ones ran,
    # has its oldest request promoted above every class until it finishes: nothing starves.
    max_starved_steps: int = 32

    @classmethod
    def from_options(cls, options: dict) -> "EngineConfig":
        """EngineConfig(**options), where an unknown name is a TypeError listing the known ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise TypeError(f"unknown engine option{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}: "
                            f"the options are EngineConfig's fields: {', '.join(known)}")
        return cls(**options)

    def for_device(self, device_type: str) -> "EngineConfig":
        """This config with the device's defaults filled in where it leaves them None."""
        if self.max_num_batched_tokens is not None:
            return self
        return dataclasses.replace(self, max_num_batched_tokens=DEFAULT_BATCHED_TOKENS.get(device_type, 2048))

    def __post_init__(self) -> None:
        for name in _WHOLE_NUMBERS:
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"{name} must be a whole number{' of bytes' if name == 'kv_cache_memory' else ''}, "
                                f"got {value!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_starved_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1 (or None: the model's own context), got {self.max_model_len}")
        for name in ("enable_prefix_caching", "jump_forward", "priority_scheduling"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("kv_memory_fraction", "watermark") + (("priority_slowdown",) if self.priority_slowdown is not None
                                                          else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number, got {value!r}")
        if not 0 < self.kv_memory_fraction <= 0.95:
            raise ValueError(f"kv_memory_fraction must be in (0, 0.95], got {self.kv_memory_fraction}")
        if not 0 <= self.watermark < 0.5:
            raise ValueError(f"watermark must be in [0, 0.5) (the share of KV blocks kept free at admission), "
                             f"got {self.watermark}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be a positive number of bytes")
        if self.priority_slowdown is not None and not self.priority_slowdown > 1:
            raise ValueError(f"priority_slowdown must be > 1 (or None: no limit), got {self.priority_slowdown}")
