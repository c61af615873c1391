"""Generation options of the batch API: session defaults, overridden per call."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..engine import SamplingParams
from .structured import OutputSpec

STRUCTURED = ("choices", "choice_mode", "regex", "json_schema", "response_format", "grammar")

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
    # Structured output (see OutputSpec): at most one of choices, regex, json_schema,
    # response_format (OpenAI's shape, or a pydantic class) and grammar (Lark).
    choices: tuple[str, ...] | list[str] | None = None
    choice_mode: str | None = None  # "decode" (default) or "score"
    regex: str | None = None
    json_schema: Any = None
    response_format: Any = None
    grammar: str | None = None

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def merged(self, overrides: dict[str, Any]) -> "GenerationOptions":
        """These options with `overrides` applied (None leaves a value as it is)."""
        unknown = sorted(set(overrides) - set(self.names()))
        if unknown:
            raise TypeError(f"unknown option(s) {', '.join(unknown)}; the options are: "
                            f"{', '.join(self.names())}")
        given = {k: v for k, v in overrides.items() if v is not None}
        if any(k in given for k in STRUCTURED if k != "choice_mode"):
            # A call's constraint replaces the session's, whichever kind it is.
            given = {**{k: None for k in STRUCTURED if k != "choice_mode"}, **given}
        opts = replace(self, **given)
        opts.base_params()  # validate now, with SamplingParams' messages
        opts.output_spec()
        return opts

    def output_spec(self) -> OutputSpec | None:
        return OutputSpec.from_options(**{k: getattr(self, k) for k in STRUCTURED})

    def base_params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                              top_k=self.top_k, seed=self.seed, stop=self.stop, logprobs=self.logprobs)

    def sampling_params(self, tokenizer=None) -> tuple[SamplingParams, OutputSpec | None]:
        """The engine parameters and the structured-output spec that checks the results."""
        params, spec = self.base_params(), self.output_spec()
        return (spec.sampling_params(params, tokenizer), spec) if spec else (params, None)
