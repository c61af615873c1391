"""Structured output through the batch API: choices (both ways), regex, JSON schema,
pydantic classes and OpenAI's response_format, on the embedded model in float32."""
from __future__ import annotations

import json
import math
import re
import threading
from typing import Literal

import jsonschema
import pydantic
import pytest

import batchprompt as bp
from batchprompt.api.structured import OutputSpec

from ..conftest import SPAM_SYSTEM

SCHEMA = {"type": "object",
          "properties": {"sender": {"enum": ["person", "business", "unknown"]},
                         "urgency": {"type": "integer", "minimum": 1, "maximum": 5},
                         "contains_link": {"type": "boolean"},
                         "summary": {"type": "string", "maxLength": 40}},
          "required": ["sender", "urgency", "contains_link", "summary"], "additionalProperties": False}


class Fields(pydantic.BaseModel):
    sender_type: Literal["person", "business", "unknown"]
    urgency: Literal["low", "medium", "high"]
    contains_link: bool


@pytest.mark.parametrize("mode", ["decode", "score"])
def test_every_answer_is_one_of_the_choices(lm, messages, mode):
    labels = ["spam", "ham", "not sure"]
    results = lm.batch_prompt(messages, choices=labels, choice_mode=mode)
    assert all(r.ok and r.text in labels for r in results)
    if mode == "score":
        for r in results:
            assert set(r.choice_probs) == set(labels)
            assert math.isclose(sum(r.choice_probs.values()), 1.0, rel_tol=1e-6)
            assert r.text == max(r.choice_probs, key=r.choice_probs.get)
    else:
        assert all(r.choice_probs is None and r.finish_reason == "stop" for r in results)


def test_fifteen_thousand_labels_are_decoded(lm, messages):
    """As a trie of token ids they ran out of the grammar engine's symbols: every row failed with a
    Rust panic and its hundred-line backtrace. They now go as text, still exactly one label each."""
    labels = ["spam", "ham"] + [f"opt{i}" for i in range(15000)]
    results = lm.batch_prompt(messages[:3], choices=labels)
    assert all(r.ok and r.text in labels for r in results), [(r.text, r.error) for r in results]


def test_a_schema_nested_too_deeply_or_holding_itself_is_a_value_error():
    # Both raised a bare RecursionError.
    deep = {"type": "integer"}
    for _ in range(900):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    loop = {"type": "object"}
    loop["properties"] = {"x": loop}
    # 200 levels: below Python's recursion limit, beyond the grammar engine's JSON reader's (on
    # Python 3.12, 900 levels were too: its message said "recursion limit exceeded at line 1 column 2451")
    shallower = {"type": "integer"}
    for _ in range(200):
        shallower = {"type": "object", "properties": {"a": shallower}, "required": ["a"]}
    for schema in (deep, loop, shallower):
        with pytest.raises(ValueError, match="bad json_schema .*nested too deeply, or it holds itself"):
            OutputSpec.from_options(json_schema=schema)


def test_seventy_thousand_labels_are_decoded(lm, messages):
    """As text, one lexeme each: 50,000 labels failed every row after its first token ("lexer
    error: too many expressions constructed"), after 4 s of compiling on the engine's thread, and
    more than 65,525 ran out of the grammar engine's symbols. They are now one lexeme together."""
    labels = [f"label number {i}" for i in range(70000)]
    results = lm.batch_prompt(messages[:2], choices=labels, max_tokens=16)
    assert all(r.ok and r.text in labels for r in results), [(r.text, r.error) for r in results]


def test_a_grammar_being_compiled_holds_up_no_other_request(lm, monkeypatch):
    """It was compiled on the engine's thread as its request entered the engine: every other
    request waited for it (4 s for 50,000 labels). It is now compiled first, on a thread of its own."""
    compiler = lm.engine.grammars
    started, release = threading.Event(), threading.Event()
    real = compiler._compile
    pattern = "(yes|no) held"  # its own: no other test has it compiled

    def held(grammar):
        if grammar.source == pattern:
            started.set()
            release.wait(30)
        return real(grammar)

    monkeypatch.setattr(compiler, "_compile", held)
    constrained = lm.create_batch(["Is it spam?"], regex=pattern, max_tokens=8).start()
    try:
        assert started.wait(30)
        [plain] = lm.create_batch(["Lunch at 1?"], max_tokens=2).wait(timeout=20)
        assert plain.ok and not constrained.done
    finally:
        release.set()
    [answer] = constrained.wait(timeout=60)
    assert answer.ok and answer.text in ("yes held", "no held"), (answer.text, answer.error)


