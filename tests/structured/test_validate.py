"""Grammars checked before any work, without the model's tokenizer (llguidance's validation
and a probe on a vocabulary of bytes)."""
from __future__ import annotations

import pytest

from batchprompt.structured import Grammar
from batchprompt.structured.validate import grammar_problem


@pytest.mark.parametrize("grammar, message", [
    (Grammar.regex("(unclosed"), "unclosed group"),
    (Grammar.json_schema('{"type": "frobnicate"}'), "Invalid type: frobnicate"),
    (Grammar.json_schema({"type": "object", "properties": {"a": {"type": "string", "format": "colour"}}}),
     "Unknown format: colour"),
    (Grammar.lark("start: missing_rule"), "missing_rule"),
    (Grammar.regex(r"[^\s\S]"), "no text can match it"),
    (Grammar.regex(r"(spam|ham)[^\s\S]"), "no text can match it"),
    # Only the empty text: every answer was "" with finish_reason "stop", as if the model had answered.
    (Grammar.regex("a{0}"), "only the empty text matches it"),
    (Grammar.lark("root ::= "), "only the empty text matches it"),
    (Grammar.lark('root ::= ""'), "only the empty text matches it"),
    (Grammar.json_schema({"type": "object", "properties": {"a": {"type": "string", "pattern": r"[^\s\S]"}},
                          "required": ["a"]}), "unsatisfiable"),
    # GBNF naming a rule it does not define: llguidance's converter raises a plain Exception, which
    # was a bare Exception in Python, a 500 on the server and a row "not journaled" in a job.
    (Grammar.lark("root ::= foo"), "does not convert to Lark: Rule 'foo' not found"),
    # Compiles, then the lexer gives up on the first byte: every row failed, as "refused token 2".
    (Grammar.regex("a{1000000}"), "the grammar engine stopped on it: lexer error: too many expressions"),
    (Grammar.regex("xa{1000000}"), "too many expressions"),
    # GBNF with a rule named start was read as Lark ("Expected token '_', found '='"); llguidance's
    # converter cannot take it (its root becomes start), and says so in GBNF's terms now.
    (Grammar.lark('root ::= start\nstart ::= "z"'), "reads as GBNF (it has '::=') but does not convert"),
])
def test_problems_are_found_without_a_tokenizer(grammar, message):
    problem = grammar_problem(grammar)
    assert problem is not None and message in problem
    assert grammar_problem(grammar) == problem  # cached, same answer


@pytest.mark.parametrize("grammar", [
    Grammar.regex(r"(spam|ham) \([0-9]{1,2}%\)"),
    Grammar.regex("a?"),  # the empty text among others
    Grammar.regex("a{100000}"),  # large, within the lexer's limits
    # GBNF's \u and \U escapes, which llguidance's converter turned into \ue9 (a lexer error): refused
    Grammar.lark('root ::= "\\u00e9" [\\u00e0-\\u00ff]+ "\\U0001F600"'),
    Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}),
    Grammar.json_object(),
    Grammar.lark('start: "yes" | "no" <[2]>'),  # token ids are the engine's to check, with its vocabulary
])
def test_usable_grammars_pass(grammar):
    assert grammar_problem(grammar) is None


def test_gbnf_unicode_escapes_match_their_characters():
    from llguidance import LLMatcher

    from batchprompt.structured.validate import _byte_tokenizer

    grammar = Grammar.lark('root ::= "\\u00e9" [\\u00e0-\\u00ff]+ "\\U0001F600" [\\u4e00-\\u9fff] "\\\\u00e9"')
    for text, ok in (("éàÿ😀中\\u00e9", True), ("e\u00e0😀中\\u00e9", False), ("éà😀中é", False)):
        m = LLMatcher(_byte_tokenizer(), grammar.to_llguidance(), log_level=0)
        assert (all(m.consume_token(b) for b in text.encode()) and m.is_accepting()) == ok, text


@pytest.mark.parametrize("source", ['start: a\na: "x" a', 'start: a\na: "(" a ")"', 'root ::= a\na ::= "x" a'])
def test_a_grammar_whose_text_never_ends_is_refused_before_any_work(source):
    """No text completes it: it compiled, and every request failed at its first step in llguidance's
    words ("parser error: Too many items (limit 50000; ff_tokens)")."""
    problem = grammar_problem(Grammar.lark(source))
    assert problem is not None and problem.startswith("no text can match it: it forces a text that never ends")


def test_a_recursive_grammar_that_can_end_is_taken():
    assert grammar_problem(Grammar.lark('start: a\na: "x" a | "y"')) is None
