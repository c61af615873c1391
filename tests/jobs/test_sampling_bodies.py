"""`batchprompt run` bodies with vLLM/OpenAI sampling fields, and top_logprobs in OpenAI's shapes."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from batchprompt.api.result import Result, Usage
from batchprompt.jobs import openai_io
from batchprompt.jobs.rows import CHAT, COMPLETION, IGNORED_FIELDS, KNOWN_FIELDS, read_jsonl
from batchprompt.jobs.run import JobOptions, row_params, row_spec

OPTS = JobOptions("in", "out")
FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
          "top_logprobs", "include_stop_str_in_output", "best_of", "logprobs")


def row(url, **body):
    key = "messages" if url == CHAT else "prompt"
    body[key] = [{"role": "user", "content": "x"}] if url == CHAT else "x"
    return read_jsonl(json.dumps({"custom_id": "a", "url": url, "body": body}).encode())[0]


def test_body_sampling_fields_reach_the_engine():
    params, n = row_params(row(CHAT, presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.2,
                               min_p=0.05, min_tokens=3, logit_bias={"50256": -100}, logprobs=True,
                               top_logprobs=4, include_stop_str_in_output=True, best_of=3, temperature=0.7), OPTS)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty, params.min_p,
            params.min_tokens, params.logit_bias, params.logprobs, params.top_logprobs,
            params.include_stop_str_in_output, params.best_of, n) == \
        (0.5, -1.0, 1.2, 0.05, 3, {50256: -100.0}, True, 4, True, 3, 1)
    plain, _ = row_params(row(CHAT), OPTS)
    assert not plain.adjusts_logits and plain.num_samples == 1 and plain.top_logprobs == 0


def test_completion_logprobs_k_means_top_k():
    assert (lambda p: (p.logprobs, p.top_logprobs))(row_params(row(COMPLETION, logprobs=3), OPTS)[0]) == (True, 3)
    assert (lambda p: (p.logprobs, p.top_logprobs))(row_params(row(COMPLETION, logprobs=0), OPTS)[0]) == (True, 0)
    assert not row_params(row(COMPLETION), OPTS)[0].logprobs


@pytest.mark.parametrize("body, match", [
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"presence_penalty": 3}, "presence_penalty must be a number from -2 to 2"),
    ({"logit_bias": {"7": 500}}, "logit_bias values must be numbers from -100 to 100"),
    ({"best_of": 3, "n": 2}, "best_of other than n is supported only with n = 1 \\(got n=2, best_of=3\\)"),
    ({"best_of": 1, "n": 2}, "best_of must be >= n \\(2\\), got 1"),  # two choices, where OpenAI and vLLM give a 400
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs must be an integer from 0 to 20"),
    # A TypeError, taken for a bug of batchprompt's: the row was never journaled, and the job
    # could not end.
    ({"stop": 5}, "stop must be a string or a list of strings, got 5"),
    ({"stop": True}, "stop must be a string or a list of strings, got True"),
    ({"logit_bias": [1, 2]}, "logit_bias must map token ids to numbers"),
    # Taken without a word: {"a": 1} as the stop string "a", "yes" and "no" as true.
    ({"stop": {"a": 1}}, "stop must be a string or a list of strings"),
    ({"logprobs": "yes"}, "logprobs must be true or false on /v1/chat/completions"),
    ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output must be true or false, got 'no'"),
])
def test_bad_sampling_fields_fail_the_row(body, match):
    # A plain line's body: an OpenAI line's field of the wrong type is refused as it is read (below).
    plain = read_jsonl(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}).encode())[0]
    with pytest.raises(ValueError, match=match):
        row_params(plain, OPTS)


@pytest.mark.parametrize("body, param", [
    ({"stop": 5}, "stop"), ({"stop": True}, "stop"), ({"stop": {"a": 1}}, "stop"),
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logprobs": "yes"}, "logprobs"), ({"include_stop_str_in_output": "no"}, "include_stop_str_in_output"),
])
def test_a_field_of_the_wrong_type_fails_an_openai_line_as_the_endpoint_does(body, param):
    err = row(CHAT, **body)
    assert (err.code, err.param) == ("invalid_type", param), err
    assert openai_io.row_error_line(err)["response"]["status_code"] == 422


@pytest.mark.parametrize("prompt, param, got", [
    ([1.0, 2.5, 3], "prompt.1", "2.5"), ([[1, 2], [504, 0.5]], "prompt.1.1", "0.5"),
])
def test_a_token_id_with_a_fraction_is_named_alone(prompt, param, got):
    """`"prompt": [1.0, 2.5, 3]` was answered with seven errors of the union's other members
    ("prompt: Input should be a valid string, ..."); the id that is not whole is named alone."""
    def line(prompt):
        return read_jsonl(json.dumps({"custom_id": "a", "url": COMPLETION, "body": {"prompt": prompt}}).encode())[0]

    err = line(prompt)
    assert (err.code, err.param) == ("invalid_type", param), err
    assert err.message.endswith(f"invalid request: {param}: token ids are whole numbers, got {got}"), err.message
    # A list that is not all numbers is not a list of ids: each member's error is given, as before
    assert "valid string" in line([1, "a"]).message


def test_stop_as_a_completion_rows_list_or_string():
    assert row_params(row(COMPLETION, stop="\n"), OPTS)[0].stop == ("\n",)
    assert row_params(row(COMPLETION, stop=["a", "b"]), OPTS)[0].stop == ("a", "b")
    assert row_params(row(COMPLETION, stop=None), OPTS)[0].stop == ()
    with pytest.raises(ValueError, match=r"^stop is an empty string: leave stop out"):  # it showed ['']
        row_params(row(COMPLETION, stop=""), OPTS)
    with pytest.raises(ValueError, match=r"stop strings must be non-empty strings, got \['a', ''\]"):
        row_params(row(COMPLETION, stop=["a", ""]), OPTS)


@pytest.mark.parametrize("value", [21, -1, 2.5, "3"])
def test_a_completions_bad_logprobs_is_named_as_sent(value):
    # It was refused as "top_logprobs must be ...", a field the client never sent.
    read = row(COMPLETION, logprobs=value)
    if isinstance(value, int):  # a value out of range: the sampling options' error
        with pytest.raises(ValueError, match=r"^logprobs must be an integer from 0 to 20"):
            row_params(read, OPTS)
    else:  # not a whole number, nor true/false: the endpoint's 422 as the line is read
        assert (read.code, read.param) == ("invalid_type", "logprobs"), read


def test_the_fields_are_not_counted_as_unknown():
    assert all(f in KNOWN_FIELDS or f in IGNORED_FIELDS for f in FIELDS)


@dataclass(frozen=True)
class TopResult(Result):
    # What api/result.py's Result carries once it passes RequestOutput.top_logprobs on.
    top_logprobs: list | None = None


TEXT = {5: "a", 6: "b", 7: "c"}


def result() -> Result:
    return TopResult(0, "ab", "stop", Usage(3, 2), logprobs=[-0.1, -0.2], token_ids=[5, 6],
                     top_logprobs=[[(5, -0.1), (7, -2.5)], [(6, -0.2), (5, -1.5)]])


def test_chat_top_logprobs_in_openais_shape():
    body = openai_io.response_body(row(CHAT, logprobs=True, top_logprobs=2), [result()], "m", 0, TEXT.get)
    content = body["choices"][0]["logprobs"]["content"]
    assert content[0] == {"token": "a", "logprob": -0.1, "bytes": [97], "top_logprobs": [
        {"token": "a", "logprob": -0.1, "bytes": [97]}, {"token": "c", "logprob": -2.5, "bytes": [99]}]}
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["b", "a"]


def test_completion_top_logprobs_in_openais_shape():
    body = openai_io.response_body(row(COMPLETION, logprobs=2), [result()], "m", 0, TEXT.get)
    lp = body["choices"][0]["logprobs"]
    assert lp["top_logprobs"] == [{"a": -0.1, "c": -2.5}, {"b": -0.2, "a": -1.5}]
    assert (lp["tokens"], lp["token_logprobs"], lp["text_offset"]) == (["a", "b"], [-0.1, -0.2], [0, 1])


@pytest.mark.parametrize("so, match", [
    ({"foo": 1}, r"^structured_outputs has no field 'foo': give one of choice, regex"),
    ({"choice": ["a", "b"], "chioce": ["c"]}, r"no field 'chioce'"),
    ({"regex": "a+", "whitespace_pattern": " "}, r"^structured_outputs.whitespace_pattern is not supported"),
    ({"regex": "a+", "disable_fallback": "yes"}, r"^structured_outputs.disable_fallback must be true or false"),
    # No constraint at all: it ran unconstrained and answered 200, where vLLM refuses it.
    ({}, r"^structured_outputs names no constraint: give one of choice, regex, json, grammar, json_object"),
    ({"json_object": False, "disable_fallback": True}, r"^structured_outputs names no constraint"),
])
def test_a_structured_outputs_key_that_cannot_be_honoured_fails_the_row(so, match):
    # An unknown key was ignored: the row ran with no constraint and nothing said so.
    with pytest.raises(ValueError, match=match):
        row_spec(row(CHAT, structured_outputs=so), OPTS)


def test_structured_outputs_flags_that_match_what_batchprompt_does_are_accepted():
    spec = row_spec(row(CHAT, structured_outputs={"regex": "a+", "disable_any_whitespace": True,
                                                  "disable_additional_properties": True}), OPTS)
    assert spec.grammar.kind == "regex"


@pytest.mark.parametrize("body, match", [
    # The guided_* field silently won over structured_outputs of the same kind.
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, r"^guided_regex and structured_outputs.regex both"),
    ({"structured_outputs": {"choice": ["x", "w"]}, "guided_choice": ["yes", "no"]}, r"^guided_choice and "),
    ({"structured_outputs": {"json": {"type": "integer"}}, "guided_json": {"type": "boolean"}}, r"^guided_json and "),
    # It blamed the JSON schema, a field the client never sent.
    ({"guided_json": {"type": "integer"}, "response_format": {"type": "json_object"}},
     r"^response_format and guided_json both ask"),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_object"}},
     r"^response_format and structured_outputs both ask"),
])
def test_two_constraints_from_two_fields_fail_the_row_naming_both(body, match):
    with pytest.raises(ValueError, match=match):
        row_spec(row(CHAT, **body), OPTS)


def test_completion_top_logprobs_always_hold_the_chosen_token():
    """/v1/completions as OpenAI and vLLM answer it: at each position the `logprobs` most likely
    tokens and the chosen one (up to logprobs + 1 entries). A sampled token outside the top-k
    was missing, and `logprobs: 0` gave null where vLLM gives the chosen token alone."""
    sampled = TopResult(0, "cb", "stop", Usage(3, 2), logprobs=[-2.5, -0.2], token_ids=[7, 6],
                        top_logprobs=[[(5, -0.1)], [(6, -0.2)]])
    body = openai_io.response_body(row(COMPLETION, logprobs=1), [sampled], "m", 0, TEXT.get)
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"a": -0.1, "c": -2.5}, {"b": -0.2}]
    alone = TopResult(0, "cb", "stop", Usage(3, 2), logprobs=[-2.5, -0.2], token_ids=[7, 6], top_logprobs=None)
    body = openai_io.response_body(row(COMPLETION, logprobs=0), [alone], "m", 0, TEXT.get)
    assert body["choices"][0]["logprobs"]["top_logprobs"] == [{"c": -2.5}, {"b": -0.2}]


@pytest.mark.parametrize("url", [CHAT, COMPLETION])
def test_a_null_max_completion_tokens_leaves_max_tokens_in_force(url):
    """The `openai` client sends "max_completion_tokens": null beside max_tokens where a caller
    passes None; the null threw max_tokens away, and the answer ran to the context's end."""
    assert row_params(row(url, max_tokens=2, max_completion_tokens=None), OPTS)[0].max_tokens == 2
    assert row_params(row(url, max_tokens=2, max_completion_tokens=5), OPTS)[0].max_tokens == 5


