"""Grammar: what a constrained request's output must match, as plain hashable data."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Sequence

from .json_schema import close_objects

KINDS = ("choices", "regex", "json_schema", "json_object", "lark")


@dataclass(frozen=True)
class Grammar:
    """`kind` is one of KINDS; `source` is its text (a regex, Lark, or JSON for the others).

    Frozen and hashable: the engine compiles each distinct grammar once and copies the
    compiled matcher for every request that uses it."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown grammar kind {self.kind!r}; the kinds are: {', '.join(KINDS)}")

    @classmethod
    def choices(cls, labels: Sequence[str], token_ids: Sequence[Sequence[int]] | None = None) -> "Grammar":
        """Exactly one of `labels`. With `token_ids` (each label's tokens, as the tokenizer
        writes it), only those token sequences are allowed; without, any tokenization of the
        text is, which lets a model spell a label in pieces it never saw in training."""
        data: dict[str, Any] = {"labels": check_choices(labels)}
        if token_ids is not None:
            data["tokens"] = [[int(t) for t in ids] for ids in token_ids]
            if len(data["tokens"]) != len(data["labels"]) or not all(data["tokens"]):
                raise ValueError("choices: give one non-empty token id list per label")
        return cls("choices", json.dumps(data))

    def longest_choice(self) -> int | None:
        """Choices given with their token ids: the longest label's length in tokens (else None)."""
        if self.kind != "choices":
            return None
        tokens = json.loads(self.source).get("tokens")
        return max(len(t) for t in tokens) if tokens else None

    @classmethod
    def regex(cls, pattern: str) -> "Grammar":
        """`pattern` with \\d and \\w as ASCII classes, as vLLM's grammar backends and JSON Schema's
        `pattern` (ECMA-262) read them: the grammar engine reads them as Unicode classes, and the
        model answered `\\d{4}` with four U+1FBF8 digits."""
        if not isinstance(pattern, str) or not pattern:
            raise ValueError(f"regex must be a non-empty string, got {pattern!r}")
        return cls("regex", ascii_classes(pattern))

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | str, options: dict[str, Any] | None = None,
                    close: bool = True) -> "Grammar":
        """JSON valid against `schema`, whose objects allow only the properties they list
        unless they say `additionalProperties` themselves (see `close_objects`; `close=False`
        leaves them as written). `options` are defaults for llguidance's JSON compiler
        ("x-guidance"), which the schema's own "x-guidance" overrides."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if schema is True:  # JSON Schema's boolean form: `true` is any JSON value, as `{}`
            schema = {}
        elif schema is False:
            raise ValueError("json_schema is `false`, which no JSON value matches: give a schema that some value "
                             "fits (`true` or `{}` for any JSON)")
        if not isinstance(schema, dict):  # "got str" read as the text's type, where its JSON was a string
            kind = {str: "a string", list: "an array", int: "a number", float: "a number"}.get(type(schema))
            raise ValueError(f"json_schema must be a JSON schema: an object (a dict), "
                             f"got {kind or type(schema).__name__}")
        schema = close_objects(schema) if close else schema
        return cls("json_schema", json.dumps(_with_options(schema, options)))  # key order kept

    @classmethod
    def json_object(cls, options: dict[str, Any] | None = None) -> "Grammar":
        """Any JSON object; `options` as for json_schema."""
        return cls("json_object", json.dumps(_with_options({"type": "object"}, options)))

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        if not isinstance(text, str) or not text.strip():
            raise ValueError("grammar must be a non-empty Lark grammar string")
        return cls("lark", text)

    @property
    def num_labels(self) -> int:
        """How many labels a choices grammar has (0 for other kinds)."""
        return len(self.labels)

    @property
    def labels(self) -> list[str]:
        """A choices grammar's labels (empty for other kinds)."""
        return json.loads(self.source)["labels"] if self.kind == "choices" else []

    @property
    def has_token_ids(self) -> bool:
        """A choices grammar given each label's token ids (a trie of tokens, not text)."""
        return self.kind == "choices" and "tokens" in json.loads(self.source)

    @property
    def is_json(self) -> bool:
        return self.kind in ("json_schema", "json_object")

    def to_llguidance(self) -> str:
        """The grammar in llguidance's own format."""
        from llguidance import LLMatcher

        if self.kind == "choices":
            data = json.loads(self.source)
            if "tokens" in data:  # token-id terminals: <[id]>
                alternatives = (" ".join(f"<[{t}]>" for t in ids) for ids in data["tokens"])
                return LLMatcher.grammar_from_lark("start: " + " | ".join(alternatives))
            # As text: one terminal, the labels' alternation, so one lexeme and a few symbols
            # whatever their number. A rule of one terminal per label compiled 12x slower (2.5 s
            # for 50,000 labels, on the engine's thread), and failed past 65,525 labels (symbols).
            return LLMatcher.grammar_from_lark("start: LABEL\nLABEL: " + " | ".join(map(json.dumps, data["labels"])))
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.source)
        if self.kind == "lark":
            return LLMatcher.grammar_from_lark(_as_lark(self.source))
        return LLMatcher.grammar_from_json_schema(self.source)


