"""Generation options of the batch API: session defaults, overridden per call."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..engine import SamplingParams

#: The batch API decodes greedily unless asked otherwise: bulk jobs want reproducible answers.
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class GenerationOptions:
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | str = ()
    logprobs: bool = False

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def merged(self, overrides: dict[str, Any]) -> "GenerationOptions":
        """These options with `overrides` applied (None leaves a value as it is)."""
        unknown = sorted(set(overrides) - set(self.names()))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: "
                            f"{', '.join(self.names())}")
        opts = replace(self, **{k: v for k, v in overrides.items() if v is not None})
        opts.sampling_params()  # validate now, with SamplingParams' messages
        return opts

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop, logprobs=self.logprobs)