def test_an_output_cut_inside_a_character_is_judged_on_the_text_written(engine32):
    """max_tokens ending inside a character leaves it out of the text, as vLLM does; a text that is
    then a whole match failed as "reached max_tokens before it completed the regex"."""
    pattern = r"(é|ü|日本)+"
    with bp.LanguageModel.create(system="Answer in JSON.", model=engine32) as lm:
        results = [lm.batch_prompt(["Extract info: Mary, 7 years old, from Tokyo."], regex=pattern, max_tokens=n)[0]
                   for n in range(1, 9)]
    assert [r.text for r in results] == ["", "", "日", "日本", "日本", "日本日", "日本日本", "日本日本"]
    for r in results:  # 5 and 8 tokens end inside the next 日
        assert (r.error is None) == bool(re.fullmatch(pattern, r.text)), (r.text, r.error)


def test_min_tokens_does_not_hold_an_answer_past_the_end_of_its_regex(lm):
    # As the README says: min_tokens holds back EOS only while the grammar allows more.
    [r] = lm.batch_prompt(["Say a or b"], regex="(a|b)", min_tokens=5, max_tokens=10)
    assert (r.ok, r.text in ("a", "b"), r.finish_reason, r.usage.completion_tokens) == (True, True, "stop", 1)


def test_min_tokens_beyond_the_longest_label_names_the_labels(lm):
    """It said "min_tokens must be ... from 0 to max_tokens (1)" where the caller gave max_tokens=10."""
    with pytest.raises(ValueError, match=r"min_tokens \(5\) is more than the longest label \(1 token\)"):
        lm.batch_prompt(["x"], choices=["yes", "no"], min_tokens=5, max_tokens=10)


def test_choices_set_on_the_session_and_overridden_per_call(engine32, messages):
    with bp.LanguageModel.create(system=SPAM_SYSTEM, model=engine32, choices=["spam", "ham"]) as lm:
        assert all(r.text in ("spam", "ham") for r in lm.batch_prompt(messages[:4]))
        free = lm.batch_prompt(messages[:4], response_format={"type": "text"}, max_tokens=6)
        assert any(r.text not in ("spam", "ham") for r in free)
        assert lm.prompt(messages[0], choices=["yes", "no"]) in ("yes", "no")


def test_scored_probabilities_are_the_model_s_likelihoods(lm, engine32, messages):
    """Check one item by hand: the probability of each label is its normalised likelihood
    under the model, computed here with prompt log-probs over prompt + label."""
    r = lm.batch_prompt(messages[:1], choices=["spam", "ham"], choice_mode="score")[0]
    tok = engine32.tokenizer
    prompt = tok.encode_prompt(messages[0], SPAM_SYSTEM)
    lls = []
    for label in ("spam", "ham"):
        out = engine32.generate([prompt + tok.encode(label, add_special_tokens=False)],
                                bp.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs_from=len(prompt)))[0]
        lls.append(sum(out.prompt_logprobs))
    z = sum(math.exp(v) for v in lls)
    assert r.choice_probs["spam"] == pytest.approx(math.exp(lls[0]) / z, rel=1e-3)


def test_scored_probabilities_in_bfloat16_are_not_rounded_to_a_few_values(messages):
    """In bfloat16 the output head rounds a logit of 10-20 to a multiple of 1/16: two one-token
    labels' log-odds fell on that grid (0.375, -1.0, 0.625 ... for 20 messages), so distinct
    messages tied and probabilities moved in steps of several points. A scored label's logit is
    now computed in float32 (the sum over the vocabulary cancels between labels)."""
    from batchprompt import LLMEngine

    engine = LLMEngine.from_pretrained(dtype="bfloat16", max_num_batched_tokens=1024)
    session = bp.LanguageModel.create(system="Is this message spam? Answer yes or no.", model=engine)
    try:
        tok = engine.tokenizer
        assert [len(tok.encode(c, add_special_tokens=False)) for c in ("yes", "no")] == [1, 1]
        results = session.batch_prompt(messages[:20], choices=["yes", "no"], choice_mode="score")
    finally:
        session.destroy()
    odds = [math.log(r.choice_probs["yes"] / r.choice_probs["no"]) for r in results]
    on_grid = [x for x in odds if abs(x * 1024 - round(x * 1024)) < 1e-3]
    assert len(on_grid) <= 1, odds  # a value met by chance: 0.2% a message