#: \d, \D, \w and \W as ASCII classes: outside a class, and inside one, where the negated ones
#: are a nested class (`[^\W\d_]` is `[^[^0-9A-Za-z_]0-9_]`, the ASCII letters), which the grammar
#: engine reads as a union, as the `regex` module's V1 does.
_OUTSIDE = {"d": "[0-9]", "D": "[^0-9]", "w": "[0-9A-Za-z_]", "W": "[^0-9A-Za-z_]"}
_INSIDE = {"d": "0-9", "w": "0-9A-Za-z_", "D": "[^0-9]", "W": "[^0-9A-Za-z_]"}


def ascii_classes(pattern: str) -> str:
    """`pattern` with its \\d, \\D, \\w and \\W written as ASCII classes, in a bracket class
    too. Escapes stay escapes: `\\\\d` is a backslash and a d."""
    out: list[str] = []
    i, in_class, class_start = 0, False, -1
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            table = _INSIDE if in_class else _OUTSIDE
            if in_class and nxt in "dDwWsS" and len(out) >= 2 and out[-1] == "-" and out[-2] not in ("[", "[^"):
                # `[+-\d]`: a class cannot end a range, so the hyphen is itself, as ECMA-262 without the
                # u flag reads it; written out as `[+-0-9]` it made a range from + to 0 (no 1 to 8)
                out[-1] = "\\-"
            out.append(table.get(nxt, c + nxt))
            i += 2
            if in_class and nxt in "dDwWsS" and pattern.startswith("-", i) and not pattern.startswith("-]", i):
                # `[\w-.]`: a hyphen after a class is itself, as Python and ECMA-262 without the u flag
                # read it (the common e-mail pattern); the grammar engine refused it as a range
                out.append("\\-")
                i += 1
            continue
        if c == "[" and not in_class:
            in_class, class_start = True, i
            if pattern.startswith("[^", i):  # a "]" first in the class is a literal
                out.append("[^")
                i += 2
                class_start = i - 1
                continue
        elif c == "]" and in_class and i > class_start + 1:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out)


def _as_lark(text: str) -> str:
    """A grammar as llguidance's Lark: Lark as it is, and GBNF (llama.cpp's `root ::= ...`,
    which vLLM's guided_grammar takes from its examples) converted by llguidance's own tool."""
    from llguidance.gbnf_to_lark import gbnf_to_lark, is_lark_syntax

    # GBNF's root rule: llguidance's is_lark_syntax took a GBNF grammar with a rule named start
    # (`start ::= ...`) for Lark, which then failed to parse.
    gbnf_root = re.search(r"^\s*root\s*::=", text, re.MULTILINE) is not None
    if "::=" not in text or (is_lark_syntax(text) and not gbnf_root):
        return text
    try:
        return gbnf_to_lark(_unicode_escapes_as_bytes_or_text(text))
    except Exception as e:  # noqa: BLE001 - GbnfToLarkError, and a plain Exception for a rule not defined
        raise ValueError(f"the grammar reads as GBNF (it has '::=') but does not convert to Lark: {e}") from None


#: A GBNF \uXXXX or \UXXXXXXXX escape (not itself escaped: an even run of backslashes before it).
_UNICODE_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\(?:u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8}))")


def _unicode_escapes_as_bytes_or_text(gbnf: str) -> str:
    """GBNF's \\u00e9 and \\U0001F600 as llguidance's converter reads them: it drops their
    leading zeros (\\ue9, a lexer error), so "\\u00e9" was refused. A code point up to 0xFF
    becomes \\xHH, which it keeps; a larger one (never a character GBNF gives a meaning) the
    character itself."""
    def sub(m: re.Match) -> str:
        code = int(m.group(2) or m.group(3), 16)
        return m.group(1) + (f"\\x{code:02x}" if code <= 0xFF else chr(code))
    return _UNICODE_ESCAPE.sub(sub, gbnf)


def check_choices(labels: Sequence[str]) -> list[str]:
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise ValueError(f"choices must be a list of strings, got {labels!r}")
    labels = list(labels)
    if not labels:
        raise ValueError("choices needs at least one label, got []")
    if not all(isinstance(c, str) and c for c in labels):
        raise ValueError(f"choices must be non-empty strings, got {labels!r:.200}")
    # As vLLM's guided_choice: one label is allowed (the answer is that label), a repeated one counts once.
    return list(dict.fromkeys(labels))


def _with_options(schema: dict[str, Any], options: dict[str, Any] | None) -> dict[str, Any]:
    if not options:
        return schema
    return {**schema, "x-guidance": {**options, **schema.get("x-guidance", {})}}
