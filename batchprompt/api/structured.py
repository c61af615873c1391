"""OutputSpec: the structured-output options of a call (choices, regex, JSON schema, Lark
grammar, OpenAI's response_format) turned into engine parameters, and results checked and
parsed on the way back."""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, replace
from decimal import Decimal
from typing import Any, Sequence

from ..engine import SamplingParams
from ..structured import Grammar
from ..structured.grammar import ascii_classes, check_choices
from ..structured.validate import grammar_problem
from .result import Result

#: Labels decoded as a trie of their token ids take about this many of the grammar engine's
#: 65,525 symbols (their tokens, and one each); more go as text (see sampling_params).
MAX_TOKEN_SYMBOLS = 50_000

CHOICE_MODES = ("score", "decode")
#: JSON output without free whitespace: fewer tokens, and more of them forced by the schema.
JSON_DEFAULTS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class OutputSpec:
    """At most one constraint per call. With `labels`, `choice_mode` says how a label is picked:
    "decode" (the default, as vLLM's guided_choice) generates under a grammar that admits only
    the labels; "score" computes every label's log-likelihood after the prompt (one prefill,
    the labels share its KV) and returns the most likely, with every label's probability."""

    grammar: Grammar | None = None
    labels: tuple[str, ...] = ()
    choice_mode: str = "decode"
    model_class: Any = None  # a pydantic model class: results parse into instances

    @classmethod
    def from_options(cls, *, choices: Sequence[str] | None = None, choice_mode: str | None = None,
                     regex: str | None = None, json_schema: Any = None, response_format: Any = None,
                     grammar: str | None = None) -> "OutputSpec | None":
        """None when no option asks for structure; ValueError naming the bad option otherwise."""
        mode = choice_mode or "decode"
        if mode not in CHOICE_MODES:
            raise ValueError(f"choice_mode must be 'score' or 'decode', got {choice_mode!r}")
        schema_option = "json_schema"
        if response_format is not None:
            given_schema, json_schema = json_schema, _from_response_format(response_format, json_schema)
            schema_option = "json_schema" if json_schema is given_schema else "response_format"
        given = [n for n, v in (("choices", choices), ("regex", regex), (schema_option, json_schema),
                                ("grammar", grammar)) if v is not None]
        if len(given) > 1:
            raise ValueError(f"give one structured-output option per call, got {' and '.join(given)}")
        if choices is not None:
            return cls(None, tuple(check_choices(choices)), mode)
        if regex is not None:
            return cls(_checked("regex", Grammar.regex(regex), written=regex))
        if grammar is not None:
            return cls(_checked("grammar", Grammar.lark(grammar)))
        if json_schema is not None:
            if json_schema == "json_object":
                return cls(Grammar.json_object(JSON_DEFAULTS))
            model_class = None
            try:
                if isinstance(json_schema, type) and hasattr(json_schema, "model_json_schema"):
                    model_class, json_schema = json_schema, json_schema.model_json_schema()
                return cls(_checked_schema(schema_option, json_schema), model_class=model_class)
            except RecursionError:  # a raw RecursionError (900 levels, or a dict that holds itself)
                raise ValueError(_too_deep(schema_option)) from None
        return None

    def sampling_params(self, params: SamplingParams, tokenizer, max_model_len: int | None = None) -> SamplingParams:
        """`params` with this constraint applied (the tokenizer turns labels into token ids).
        `max_model_len`: the model's context, which no label may fill (where known)."""
        if not self.labels:
            return replace(params, grammar=self.grammar)
        # Each label as the tokenizer writes it, in both modes: scoring sums those tokens'
        # log-probs; decoding may only walk those token sequences (a trie of the labels).
        ids = tuple(tuple(tokenizer.encode(c, add_special_tokens=False)) for c in self.labels)
        longest = max(range(len(ids)), key=lambda i: len(ids[i]))
        if max_model_len is not None and len(ids[longest]) >= max_model_len:  # no max_tokens can make it fit
            raise ValueError(f"choices: the label {_shown(self.labels[longest])} is {len(ids[longest])} tokens, "
                             f"more than the model's context holds beside a prompt ({max_model_len} tokens): "
                             f"shorten the label")
        if len(ids[longest]) > params.max_tokens:  # in both modes: a label is never cut, nor runs past
            raise ValueError(f"choices: the label {_shown(self.labels[longest])} is {len(ids[longest])} tokens, "
                             f"more than max_tokens ({params.max_tokens}): raise max_tokens to at least "
                             f"{len(ids[longest])}")
        if params.min_tokens > len(ids[longest]):  # it met the label's length as "max_tokens (1)"
            n = len(ids[longest])
            raise ValueError(f"choices: min_tokens ({params.min_tokens}) is more than the longest label "
                             f"({n} token{'' if n == 1 else 's'}): an answer is one label; lower min_tokens or "
                             f"leave it out")
        if self.choice_mode == "score":
            if params.logprobs:  # it gave logprobs=[] silently
                raise ValueError("logprobs are not available with choice_mode='score': each label's probability "
                                 "is in result.choice_probs (choice_mode='decode' gives the tokens' log-probs)")
            if params.logit_bias:  # the labels' likelihoods are the model's own: it was ignored without a word
                raise ValueError("logit_bias does not apply to choice_mode='score', which reads each label's "
                                 "likelihood from the model as it is: leave logit_bias out, or use "
                                 "choice_mode='decode'")
            return replace(params, score_choices=ids, max_tokens=1, stop=(), min_tokens=0)
        special = _special_ids(tokenizer)
        for label, label_ids in zip(self.labels, ids):
            if special.intersection(label_ids):  # decoding it ends the answer (or reads as nothing)
                raise ValueError(f"choices: the label {_shown(label)} holds a special token of the model, which "
                                 f"decoding does not write as text: use choice_mode='score', or a label without it")
        if sum(map(len, ids)) + len(ids) > MAX_TOKEN_SYMBOLS:
            # Too many for a trie of token ids (the grammar engine's symbols run out at about 12,000
            # labels): each label as text, one lexeme, still exactly one label. The model may spell
            # it in other tokens, but never in more than its bytes.
            longest_bytes = max(len(c.encode()) for c in self.labels)
            return replace(params, grammar=Grammar.choices(self.labels), max_tokens=longest_bytes)
        # A label that is a prefix of another ends with EOS, within the longest label's length.
        return replace(params, grammar=Grammar.choices(self.labels, ids), max_tokens=len(ids[longest]))

    def finish(self, result: Result, choice_logprobs: list[float] | None = None, complete: bool | None = None,
               asked_stop: bool = False, max_tokens: int | None = None) -> Result:
        """Check and parse a finished result: a label with its probabilities, parsed JSON, or a
        clear error when the output was cut before it completed its grammar. `complete`: the
        engine found the output a whole match (max_tokens may cut one that could go on: "a+"
        after "aaaa" is a match, kept with finish_reason "length", as vLLM keeps it); None where
        the backend cannot tell (a remote server): a cut JSON output then counts if it parses.
        `asked_stop`: the request gave stop strings or stop token ids; one that ends a JSON
        answer before it is whole leaves the text as the answer (finish_reason "stop", nothing
        parsed), as vLLM answers it and as a stream of it reads. `max_tokens`: what the request
        allowed; an output cut shorter than that was cut by the end of the context."""
        if result.error is not None:
            return result
        if self.labels and choice_logprobs is not None:
            top = max(choice_logprobs)
            weights = [math.exp(v - top) for v in choice_logprobs]
            total = sum(weights)
            probs = {label: w / total for label, w in zip(self.labels, weights)}
            best = max(range(len(self.labels)), key=choice_logprobs.__getitem__)
            return replace(result, text=self.labels[best], choice_probs=probs)
        cut = result.finish_reason == "length" and not complete
        if cut and not (self.grammar is not None and self.grammar.is_json):
            return self._cut(result, max_tokens)
        if self.labels:
            return result
        if self.grammar.is_json:
            if cut and complete is False:  # "1" of an integer >= 100000 parses, but is no answer
                return self._cut(result, max_tokens)
            # A stop string or stop token the caller gave ended the answer before its grammar was
            # whole ("1" of "150" under minimum 100): its text is the answer, nothing parsed. (A
            # remote server cannot say: an answer cut so is one that does not parse or check.)
            # (A stop string at the answer's very end, "}", leaves the grammar whole and the text
            # not: its stop_reason says so.)
            stopped = asked_stop and result.finish_reason == "stop" and (result.stop_reason is not None
                                                                          or not complete)
            if stopped and complete is False:
                return result
            try:
                parsed, unreadable = _read_json(result.text, self.grammar.source)
                if unreadable is None and self.model_class is not None:  # 1e999 is inf to pydantic too
                    parsed = self.model_class.model_validate_json(result.text)
                elif unreadable is None:
                    unreadable = schema_problem(parsed, self.grammar.source)
            except ValueError as e:  # json.JSONDecodeError and pydantic's ValidationError
                # A remote server cannot say whether a cut output is complete: it is if it parses.
                if cut:
                    return self._cut(result, max_tokens)
                if stopped:
                    return result
                return replace(result, error=f"the output does not parse as the schema asks: {e}")
            if unreadable is not None:
                return result if stopped else replace(result, error=unreadable)
            return replace(result, parsed=parsed)
        return result

    def _cut(self, result: Result, max_tokens: int | None = None) -> Result:
        kind = "choices" if self.labels else self.grammar.kind
        made = result.usage.completion_tokens
        if max_tokens is not None and made < max_tokens:  # the context ended first: more max_tokens cannot help
            return replace(result, error=f"the context ran out ({result.usage.prompt_tokens} prompt tokens and {made} "
                                         f"generated) before the output completed the {kind}: shorten the prompt")
        return replace(result, error=f"the output reached max_tokens ({made}) "
                                     f"before it completed the {kind}: raise max_tokens")