def test_json_schema_outputs_validate(lm, messages):
    results = lm.batch_prompt([m + "\nDescribe this message in JSON." for m in messages[:12]],
                              json_schema=SCHEMA, max_tokens=80)
    for r in results:
        assert r.ok, r.error
        jsonschema.validate(json.loads(r.text), SCHEMA)
        assert r.parsed == json.loads(r.text)


def test_a_stop_string_that_ends_a_json_answer_early_leaves_its_text(lm, messages):
    """A stop string the caller gave ended a JSON answer before it was whole: the call failed
    ("does not parse as the schema asks"; a 400 from the server, whose stream of the same answer
    read fine). vLLM answers with the text and finish_reason "stop"; so do we, parsing nothing."""
    ask = messages[0] + "\nDescribe this message in JSON."
    r = lm.batch_prompt([ask], json_schema=SCHEMA, max_tokens=80, stop=[":"])[0]
    assert r.ok and r.finish_reason == "stop" and r.parsed is None, r
    assert r.text.startswith("{") and ":" not in r.text
    whole = lm.batch_prompt([ask], json_schema=SCHEMA, max_tokens=80)[0]  # the same answer, unstopped
    assert whole.ok and whole.parsed is not None and whole.text.startswith(r.text)


def test_pydantic_class_results_parse_into_instances(lm, messages):
    results = lm.batch_prompt(messages[:8], json_schema=Fields, max_tokens=60)
    assert all(r.ok and isinstance(r.parsed, Fields) for r in results)
    via_openai = lm.batch_prompt(messages[:2], response_format=Fields, max_tokens=60)
    assert [r.parsed for r in via_openai] == [r.parsed for r in results[:2]]


def test_openai_response_format_shapes(lm, messages):
    fmt = {"type": "json_schema", "json_schema": {"name": "fields", "schema": SCHEMA, "strict": True}}
    for r in lm.batch_prompt(messages[:3], response_format=fmt, max_tokens=80):
        jsonschema.validate(r.parsed, SCHEMA)
    # Any object: a 135M model sometimes rambles on inside it until max_tokens (a clear error);
    # every answer it completes is a JSON object.
    asks = [m + "\nAnswer in JSON with keys label and reason." for m in messages[:8]]
    results = lm.batch_prompt(asks, response_format={"type": "json_object"}, max_tokens=60)
    assert sum(r.ok for r in results) >= 4
    for r in results:
        if r.ok:
            assert isinstance(r.parsed, dict) and r.parsed == json.loads(r.text)
        else:
            assert "raise max_tokens" in r.error


def test_regex_outputs_match(lm, messages):
    pattern = r"(spam|ham) \([0-9]{1,2}%\)"
    for r in lm.batch_prompt(messages[:8], regex=pattern, max_tokens=12):
        assert r.ok and re.fullmatch(pattern, r.text), r.text


def test_a_rejected_schema_fails_its_call_before_any_work(lm, messages):
    bad = {"type": "object", "properties": {"a": {"type": "strin"}}}
    with pytest.raises(ValueError, match="bad json_schema .*Invalid type: strin"):
        lm.create_batch(messages[:3], json_schema=bad)
    assert all(r.ok for r in lm.batch_prompt(messages[:3], choices=["spam", "ham"]))  # the session goes on