@pytest.mark.parametrize("body", [{"choice_mode": "score"}, {"choice_mode": "decode", "guided_regex": "[0-9]+"}])
def test_a_rows_choice_mode_without_choices_fails_the_row(body):
    """It was ignored: free text (or the regex's answer) came back, where the API refuses it."""
    with pytest.raises(ValueError, match=r"^choice_mode '\w+' picks among choices: give guided_choice"):
        row_spec(row(CHAT, **body), OPTS)


def test_a_rows_choice_mode_takes_the_commands_choices():
    opts = JobOptions("in", "out", structured={"choices": ["spam", "ham"]})
    spec = row_spec(row(CHAT, choice_mode="score"), opts)
    assert spec.labels == ("spam", "ham") and spec.choice_mode == "score"
    assert row_spec(row(CHAT, choice_mode="decode", guided_choice=["a", "b"]), OPTS).labels == ("a", "b")


def test_best_of_at_temperature_0_names_best_of_as_its_param():
    """The message began "best_of=3", so the 400's param was null."""
    from batchprompt.jobs.refusals import param_named

    body = {"best_of": 3, "temperature": 0}
    with pytest.raises(ValueError) as e:
        row_params(row(COMPLETION, **body), OPTS)
    assert param_named(str(e.value), body) == "best_of"


