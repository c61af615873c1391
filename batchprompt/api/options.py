"""Generation options of the batch API: session defaults, overridden per call."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from ..engine import SamplingParams
from .structured import OutputSpec

STRUCTURED = ("choices", "choice_mode", "regex", "json_schema", "response_format", "grammar")

#: The batch API decodes greedily unless asked otherwise: bulk jobs want reproducible answers.
#: (The engine's SamplingParams keeps vLLM's defaults: temperature 1.0, max_tokens 16.)
DEFAULT_MAX_TOKENS = 256
#: Options passed to SamplingParams as they are (it checks them).
SAMPLING = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "logprobs", "top_logprobs",
            "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens",
            "logit_bias", "include_stop_str_in_output", "best_of", "stop_token_ids", "ignore_eos")


@dataclass(frozen=True)
class GenerationOptions:
    """Per-call options. Defaults are the batch API's: greedy (temperature 0) and 256 tokens,
    where the engine's SamplingParams keeps vLLM's 1.0 and 16. The sampling options mean what
    they mean in SamplingParams; `best_of` generates that many samples and returns the one with
    the highest cumulative log-prob."""

    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] | str = ()
    logprobs: bool = False
    top_logprobs: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: Any = None  # {token id: bias}
    include_stop_str_in_output: bool = False
    best_of: int | None = None
    stop_token_ids: tuple[int, ...] | list[int] = ()  # vLLM's: a token id that ends the text (stop_reason names it)
    ignore_eos: bool = False
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
            # A call's constraint replaces the session's, whichever kind it is; a constraint of
            # another kind than labels takes the session's choice_mode with its labels.
            reset = {k: None for k in STRUCTURED if k != "choice_mode"}
            if "choices" not in given:
                reset["choice_mode"] = None
            given = {**reset, **given}
        opts = replace(self, **given)
        opts.base_params()  # validate now, with SamplingParams' messages
        opts.output_spec()
        return opts

    def output_spec(self) -> OutputSpec | None:
        return OutputSpec.from_options(**{k: getattr(self, k) for k in STRUCTURED})

    def base_params(self) -> SamplingParams:
        return SamplingParams(**{k: getattr(self, k) for k in SAMPLING})

    def sampling_params(self, tokenizer=None, max_model_len: int | None = None) -> tuple[SamplingParams,
                                                                                      OutputSpec | None]:
        """The engine parameters and the structured-output spec that checks the results
        (`max_model_len`: the model's context, where known)."""
        if self.choice_mode is not None and self.choices is None:  # it was ignored: free text came back
            raise ValueError(f"choice_mode={self.choice_mode!r} picks among choices: give choices=[...] with it, "
                             f"or leave choice_mode out")
        params, spec = self.base_params(), self.output_spec()
        return (spec.sampling_params(params, tokenizer, max_model_len), spec) if spec else (params, None)