def _read_json(text: str, schema: str) -> tuple[Any, str | None]:
    """The JSON answer `text` parsed (json.loads' errors raised), and why it breaks its schema or
    JSON once its numbers are read as floats, where it does (else None), though its grammar allows
    it: a number written strictly inside an exclusive bound that reads exactly on it
    ("0.99999999999999999" under exclusiveMaximum 1 is 1.0, which the schema excludes), or one too
    large for a float ("4e9999" is inf, which JSON cannot write).
    (A pydantic model's `lt` refuses the first itself.)"""
    bounds = _exclusive_bounds(schema)
    found: list[tuple[str, str]] = []

    def read(number: str) -> float:
        value = float(number)
        if math.isinf(value):
            found.append((number, "overflow"))
        elif value in bounds and Decimal(number) != Decimal(value):
            found.append((number, "bound"))
        return value

    parsed = json.loads(text, parse_float=read)  # once: the answer's value and its numbers' check
    if not found:
        return parsed, None
    number, why = found[0]
    shown = number if len(number) <= 40 else number[:37] + "..."
    if why == "overflow":
        return parsed, (f"the output's number {shown} is too large for a float (it reads as inf, which JSON cannot "
                        f"write)")
    return parsed, (f"the output's number {shown} lies inside the schema's exclusive bound, but as a float it reads "
                    f"{float(number)!r}, the bound itself, which the schema excludes")


