"""Grammars, their compilation by llguidance, and the token masks they give."""
from __future__ import annotations

import pytest
import torch

from batchprompt.structured import Grammar, GrammarCompiler, GrammarError
from batchprompt.structured.mask import allowed_tokens


@pytest.fixture(scope="module")
def compiler(engine32):
    tok = engine32.tokenizer
    return GrammarCompiler(tok.hf, engine32.model.args.vocab_size, tok.eos_token_ids)


def test_grammar_constructors_check_their_input():
    with pytest.raises(ValueError, match="at least one label"):
        Grammar.choices([])
    # As vLLM's guided_choice: one label is an answer, a repeated one counts once.
    assert Grammar.choices(["spam"]).num_labels == 1
    assert Grammar.choices(["a", "b", "a"]) == Grammar.choices(["a", "b"])
    with pytest.raises(ValueError, match="list of strings"):
        Grammar.choices("spam,ham")
    with pytest.raises(ValueError, match="not valid JSON"):
        Grammar.json_schema("{oops")
    with pytest.raises(ValueError, match="unknown grammar kind"):
        Grammar("yaml", "x")
    # Equal schemas are equal grammars (compiled once); properties keep their order.
    assert Grammar.json_schema({"a": 1, "b": 2}) == Grammar.json_schema('{"a": 1, "b": 2}')
    assert Grammar.json_schema({"a": 1, "b": 2}) != Grammar.json_schema('{"b": 2, "a": 1}')


def test_a_boolean_json_schema_is_json_schemas_true_or_false(compiler):
    # JSON Schema's boolean form (as OpenAI's response_format and vLLM pass it on): `true` is any
    # JSON value, as `{}`; `false` matches nothing, so it is refused before any work. Both said
    # "must be a dict".
    assert Grammar.json_schema(True) == Grammar.json_schema("true") == Grammar.json_schema({})
    matcher = compiler.matcher(Grammar.json_schema(True))
    assert matcher is not None
    with pytest.raises(ValueError, match="`false`, which no JSON value matches"):
        Grammar.json_schema(False)
    with pytest.raises(ValueError, match="must be a JSON schema: an object \\(a dict\\), got an array"):
        Grammar.json_schema([])
    with pytest.raises(ValueError, match="got a string"):  # JSON text whose value is a string: it said "got str"
        Grammar.json_schema('"abc"')


@pytest.mark.parametrize("grammar, message", [
    (Grammar.regex("a(b"), "unclosed group"),
    (Grammar.json_schema({"type": "object", "properties": {"a": {"type": "strin"}}}), "strin"),
    (Grammar.lark("start: missing_rule"), "missing_rule"),
    (Grammar.regex(r"[^\s\S]"), "the regex cannot be satisfied: no text the model can write matches it"),
    (Grammar.regex(r"(spam|ham)[^\s\S]"), "the regex cannot be satisfied"),
])
def test_rejected_grammars_raise_a_clear_error(compiler, grammar, message):
    with pytest.raises(GrammarError, match=message):
        compiler.matcher(grammar)
    with pytest.raises(GrammarError, match=message):  # remembered, still raised
        compiler.matcher(grammar)


def test_a_gbnf_grammar_as_vllm_takes_it_matches_as_its_lark_twin(compiler, engine32):
    """vLLM's guided_grammar examples are GBNF (`root ::= ...`); it was refused ("Expected token
    '_', found '='"). GBNF is converted with llguidance's own tool; Lark is taken as it is."""
    tok = engine32.tokenizer
    gbnf = 'root ::= answer " (" digit digit "%)"\nanswer ::= "yes" | "no"\ndigit ::= [0-9]'
    lark = 'start: answer " (" DIGIT DIGIT "%)"\nanswer: "yes" | "no"\nDIGIT: /[0-9]/'
    for text, ok in (("yes (42%)", True), ("no (7%)", False), ("maybe (42%)", False)):
        for source in (gbnf, lark):
            m = compiler.matcher(Grammar.lark(source))
            walked = all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False))
            assert (walked and m.is_accepting()) == ok, (source, text)
    with pytest.raises(GrammarError, match="GBNF"):
        compiler.matcher(Grammar.lark('root ::= "yes" | ('))