@pytest.mark.parametrize("options, message", [
    ({"regex": "(unclosed"}, "(?s)bad regex .*unclosed group"),
    ({"regex": r"[^\s\S]"}, "bad regex .*no text can match it"),
    ({"regex": r"(spam|ham)[^\s\S]"}, "bad regex .*no text can match it"),
    ({"regex": "a{0}"}, "bad regex .*only the empty text matches it"),
    ({"json_schema": '{"type": "frobnicate"}'}, "bad json_schema .*Invalid type: frobnicate"),
    ({"json_schema": {"type": "frobnicate"}}, "bad json_schema .*Invalid type: frobnicate"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": {"type": "strin"}}}},
     "bad response_format .*strin"),
    ({"grammar": "start: missing_rule"}, "(?s)bad grammar .*missing_rule"),
    # OpenAI refuses a strict that is not a boolean ("yes" was taken as given)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": {}, "strict": "yes"}}},
     "json_schema.strict must be true or false, got 'yes'"),
    # A keyword llguidance cannot enforce (a pydantic set[str]'s uniqueItems): how to go on, not only what
    ({"json_schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
     r'Unimplemented keys: \["uniqueItems"\]; the grammar engine cannot enforce it: .*'
     r'"x-guidance": \{"lenient": true\}'),
    # JSON Schema's `false` matches nothing (it said "must be a dict", and a response_format one
    # "its schema is bool, not a JSON object")
    ({"json_schema": False}, "`false`, which no JSON value matches"),
    # llguidance's "Enable 'coerce_one_of' option" said not where; its integer range error showed
    # 64-bit bounds, not those given, as Rust's Some(...)
    ({"json_schema": {"oneOf": [{"type": "integer", "minimum": 0}, {"type": "integer", "maximum": 10}]}},
     r'"x-guidance": \{"coerce_one_of": true\}'),
    ({"json_schema": {"type": "integer", "minimum": -10**20, "maximum": 10**20}}, "beyond 64-bit integers"),
    ({"json_schema": {"type": "number", "exclusiveMaximum": 1e300}}, "too large for the grammar engine to bound"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": False}}},
     "`false`, which no JSON value matches"),
])
def test_options_the_grammar_engine_rejects_are_value_errors_at_once(options, message):
    """No model and no tokenizer needed: the CLI checks its flags with this before loading one."""
    with pytest.raises(ValueError, match=message):
        OutputSpec.from_options(**options)