def test_special_tokens_in_logprobs_are_named_by_their_own_text_as_vllm_names_them():
    """<|im_end|> and <|im_start|> both read "" (decode drops special tokens): in a completion's
    top_logprobs the second hid the first, so `logprobs: 5` gave 4 entries and the chosen
    token's value was lost; a chat token had `"token": ""` and empty bytes. vLLM names them
    by their own text."""
    from batchprompt.remote.tokenizer import load_tokenizer

    tok = load_tokenizer("smollm2-135m")[0]
    end, start = tok.hf.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    r = TopResult(0, "", "stop", Usage(3, 1), logprobs=[-0.25], token_ids=[end],
                  top_logprobs=[[(end, -0.25), (start, -1.75), (198, -3.75)]])
    pieces = openai_io.TokenPieces.of(tok)
    lp = openai_io.response_body(row(COMPLETION, logprobs=3), [r], "m", 0, pieces)["choices"][0]["logprobs"]
    assert lp["tokens"] == ["<|im_end|>"]
    assert lp["top_logprobs"] == [{"<|im_end|>": -0.25, "<|im_start|>": -1.75, "\n": -3.75}]
    content = openai_io.response_body(row(CHAT, logprobs=True, top_logprobs=3), [r], "m", 0,
                                      pieces)["choices"][0]["logprobs"]["content"]
    assert (content[0]["token"], bytes(content[0]["bytes"])) == ("<|im_end|>", b"<|im_end|>")
    assert [t["token"] for t in content[0]["top_logprobs"]] == ["<|im_end|>", "<|im_start|>", "\n"]


def test_a_whole_number_float_is_its_integer_as_the_endpoint_reads_it():
    """"max_tokens": 5.0 failed a `run` line and a Batch API row (422), where vLLM takes it."""
    from batchprompt.server.batch_input import check_input

    r = row(CHAT, max_tokens=5.0, n=1.0, temperature=1.0)
    assert (r.body["max_tokens"], type(r.body["max_tokens"]), r.body["temperature"]) == (5, int, 1.0)
    assert row_params(r, OPTS)[0].max_tokens == 5
    bad = read_jsonl(json.dumps({"custom_id": "a", "url": CHAT, "body": {"messages": [], "max_tokens": 5.5}}).encode())
    assert bad[0].code == "invalid_type" and "max_tokens" in bad[0].message
    line = {"custom_id": "a", "method": "POST", "url": CHAT,
            "body": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 5.0}}
    got = check_input(json.dumps(line).encode(), CHAT, "m", {"m"})
    assert got.rows[0].body["max_tokens"] == 5