def schema_problem(parsed: Any, schema: str) -> str | None:
    """Why the parsed answer breaks `schema` (checked with `jsonschema`, formats included), or
    None. The grammar engine enforces the schema as the answer is written, but not all of it: it
    let through a number on an exclusive bound below the next integer (`exclusiveMinimum: 0`
    with `maximum: 0.5` took 0), a key written twice to reach `minProperties` (the parsed object
    keeps one), and a date that does not exist (2023-02-29). Such an answer is its row's error,
    never an `ok` result that breaks its schema. A schema `jsonschema` cannot apply (a `$ref` to
    another document) leaves the grammar's word."""
    validator = _validator(schema)
    if validator is None:
        return None
    try:
        errors = [e for e in validator.iter_errors(parsed) if not _float_multiple(e)]
    except Exception:  # noqa: BLE001 - a $ref it cannot resolve, a pattern Python's re cannot read
        return None
    if not errors:
        return None
    from jsonschema.exceptions import best_match

    error = best_match(errors)
    where = "/".join(map(str, error.absolute_path))
    return (f"the output breaks its schema{f' at {where}' if where else ''}: {error.message} (the grammar "
            f"engine let it through)")


@functools.lru_cache(maxsize=64)  # a job's rows share one schema
def _validator(schema: str):
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        node = json.loads(schema)
        cls = jsonschema.validators.validator_for(node, default=jsonschema.Draft202012Validator)
        if cls not in (jsonschema.Draft3Validator, jsonschema.Draft4Validator):
            node = _numeric_exclusive_bounds(node)  # draft 4's `true` beside minimum, as later drafts write it
        # A pattern as the grammar engine reads it (ECMA-262): \d and \w ASCII, \p{Lu} and (?<name>)
        # taken. Python's `re` read \D as Unicode (an Arabic digit failed `^\D+$`), and one pattern it
        # cannot read ended the whole check, formats included.
        cls = jsonschema.validators.extend(cls, {"pattern": _pattern_keyword})
        return cls(node, format_checker=_with_leap_seconds(cls.FORMAT_CHECKER))
    except Exception:  # noqa: BLE001 - a schema it cannot read: the grammar's word stands
        return None