@pytest.mark.parametrize("options", [{"json_schema": True},
                                     {"response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "any", "schema": True}}}])
def test_a_true_schema_is_any_json_value(options):
    """JSON Schema's boolean `true` (which OpenAI's response_format and vLLM pass on) is `{}`."""
    assert OutputSpec.from_options(**options).grammar == OutputSpec.from_options(json_schema={}).grammar


@pytest.mark.parametrize("options", [{"regex": r"<\|im_end\|>"}, {"grammar": 'start: "<|im_end|>" "!"'}])
def test_a_grammar_that_forces_a_special_tokens_text_says_so(lm, options):
    """llguidance offers the special token for such text, then refuses it: the error was its own
    ("refused token 2: Parser Error: token "\ufffd[2]" doesn't satisfy the grammar; forced bytes")."""
    r = lm.batch_prompt(["hi"], max_tokens=8, **options)[0]
    assert r.finish_reason == "error"
    assert "asks for the text '<|im_end|>', which is the model's special token 2" in r.error, r.error
    assert "Parser Error" not in r.error


def test_a_dict_schema_admits_only_its_properties(engine32, messages):
    """A plain dict schema (no additionalProperties) gets no extra keys, so the answers end.
    (With extra keys allowed, this model invents "message", "body", ... on most of these and
    runs out of max_tokens.)"""
    schema = {"type": "object", "properties": {"sender": {"type": "string", "maxLength": 24},
                                               "topic": {"type": "string", "maxLength": 24}},
              "required": ["sender", "topic"]}
    with bp.LanguageModel.create(system="Extract the fields of this SMS as JSON.", model=engine32) as lm:
        results = lm.batch_prompt(messages[:8], json_schema=schema, max_tokens=48)
        for r in results:
            assert r.ok, r.error
            jsonschema.validate(r.parsed, {**schema, "additionalProperties": False})


@pytest.mark.parametrize("mode", ["decode", "score"])
def test_labels_respect_max_tokens_in_both_modes(lm, engine32, messages, mode):
    long_label = "definitely not spam at all, just a friend"
    labels = [long_label, "spam"]
    n = len(engine32.tokenizer.encode(long_label, add_special_tokens=False))
    with pytest.raises(ValueError, match=f"is {n} tokens, more than max_tokens \\(2\\): raise max_tokens"):
        lm.batch_prompt(messages[:2], choices=labels, choice_mode=mode, max_tokens=2)
    results = lm.batch_prompt(messages[:4], choices=labels, choice_mode=mode, max_tokens=n)
    for r in results:
        assert r.ok and r.text in labels
        if mode == "decode":
            assert r.usage.completion_tokens <= n


def test_output_cut_by_max_tokens_is_a_clear_error(lm, messages):
    r = lm.batch_prompt(messages[:1], json_schema=SCHEMA, max_tokens=5)[0]
    assert not r.ok and "raise max_tokens" in r.error and r.text  # the partial text is kept


@pytest.mark.parametrize("option", [{"regex": "a+"}, {"json_schema": {"type": "integer"}}])
def test_an_output_that_is_already_a_match_when_max_tokens_cuts_it_is_kept(lm, option):
    """"a+" cut after 4 tokens of a's, or an integer cut after 4 digits, is a whole match that
    could have gone on: finish_reason "length" and no error, as vLLM returns it."""
    r = lm.batch_prompt(["Write the letter a many times, nothing else."], max_tokens=4, **option)[0]
    assert r.finish_reason == "length" and r.ok, r.error
    if "regex" in option:
        assert re.fullmatch("a+", r.text)
    else:
        assert isinstance(r.parsed, int) and str(r.parsed) == r.text


def test_a_cut_json_output_that_parses_but_is_no_whole_match_is_the_clear_error(lm):
    """'1' of an integer >= 100000, cut by max_tokens, parses as JSON: it came back ok, with
    finish_reason "length" and a value the schema refuses. The engine knows it is no match."""
    for schema in ({"type": "integer", "minimum": 100000}, {"enum": [123456, 789012]}):
        r = lm.batch_prompt(["How many people live in Paris?"], json_schema=schema, max_tokens=1)[0]
        assert r.finish_reason == "length" and not r.ok and r.parsed is None, (schema, r)
        assert "before it completed the json_schema: raise max_tokens" in r.error


def test_a_schema_that_only_its_closing_makes_unusable_says_how_to_open_it():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2}
    with pytest.raises(ValueError) as e:
        OutputSpec.from_options(json_schema=schema)
    assert 'give the object "additionalProperties": true to leave it open' in str(e.value)
    OutputSpec.from_options(json_schema={**schema, "additionalProperties": True})  # usable, as written
    with pytest.raises(ValueError) as e:  # unusable whatever is closed: no such hint
        OutputSpec.from_options(json_schema={"type": "strin"})
    assert "additionalProperties" not in str(e.value)


def test_a_cut_output_from_a_backend_that_cannot_tell_is_complete_only_if_json_parses():
    """A remote server's output cut by max_tokens says nothing of its grammar: a JSON one is
    kept if it parses, anything else is the clear error."""
    json_spec = OutputSpec.from_options(json_schema={"type": "integer"})
    ok = json_spec.finish(bp.Result(0, "1234", "length"))
    assert ok.ok and ok.parsed == 1234
    assert "raise max_tokens" in json_spec.finish(bp.Result(0, '{"a": 1', "length")).error
    assert "raise max_tokens" in OutputSpec.from_options(regex="a+").finish(bp.Result(0, "aaa", "length")).error
    assert OutputSpec.from_options(regex="a+").finish(bp.Result(0, "aaa", "length"), complete=True).ok


def test_a_number_inside_an_exclusive_bound_that_a_float_rounds_onto_it_is_an_error():
    """"0.99999999999999999999" fits exclusiveMaximum 1 as text, and the grammar allows it, but it
    parsed to 1.0: the result was ok with a `parsed` that broke its own schema."""
    schema = {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
                                               "q": {"type": "number", "minimum": 0, "maximum": 5,
                                                     "exclusiveMaximum": True}}}
    spec = OutputSpec.from_options(json_schema=schema)
    for text in ('{"p": 0.99999999999999999999, "q": 1}', '{"p": 0.5, "q": 4.99999999999999999999}',
                 '{"p": 1e-400, "q": 1}'):
        r = spec.finish(bp.Result(0, text, "stop"), complete=True)
        assert not r.ok and "exclusive bound" in r.error and r.parsed is None, (text, r)
    number = OutputSpec.from_options(json_schema={"type": "number"})
    huge = number.finish(bp.Result(0, "4e99999", "stop"), complete=True)
    assert not huge.ok and "too large for a float" in huge.error  # it was ok, with .parsed inf
    fine = spec.finish(bp.Result(0, '{"p": 0.9999, "q": 1.5}', "stop"), complete=True)
    assert fine.ok and fine.parsed == {"p": 0.9999, "q": 1.5}
    jsonschema.validate(fine.parsed["p"], schema["properties"]["p"])


@pytest.mark.parametrize("schema, text, where", [
    # The grammar engine let each of these through, as the answers of real rows showed
    ({"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}}},
     '{"p": 0}', "at p: 0 is less than or equal to the minimum of 0"),
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 3},
     '{"a": 1, "a": 2, "a": 3}', "does not have enough properties"),  # one key, three times
    ({"type": "string", "format": "date"}, '"2023-02-29"', "is not a 'date'"),
    # Formats jsonschema checks only with its format-nongpl libraries: these passed unchecked
    ({"type": "string", "format": "date-time"}, '"2023-02-29T10:00:00Z"', "is not a 'date-time'"),
    ({"type": "string", "format": "time"}, '"25:00:00Z"', "is not a 'time'"),
    ({"type": "string", "format": "duration"}, '"P1X"', "is not a 'duration'"),
    ({"type": "string", "format": "hostname"}, '"' + "a" * 300 + '.com"', "is not a 'hostname'"),
])
def test_an_answer_that_breaks_its_schema_is_an_error_never_ok(schema, text, where):
    """Each came back ok, with a `parsed` that broke the schema asked for."""
    r = OutputSpec.from_options(json_schema=schema).finish(bp.Result(0, text, "stop"), complete=True)
    assert not r.ok and r.parsed is None and where in r.error and "breaks its schema" in r.error, r
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.mark.parametrize("schema, text, where", [
    # A pattern Python's re cannot read (\p{Lu}) turned the whole check off, the date's included
    ({"type": "object", "properties": {"d": {"type": "string", "format": "date"},
                                       "n": {"type": "string", "pattern": "^\\p{Lu}"}}},
     '{"d": "2023-02-29", "n": "Alice"}', "at d: '2023-02-29' is not a 'date'"),
    ({"type": "string", "pattern": "^\\p{Lu}"}, '"alice"', "does not match"),
    ({"type": "string", "pattern": "^(?<word>[^\\W]+)$"}, '"\u00e9t\u00e9"', "does not match"),  # ASCII \W
])
def test_a_pattern_is_read_as_ecma_262_and_never_turns_the_check_off(schema, text, where):
    r"""jsonschema reads `pattern` with Python's re, which refuses \p{Lu} and (?<name>...): the
    whole check was skipped, and an impossible date came back ok. Here the patterns are read as
    the grammar engine reads them (the reference below: the `regex` module, by hand)."""
    r = OutputSpec.from_options(json_schema=schema).finish(bp.Result(0, text, "stop"), complete=True)
    assert not r.ok and r.parsed is None and where in r.error and "breaks its schema" in r.error, r
    import regex

    value = json.loads(text)
    if isinstance(value, dict):  # the date alone breaks it: "Alice" starts with a capital
        assert regex.search(r"^\p{Lu}", value["n"])
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value["d"], schema["properties"]["d"],
                                format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    else:
        by_hand = {"alice": r"^\p{Lu}", "\u00e9t\u00e9": r"^[0-9A-Za-z_]+$"}[value]  # \W as ECMA reads it
        assert not regex.search(by_hand, value)