def test_a_lark_rule_of_thousands_of_alternatives_is_walked(compiler, engine32):
    """Past llguidance's default of 2,000 items a parser row, such a rule compiled and then failed
    at its first token ("Current row has 3001 items; max is 2000"), as a long choices list did."""
    words = [f"w{i}x" for i in range(3000)]
    m = compiler.matcher(Grammar.lark("start: " + " | ".join(f'"{w}"' for w in words)))
    for t in engine32.tokenizer.encode("w2500x", add_special_tokens=False):
        assert m.consume_token(t), m.get_error()[:200]
    assert m.is_accepting()


def test_a_grammar_too_large_for_the_engine_says_so_in_one_line(compiler, engine32):
    """llguidance panics past 65,525 symbols: the error carried its Rust backtrace, 2.5 KB of it."""
    labels = [f"opt{i}" for i in range(15000)]
    ids = [engine32.tokenizer.encode(x, add_special_tokens=False) for x in labels]
    with pytest.raises(GrammarError) as e:
        compiler.matcher(Grammar.choices(labels, ids))
    assert str(e.value) == ("the grammar engine rejected the choices: 15000 labels make more than the 65,525 symbols "
                            "the grammar engine takes: make the choices smaller (fewer labels)")


def test_each_request_gets_its_own_matcher_state(compiler, engine32):
    g = Grammar.choices(["spam", "ham"])
    a, b = compiler.matcher(g), compiler.matcher(g)
    for t in engine32.tokenizer.encode("ham", add_special_tokens=False):
        assert a.consume_token(t)
    assert a.is_stopped() and not b.is_stopped()


def test_mask_allows_exactly_the_tokens_the_matcher_accepts(compiler, engine32):
    tok = engine32.tokenizer
    vocab = engine32.model.args.vocab_size
    matchers = [compiler.matcher(Grammar.choices(["spam", "ham"])), compiler.matcher(Grammar.regex(r"[0-9]{2}"))]
    allowed = allowed_tokens(matchers, vocab, torch.device("cpu"))
    assert allowed.shape == (2, vocab)
    labels = {tok.hf.convert_ids_to_tokens(i) for i in allowed[0].nonzero().squeeze(1).tolist()}
    assert labels == {"s", "sp", "h", "ha", "ham"}  # every token that starts "spam" or "ham"
    digits = allowed[1].nonzero().squeeze(1).tolist()
    assert digits and all(tok.decode([i]).isdigit() for i in digits)
    # Independent check, token by token: the matcher accepts a token iff the mask allows it.
    for i in list(range(0, vocab, 499)) + digits[:5]:
        m = matchers[1].deep_copy()
        assert bool(m.try_consume_tokens([i])) == bool(allowed[1, i]), i


@pytest.mark.parametrize("pattern, ascii", [
    (r"\d{4}", "[0-9]{4}"), (r"[\d.]+", "[0-9.]+"), (r"\w+", "[0-9A-Za-z_]+"), (r"\W", "[^0-9A-Za-z_]"),
    (r"\\d", r"\\d"), (r"[^\w]", "[^0-9A-Za-z_]"), (r"[]\d]", "[]0-9]"), (r"a\.b", r"a\.b"),
])
def test_a_regexs_digit_and_word_classes_are_ascii_as_vllm_reads_them(pattern, ascii):
    assert Grammar.regex(pattern).source == ascii


