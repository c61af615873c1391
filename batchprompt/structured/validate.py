"""Checking a grammar before any work, without the model's tokenizer: llguidance's own
validation, and a probe for grammars that no text can match (`[^\\s\\S]`)."""
from __future__ import annotations

import functools

from .grammar import Grammar


def grammar_problem(grammar: Grammar) -> str | None:
    """Why llguidance cannot use `grammar`, in its words; None when it can. Each distinct
    grammar is checked once (a batch job asks for the same one on every row)."""
    return _problem(grammar)


def dead_end(matcher) -> str | None:
    """Why `matcher`, computing its next mask, finds that no text continues it to a match
    (llguidance enters an error state and allows only EOS); None when something can follow."""
    matcher.compute_bitmask()
    if not matcher.is_error():
        return None
    reason = matcher.get_error().split("\n", 1)[0]
    return None if matcher.is_accepting() else reason


#: A grammar whose forced text never ends (`a: "x" a`): no text can complete it.
ENDLESS = ("no text can match it: it forces a text that never ends (a rule that only refers to itself, as "
           "a: \"x\" a); give each such rule a way to end")


def endless(matcher) -> bool:
    """Whether the text that `matcher` forces from here never ends: llguidance then stops at its
    limit of items ("Too many items ... ff_tokens"), and every request failed there, in its words."""
    forced = matcher.compute_ff_tokens()
    if not forced or matcher.consume_tokens(forced) or not matcher.is_error():
        return False
    return "Too many items" in matcher.get_error()


#: A grammar whose one match is the empty text (`a{0}`, a GBNF `root ::= ` cut short).
ONLY_EMPTY = "only the empty text matches it: every answer would be empty; give it something to match"


def only_empty(matcher) -> bool:
    """Whether the end is all that `matcher` allows from its start: every answer was "" with
    finish_reason "stop", as if the model had answered."""
    import numpy as np

    bits = np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little")
    return not matcher.is_error() and matcher.is_accepting() and np.flatnonzero(bits).tolist() == [_Bytes.eos_token_id]


def is_no_match(reason: str) -> bool:
    """llguidance's reason for a dead end where no byte can follow ('NoExtension...')."""
    return reason.startswith("NoExtension")


@functools.lru_cache(maxsize=256)
def _problem(grammar: Grammar) -> str | None:
    from llguidance import LLMatcher

    try:
        text = grammar.to_llguidance()
    except ValueError as e:
        return str(e)
    # No tokenizer: token-level parts (<[id]>, special tokens) are warnings, not errors.
    is_error, messages = LLMatcher.validate_grammar_with_warnings(text, None)
    if is_error:
        return f"the grammar engine rejected it: {messages[0].strip()}"
    if grammar.kind == "lark" and "<" in grammar.source:  # may name the model's tokens: probed by the engine
        return None
    matcher = LLMatcher(_byte_tokenizer(), text, log_level=0)
    if matcher.is_error():
        return f"the grammar engine rejected it: {matcher.get_error().strip()}"
    if endless(matcher.deep_copy()):
        return ENDLESS
    if only_empty(matcher.deep_copy()):
        return ONLY_EMPTY
    reason = dead_end(matcher) or _first_bytes_problem(matcher)
    if reason is None:
        return None
    if is_no_match(reason):  # every byte string is a token sequence here: nothing matches at all
        return "no text can match it"
    return f"the grammar engine stopped on it: {reason}"


def _first_bytes_problem(matcher, steps: int = 4) -> str | None:
    """The grammar engine's error on the first few bytes of a match (each the lowest byte that
    the grammar allows), or None. Some limits show only there: `a{1000000}` compiles, then the
    lexer gives up on the first `a` ("too many expressions constructed"), and every row failed."""
    import numpy as np

    for _ in range(steps):
        allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8), bitorder="little"))
        if not len(allowed) or allowed[0] >= 256:
            return None  # only the end can follow
        consumed = matcher.consume_token(int(allowed[0]))
        if matcher.is_error():
            reason = matcher.get_error().split("\n", 1)[0]
            return None if is_no_match(reason) else reason
        if not consumed:
            return None
    return None


class _Bytes:
    """A vocabulary of the 256 bytes and an end token: any text is a token sequence."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


@functools.lru_cache(maxsize=1)
def _byte_tokenizer():
    from llguidance import LLTokenizer, TokenizerWrapper

    return LLTokenizer(TokenizerWrapper(_Bytes()))