@pytest.mark.parametrize("schema, text", [
    ({"type": "number", "multipleOf": 0.1}, "0.3"),  # 0.3 / 0.1 is 2.9999999999999996 in floats
    ({"type": "number", "minimum": 0, "exclusiveMinimum": True}, "0.5"),  # draft 4's form: true is not 1
    ({"type": "string", "format": "date"}, '"2024-02-29"'),
    ({"$ref": "https://example.com/elsewhere.json"}, '{"a": 1}'),  # cannot be checked here: the grammar's word
    # \D is ASCII in ECMA-262 and in the grammar engine: an Arabic-Indic digit is not a digit there,
    # where Python's re read it as one and failed the answer the grammar had allowed
    ({"type": "string", "pattern": "^\\D+$"}, '"\u0661"'),
    ({"type": "string", "format": "date-time"}, '"2024-02-29T10:00:00Z"'),
    ({"type": "string", "format": "date-time"}, '"2016-12-31T23:59:60Z"'),  # a leap second: it was refused
    ({"type": "string", "format": "time"}, '"23:59:60.5+00:00"'),
    ({"type": "string", "pattern": "^\\p{Lu}[a-z]+$"}, '"Alice"'),
])
def test_an_answer_that_fits_its_schema_is_not_refused_by_the_check(schema, text):
    spec = OutputSpec.from_options(json_schema=schema) if "$ref" not in schema else None
    if spec is None:
        from batchprompt.api.structured import schema_problem

        assert schema_problem(json.loads(text), json.dumps(schema)) is None
        return
    r = spec.finish(bp.Result(0, text, "stop"), complete=True)
    assert r.ok and r.parsed == json.loads(text), r