def test_a_regexs_digits_are_ascii_digits_in_the_mask(compiler, engine32):
    """`\\d` took any Unicode digit: the model answered `\\d{4}` with four U+1FBF8 (a digit of
    "Symbols for Legacy Computing"), 4 of 5 times."""
    tok, vocab = engine32.tokenizer, engine32.model.args.vocab_size
    allowed = allowed_tokens([compiler.matcher(Grammar.regex(r"\d+"))], vocab, torch.device("cpu"))[0]
    texts = [tok.decode([i]) for i in allowed.nonzero().squeeze(1).tolist()]
    assert texts and all(t and set(t) <= set("0123456789") for t in texts), [t for t in texts if not t.isascii()][:5]


def test_a_schema_of_many_optional_properties_compiles(compiler, engine32):
    """501 optional properties were refused: "Current row has 2003 items; max is 2000; consider
    making your grammar left-recursive", which the user cannot act on (all required, it compiled)."""
    schema = {"type": "object", "properties": {f"f{i}": {"type": "integer"} for i in range(501)}}
    matcher = compiler.matcher(Grammar.json_schema(schema))
    for t in engine32.tokenizer.encode('{"f1', add_special_tokens=False):
        assert matcher.consume_token(t), matcher.get_error()
    assert not matcher.is_error()


def test_choices_with_token_ids_walk_only_those_tokens(compiler, engine32):
    tok = engine32.tokenizer
    labels = ["spam", "ham", "hamper"]
    ids = [tok.encode(c, add_special_tokens=False) for c in labels]
    m = compiler.matcher(Grammar.choices(labels, ids))
    vocab = engine32.model.args.vocab_size
    first = allowed_tokens([m], vocab, torch.device("cpu"))[0].nonzero().squeeze(1).tolist()
    assert sorted(first) == sorted({i[0] for i in ids})  # not "s", "h", "ha": only the labels' own tokens
    for t in ids[1]:
        assert m.consume_token(t)
    eos = next(iter(tok.eos_token_ids))
    after_ham = set(allowed_tokens([m], vocab, torch.device("cpu"))[0].nonzero().squeeze(1).tolist())
    assert eos in after_ham and (ids[2][1] in after_ham if ids[2][0] == ids[1][0] else True)


def test_eos_is_allowed_only_once_the_grammar_accepts(compiler, engine32):
    tok = engine32.tokenizer
    eos = next(iter(tok.eos_token_ids))
    m = compiler.matcher(Grammar.regex(r"[0-9]{1,3}"))
    vocab = engine32.model.args.vocab_size
    assert not allowed_tokens([m], vocab, torch.device("cpu"))[0, eos]
    assert m.consume_token(tok.encode("7", add_special_tokens=False)[0])
    assert allowed_tokens([m], vocab, torch.device("cpu"))[0, eos]


def test_a_grammar_compiled_by_two_threads_at_once_is_compiled_once(engine32, monkeypatch):
    """Compiling runs outside the compiler's lock (so a long compile holds up no other grammar):
    a second thread asking for the same grammar meanwhile waits for the first one's result."""
    import threading

    tok = engine32.tokenizer
    compiler = GrammarCompiler(tok.hf, engine32.model.args.vocab_size, tok.eos_token_ids)
    compiles, inside, release = [], threading.Event(), threading.Event()
    real = compiler._compile

    def counted(grammar):
        compiles.append(grammar.source)
        if grammar.source == "slow":
            inside.set()
            release.wait(30)
        return real(grammar)

    monkeypatch.setattr(compiler, "_compile", counted)
    slow, quick = Grammar.regex("slow"), Grammar.regex("quick")
    threads = [threading.Thread(target=compiler.matcher, args=(slow,)) for _ in range(3)]
    threads[0].start()
    assert inside.wait(30)
    for t in threads[1:]:
        t.start()
    compiler.matcher(quick)  # another grammar compiles while "slow" is under way
    assert not compiler.is_compiled(slow)
    release.set()
    for t in threads:
        t.join(30)
    assert compiles == ["slow", "quick"] and compiler.is_compiled(slow)