#: A leap second's time (23:59:60), which RFC 3339 and JSON Schema's own tests take and the
#: date-time checker (rfc3339-validator) refused: checked as :59.
_LEAP_SECOND = re.compile(r"(\d\d:\d\d):60(?=[.Zz+-]|$)")


def _with_leap_seconds(checker):
    """`checker` with its date-time and time checks taking a leap second."""
    import copy

    out = copy.copy(checker)
    out.checkers = dict(checker.checkers)
    for name in ("date-time", "time"):
        if name in out.checkers:
            func, raises = out.checkers[name]
            out.checkers[name] = (functools.partial(_leap_second_as_59, func), raises)
    return out


def _leap_second_as_59(func, value):
    return func(_LEAP_SECOND.sub(r"\1:59", value) if isinstance(value, str) else value)


def _pattern_keyword(validator, pattern: str, instance: Any, schema: dict):
    """jsonschema's `pattern` keyword, read as the grammar engine reads it (see ecma_pattern);
    a pattern that cannot be read here is the grammar's word alone."""
    if not validator.is_type(instance, "string"):
        return
    compiled = ecma_pattern(pattern)
    if compiled is not None and not compiled.search(instance):
        from jsonschema.exceptions import ValidationError

        yield ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.lru_cache(maxsize=256)
def ecma_pattern(pattern: str):
    r"""A JSON Schema `pattern` (ECMA-262) compiled as close to ECMA's reading as Python gets:
    \d, \w and their negations ASCII (`ascii_classes`, nested classes read by the `regex`
    module's V1), Unicode properties and `(?<name>...)` taken; None where it cannot be read."""
    import regex

    try:
        return regex.compile(ascii_classes(pattern), regex.V1)
    except (regex.error, ValueError, TypeError, OverflowError):
        return None


def _numeric_exclusive_bounds(node: Any) -> Any:
    """`node` with draft 4's boolean exclusiveMinimum/Maximum (beside minimum/maximum) as the
    numbers later drafts take (a validator of those reads `true` as 1)."""
    if isinstance(node, list):
        return [_numeric_exclusive_bounds(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: _numeric_exclusive_bounds(v) for k, v in node.items()}
    for key, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(key), bool):
            if out.pop(key) and _is_number(out.get(plain)):
                out[key] = out.pop(plain)
    return out


def _float_multiple(error) -> bool:
    """A `multipleOf` error that is float division's, not the answer's (0.3 / 0.1 is
    2.9999999999999996): exact in decimal."""
    if error.validator != "multipleOf" or not _is_number(error.instance) or not _is_number(error.validator_value):
        return False
    try:
        return Decimal(repr(error.instance)) % Decimal(repr(error.validator_value)) == 0
    except ArithmeticError:
        return False


@functools.lru_cache(maxsize=64)  # a job's rows share one schema
def _exclusive_bounds(schema: str) -> frozenset[float]:
    """The schema's exclusive numeric bounds, wherever they are (exclusiveMinimum/Maximum as
    numbers, or draft 4's `true` beside minimum/maximum)."""
    out: set[float] = set()

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for x in node:
                walk(x)
            return
        if not isinstance(node, dict):
            return
        for key, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            v = node.get(key)
            if v is True and _is_number(node.get(plain)):
                out.add(float(node[plain]))
            elif _is_number(v):
                out.add(float(v))
        for x in node.values():
            walk(x)

    walk(json.loads(schema))
    return frozenset(out)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _special_ids(tokenizer) -> set[int]:
    hf = getattr(tokenizer, "hf", tokenizer)
    ids = set(getattr(hf, "all_special_ids", None) or ())
    return ids | set(getattr(tokenizer, "eos_token_ids", None) or ())