def test_a_stop_string_that_cuts_a_json_answer_that_parses_leaves_its_text():
    """"1" of "150", cut by the stop string "5", parses as JSON but broke minimum 100: the row
    failed, saying the grammar engine had let it through. As a cut object does, it is the answer
    with finish_reason "stop", nothing parsed; from a remote server (which cannot say whether
    the grammar was whole) too."""
    spec = OutputSpec.from_options(json_schema={"type": "integer", "minimum": 100, "maximum": 999})
    for complete in (False, None):
        r = spec.finish(bp.Result(0, "1", "stop"), complete=complete, asked_stop=True)
        assert r.ok and r.text == "1" and r.parsed is None, (complete, r)
    # Without a stop string of the caller's, the same answer is the check's error
    assert "breaks its schema" in spec.finish(bp.Result(0, "1", "stop"), complete=True).error
    assert spec.finish(bp.Result(0, "150", "stop"), complete=True, asked_stop=True).parsed == 150
    # A stop string at the very end ("}" of an object): the grammar is whole, the text is not
    obj = OutputSpec.from_options(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
    r = obj.finish(bp.Result(0, '{"a":1', "stop", stop_reason="}"), complete=True, asked_stop=True)
    assert r.ok and r.text == '{"a":1' and r.parsed is None, r


def test_a_pydantic_class_refuses_a_number_too_large_for_a_float():
    """pydantic read 1e999 as inf: ok, with x=inf, where the dict schema's answer was the error."""
    class R(pydantic.BaseModel):
        x: float

    r = OutputSpec.from_options(json_schema=R).finish(bp.Result(0, '{"x":1e999}', "stop"), complete=True)
    assert not r.ok and "too large for a float" in r.error and r.parsed is None, r


def test_response_format_text_beside_a_json_schema_asks_for_nothing_more():
    """{"type": "text"} asks for no constraint: beside choices or a regex it was taken, beside a
    json_schema it was "give either response_format or json_schema, not both"."""
    spec = OutputSpec.from_options(json_schema={"type": "integer"}, response_format={"type": "text"})
    assert spec.grammar.is_json
    with pytest.raises(ValueError, match="not both"):
        OutputSpec.from_options(json_schema={"type": "integer"}, response_format={"type": "json_object"})


@pytest.mark.parametrize("pattern, inside, outside", [
    (r"[^\W\d_]+", "abcXYZ", "\u00e9t\u00e9"),  # letters: ASCII ones only
    (r"[\D]+", "ab\u0661", "a1"),  # \D in a class: not an ASCII digit
    (r"[\w-.]+@x", "a-b.c@x", "\u00e9@x"),  # a hyphen after \w is itself (the grammar engine refused it)
    (r"[+-\d]+", "12+30-4", ","),  # and before \d: written [+-0-9] it was a range + to 0 (no 1 to 8; a comma)
])
def test_regex_classes_inside_brackets_are_ascii(engine32, pattern, inside, outside):
    r"""[^\W] matched é (the grammar engine reads \W as Unicode); \D and \W inside a class were
    left to it. The README says \d and \w are ASCII."""
    from batchprompt.structured import Grammar, GrammarCompiler

    spec = OutputSpec.from_options(regex=pattern)
    tok = engine32.tokenizer
    compiler = GrammarCompiler(tok.hf, engine32.model.args.vocab_size, tok.eos_token_ids)
    for text, fits in ((inside, True), (outside, False)):
        m = compiler.matcher(spec.grammar)
        ids = tok.encode(text)
        assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) is fits, (pattern, text)
    assert isinstance(spec.grammar, Grammar)


def test_a_refused_regex_names_it_as_written():
    """The grammar engine quotes the pattern as it was given to it, [0-9A-Za-z_]{2,1}: the
    message names the caller's too."""
    with pytest.raises(ValueError) as e:
        OutputSpec.from_options(regex=r"\w{2,1}")
    assert "your regex: \\w{2,1}," in str(e.value), e.value


def test_bad_structured_options_are_clear_errors(lm, messages):
    with pytest.raises(ValueError, match="one structured-output option"):
        lm.batch_prompt(messages[:1], choices=["a", "b"], regex="a")
    with pytest.raises(ValueError, match="choice_mode"):
        lm.batch_prompt(messages[:1], choices=["a", "b"], choice_mode="vote")
    with pytest.raises(ValueError, match="response_format"):
        lm.batch_prompt(messages[:1], response_format={"type": "xml"})
    with pytest.raises(ValueError, match="at least one label"):
        lm.batch_prompt(messages[:1], choices=[])


def test_one_label_and_repeated_labels_are_taken_as_vllm_takes_them(lm, messages):
    """They were refused ("at least two labels", "duplicates"), where vLLM's guided_choice answers."""
    assert lm.batch_prompt(messages[:1], choices=["only"])[0].text == "only"
    assert lm.batch_prompt(messages[:1], choices=["spam", "ham", "spam"])[0].text in ("spam", "ham")
    r = lm.batch_prompt(messages[:1], choices=["spam", "ham", "spam"], choice_mode="score")[0]
    assert set(r.choice_probs) == {"spam", "ham"}


@pytest.fixture(scope="module")
def short_context():
    from batchprompt import LLMEngine

    engine = LLMEngine.from_pretrained(dtype="float32", max_model_len=128)
    yield bp.LanguageModel.create(model=engine, max_tokens=100)
    bp.shutdown(engine)


def _filling(lm, room: int) -> str:
    """A prompt that leaves `room` tokens of the 128-token context."""
    base = lm.batch_prompt([""], max_tokens=1)[0].usage.prompt_tokens
    return "dog " * (128 - room - base)


@pytest.mark.parametrize("option", [
    {"json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
    {"regex": "[a-z]{30}"},
])
def test_an_output_cut_by_the_end_of_the_context_says_shorten_the_prompt(short_context, option):
    """max_tokens=100 was cut to what the context leaves, and the error said "raise max_tokens",
    which cannot help."""
    r = short_context.batch_prompt([_filling(short_context, 2)], **option)[0]
    assert r.finish_reason == "length" and r.usage.completion_tokens < 100
    assert "the context ran out" in r.error and "shorten the prompt" in r.error, r.error


def test_choices_that_do_not_fit_the_context_are_refused_in_both_modes(short_context):
    """Decode mode returned a partial label (`'alpha'`, finish_reason length) with "raise max_tokens"."""
    labels = ["alpha beta gamma delta", "epsilon zeta eta theta"]
    for mode in ("decode", "score"):
        r = short_context.batch_prompt([_filling(short_context, 2)], choices=labels, choice_mode=mode)[0]
        assert r.text == "" and "do not fit the context of 128 tokens: shorten the prompt" in r.error, (mode, r)


def test_a_label_with_a_special_token_is_refused_in_decode_mode(lm, messages):
    """Decoding `<|im_end|>` ends the answer: the result was '' with no error."""
    with pytest.raises(ValueError, match=re.escape("'<|im_end|>' holds a special token")):
        lm.batch_prompt(messages[:1], choices=["<|im_end|>", "ham"])
    r = lm.batch_prompt(messages[:1], choices=["<|im_end|>", "ham"], choice_mode="score")[0]
    assert r.text in ("<|im_end|>", "ham") and set(r.choice_probs) == {"<|im_end|>", "ham"}


def test_logprobs_with_scored_choices_are_refused(lm, messages):
    """They came back as [] without a word."""
    with pytest.raises(ValueError, match="logprobs are not available with choice_mode='score'"):
        lm.batch_prompt(messages[:1], choices=["spam", "ham"], choice_mode="score", logprobs=True)


def test_logit_bias_with_scored_choices_is_refused(lm, messages):
    """{yes: -100} and {yes: +100} gave the same probabilities: the bias was ignored without a word."""
    with pytest.raises(ValueError, match="logit_bias does not apply to choice_mode='score'"):
        lm.batch_prompt(messages[:1], choices=["spam", "ham"], choice_mode="score", logit_bias={28: 5.0})