def _from_response_format(fmt: Any, json_schema: Any) -> Any:
    """OpenAI's response_format ({"type": "json_schema", "json_schema": {"schema": ...}},
    {"type": "json_object"}, {"type": "text"}) or a pydantic class, as a json_schema option."""
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":  # asks for no constraint: a json_schema beside it stands, as choices and regex do
        return json_schema
    if json_schema is not None:
        raise ValueError("give either response_format or json_schema, not both")
    if isinstance(fmt, type):
        return fmt
    if kind == "json_object":
        return "json_object"
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if isinstance(inner, dict) and inner.get("strict") is not None and not isinstance(inner["strict"], bool):
            raise ValueError(f"response_format.json_schema.strict must be true or false, got {inner['strict']!r}")
        if isinstance(inner, dict) and isinstance(inner.get("schema"), (dict, bool)):  # true: any JSON value
            return inner["schema"]
        got = (f"; its schema is {type(inner['schema']).__name__}, not a JSON object"
               if isinstance(inner, dict) and "schema" in inner else "")
        raise ValueError('response_format of type json_schema needs {"json_schema": {"name": ..., '
                         '"schema": {...}}}' + got)
    shown = json.dumps(fmt, default=repr, ensure_ascii=False)  # as JSON: what an HTTP client sent
    raise ValueError(f'response_format must be {{"type": "json_schema", "json_schema": {{...}}}}, '
                     f'{{"type": "json_object"}}, {{"type": "text"}} (or, in Python, a pydantic model class); '
                     f'got {shown if len(shown) <= 60 else shown[:57] + "..."}')


def _checked(option: str, grammar: Grammar, written: str | None = None) -> Grammar:
    """`grammar` if llguidance can use it; otherwise a ValueError naming the option, before any work.
    `written`: the regex as the caller wrote it, which the message names beside llguidance's
    quote of it as it was given (its \\d and \\w as ASCII classes)."""
    problem = grammar_problem(grammar)
    if problem is not None:
        if written is not None and written != grammar.source:
            problem += f" (your regex: {written}, given to it with \\d and \\w written as ASCII classes)"
        raise ValueError(f"bad {option} (fix it): {problem}")
    return grammar


def _too_deep(option: str) -> str:
    return (f"bad {option} (fix it): nested too deeply, or it holds itself; for a recursive structure, refer to a "
            f"definition with $ref")


def _checked_schema(option: str, schema: Any) -> Grammar:
    """_checked for a JSON schema, whose objects are closed: where only the closing makes it
    unusable ("minProperties": 2 with one property listed), the error says so and how to open it."""
    grammar = Grammar.json_schema(schema, JSON_DEFAULTS)  # not a schema at all: that error alone
    try:
        return _checked(option, grammar)
    except ValueError as e:
        if "Unimplemented keys" in str(e) or "Unknown format" in str(e):  # (a pydantic set[str], bytes)
            raise ValueError(f'{e}; the grammar engine cannot enforce it: remove it from the schema, or give the '
                             f'schema "x-guidance": {{"lenient": true}} to have it ignored (answers may then not '
                             f'meet it)') from None
        if "recursion limit exceeded" in str(e):  # the grammar engine's JSON reader: "at line 1 column 2451"
            raise ValueError(_too_deep(option)) from None
        if "oneOf constraints are not supported" in str(e):  # its "coerce_one_of option" is an x-guidance key
            raise ValueError(f'{e}: give the schema "x-guidance": {{"coerce_one_of": true}} to take its oneOf as '
                             f'anyOf (an answer may then match more than one branch), or make the branches '
                             f'exclude each other') from None
        if "integer range" in str(e):  # it showed 64-bit bounds, not those given, as Rust's Some(...)
            raise ValueError(f"bad {option} (fix it): an integer's minimum or maximum lies beyond 64-bit integers "
                             f"(-9223372036854775808 to 9223372036854775807), which the grammar engine cannot "
                             f"bound: give bounds within them") from None
        if "float range" in str(e):  # "min=Some(1e20), max=None"
            raise ValueError(f"bad {option} (fix it): a number's minimum or maximum is too large for the grammar "
                             f"engine to bound (about 9e18 at most): give a smaller bound") from None
        if grammar_problem(Grammar.json_schema(schema, JSON_DEFAULTS, close=False)) is not None:
            raise
        raise ValueError(f'{e}; that is after batchprompt closed its objects ("additionalProperties": false on '
                         f'each object that lists properties and says nothing of others, as OpenAI\'s strict mode '
                         f'and vLLM do): give the object "additionalProperties": true to leave it open') from None


def _shown(label: str) -> str:
    """A label as an error message quotes it: cut short (a label of 9,000 tokens made a message
    of 18,000 characters, in every row of a job's errors file)."""
    shown = repr(label)
    return shown if len(shown) <= 80 else f"{shown[:60]}... ({len(label):,} characters)"
