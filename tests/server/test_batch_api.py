"""OpenAI's Batch API on a real server, through the official `openai` client: files.create ->
batches.create -> poll -> files.content; lists with after/limit; a malformed file fails with
its line numbers; the output is readable while a batch runs; cancel and expiry keep every
finished request; deleting files."""
from __future__ import annotations

import json
import time

import openai
import pytest
from openai.types import FileObject

from .batch_util import (chat_line, completion_line, jsonl, lines_of, long_line, strict_batch, upload, wait_ended,
                         wait_for)
from .conftest import error_of, start_server, stop_server

pytestmark = pytest.mark.slow

MAX_FILE_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("server"), "--max-file-bytes", str(MAX_FILE_BYTES))
    yield srv
    assert stop_server(srv) == 0, srv.output()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def test_round_trip(server, client):
    lines = [chat_line(f"q{i}", f"Name a colour, {i}.") for i in range(4)]
    lines.insert(2, chat_line("empty", "x", messages=[]))  # a request whose body is wrong: its own error
    f = upload(client, lines, "colours.jsonl")
    assert (f.object, f.purpose, f.filename, f.bytes) == ("file", "batch", "colours.jsonl", len(jsonl(lines)))
    created = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                                    metadata={"job": "colours"})
    assert created.status == "validating" and created.input_file_id == f.id
    batch = wait_ended(client, created.id)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 5, "completed": 4, "failed": 1}
    assert batch.metadata == {"job": "colours"} and batch.model == "smollm2-135m" and batch.errors is None
    assert batch.created_at <= batch.in_progress_at <= batch.finalizing_at <= batch.completed_at < batch.expires_at
    assert batch.expires_at == batch.created_at + 24 * 3600
    out = lines_of(client, batch.output_file_id)
    assert [x["custom_id"] for x in out] == ["q0", "q1", "q2", "q3"]  # input order
    for x in out:
        body = x["response"]["body"]
        assert x["response"]["status_code"] == 200 and x["error"] is None
        assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] <= 3
    assert batch.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in out)
    [err] = lines_of(client, batch.error_file_id)
    assert err["custom_id"] == "empty" and err["error"]["line"] == 3 and err["error"]["code"] == "invalid_messages"
    # As OpenAI writes a refused request: the endpoint's status and error body (it was null).
    assert err["response"]["status_code"] == 400 and err["response"]["request_id"]
    assert err["response"]["body"]["error"] == {"message": err["error"]["message"].removeprefix("line 3: "),
                                                "type": "invalid_request_error", "param": "messages",
                                                "code": "invalid_messages"}  # the endpoint's words: no line number
    meta = client.files.retrieve(batch.output_file_id)
    assert meta.purpose == "batch_output" and meta.bytes == len(client.files.content(batch.output_file_id).content)
    # The log's counts are the batch's (finalizing said 0 completed, 0 failed).
    log = server.output()
    for state in ("finalizing", "completed"):
        assert f"batch {batch.id} {state} (4 completed, 1 failed of 5 requests)" in log, state


def test_completions_endpoint_with_choices_and_logprobs(client):
    lines = [completion_line("a", "The sky is", 3, n=2, seed=1, temperature=1.0, logprobs=0),
             completion_line("b", "One, two,", 3)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/completions",
                                  completion_window="1h")
    batch = wait_ended(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 2, batch
    a, b = lines_of(client, batch.output_file_id)
    assert [c["index"] for c in a["response"]["body"]["choices"]] == [0, 1]
    assert a["response"]["body"]["choices"][0]["logprobs"]["token_logprobs"]
    assert b["response"]["body"]["object"] == "text_completion"


def test_a_batch_whose_every_request_is_refused_ends(client):
    # It stayed in_progress, counts all 0, until the server started again: its refused rows were
    # not yet committed to the journal when the batch looked for what had run.
    lines = [chat_line(f"r{i}", "hi", temperature="hot") for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_ended(client, batch.id, timeout=60)
    assert batch.status == "completed", batch
    assert batch.request_counts.model_dump() == {"total": 3, "completed": 0, "failed": 3}
    assert [e["custom_id"] for e in lines_of(client, batch.error_file_id)] == ["r0", "r1", "r2"]
    assert batch.output_file_id is None  # as OpenAI: no output file when every request failed


def test_a_rows_unknown_fields_are_ignored_and_named_once_in_the_log(server, client):
    """As the endpoints name them (and vLLM): a Batch API row's went unsaid."""
    lines = [chat_line(f"u{i}", "hi", max_tokens=1, zz_row_field_b=1, zz_row_field_a=2) for i in range(3)]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_ended(client, batch.id, timeout=60)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    log = server.output()
    assert log.count("ignored: zz_row_field_a, zz_row_field_b (each is named once)") == 1, log[-3000:]


def test_an_empty_output_or_error_file_is_not_named(client):
    """As OpenAI: a batch with no failed request has error_file_id null (it named an empty file,
    which then stayed in the file list); the empty file is gone, not only unnamed."""
    before = {f.id for f in client.files.list(limit=10000)}
    batch = client.batches.create(input_file_id=upload(client, [chat_line("ok", "Hi", max_tokens=2)]).id,
                                  endpoint="/v1/chat/completions", completion_window="24h")
    batch = wait_ended(client, batch.id)
    assert batch.status == "completed" and batch.request_counts.model_dump() == {"total": 1, "completed": 1,
                                                                                 "failed": 0}, batch
    assert batch.error_file_id is None and [x["custom_id"] for x in lines_of(client, batch.output_file_id)] == ["ok"]
    made = {f.id for f in client.files.list(limit=10000)} - before
    assert made == {batch.input_file_id, batch.output_file_id}
    assert [b for b in client.batches.list(limit=100) if b.id == batch.id][0].error_file_id is None


def test_rows_are_answered_as_the_endpoint_answers_them(client):
    """A JSON schema cut by max_tokens: the partial text with finish_reason "length", in the row
    as from the endpoint (the row was an error). Token ids outside the vocabulary: the row's
    code is the endpoint's invalid_parameter (it was request_failed, then invalid_request where
    every other bad value is an invalid_parameter)."""
    schema = {"type": "json_schema", "json_schema": {"name": "v", "schema": {
        "type": "object", "properties": {"colour": {"type": "string"}}, "required": ["colour"]}}}
    cut = dict(max_tokens=3, temperature=0, response_format=schema)
    lines = [chat_line("cut", "Name a colour.", **cut), chat_line("vocab", "Hi", logit_bias={"99999999": 5})]
    batch = client.batches.create(input_file_id=upload(client, lines).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_ended(client, batch.id)
    assert batch.request_counts.model_dump() == {"total": 2, "completed": 1, "failed": 1}, batch
    [row] = lines_of(client, batch.output_file_id)
    direct = client.chat.completions.create(model="smollm2-135m",
                                            messages=[{"role": "user", "content": "Name a colour."}], **cut)
    choice = row["response"]["body"]["choices"][0]
    assert choice["finish_reason"] == direct.choices[0].finish_reason == "length"
    assert choice["message"]["content"] == direct.choices[0].message.content and choice["message"]["content"]
    [err] = lines_of(client, batch.error_file_id)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=3, logit_bias={"99999999": 5})
    assert err["custom_id"] == "vocab" and err["error"]["code"] == e.value.code == "invalid_parameter"
    assert err["response"]["body"]["error"]["param"] == e.value.param == "logit_bias"
    assert err["response"]["status_code"] == e.value.status_code == 400
    assert "outside the vocabulary" in err["error"]["message"]


HI = [{"role": "user", "content": "hi"}]
WRONG_BODIES = {  # a request body that is wrong in itself -> what the endpoint answers it with
    "type": {"messages": HI, "temperature": "hot"},  # 422 invalid_type (the row had 400 invalid_parameter)
    "no_messages": {"max_tokens": 2},  # 422 invalid_type: the endpoint's schema requires messages
    "empty": {"messages": []},
    "n": {"messages": HI, "n": 0},
    "top_logprobs": {"messages": HI, "top_logprobs": 3},
    "vocab": {"messages": HI, "max_tokens": 2, "logit_bias": {"99999999": 5}},
    "format": {"messages": HI, "response_format": {"type": "json_schema"}},
    "stop": {"messages": HI, "stop": [""]},
}


def test_a_rows_error_is_the_endpoints_answer_to_the_same_body(server, client):
    """Each refused row's `response` is exactly what the endpoint answers the same body with: its
    status, code, message and param (a type error was 400 invalid_parameter in a row and 422
    invalid_type at the endpoint; errors found while reading a row had param null)."""
    lines = [{"custom_id": k, "method": "POST", "url": "/v1/chat/completions", "body": b}
             for k, b in WRONG_BODIES.items()]
    batch = wait_ended(client, client.batches.create(input_file_id=upload(client, lines).id,
                                                     endpoint="/v1/chat/completions", completion_window="24h").id)
    assert batch.request_counts.model_dump() == {"total": len(lines), "completed": 0, "failed": len(lines)}, batch
    errors = {e["custom_id"]: e for e in lines_of(client, batch.error_file_id)}
    with server.client() as c:
        for key, body in WRONG_BODIES.items():
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code in (400, 422), (key, r.text)
            got = errors[key]["response"]
            assert (got["status_code"], got["body"]) == (r.status_code, error_of(r) and r.json()), key
            assert errors[key]["error"]["code"] == got["body"]["error"]["code"]
    params = {k: errors[k]["response"]["body"]["error"]["param"] for k in ("type", "no_messages", "empty", "n", "vocab")}
    assert params == {"type": "temperature", "no_messages": "messages", "empty": "messages", "n": "n",
                      "vocab": "logit_bias"}  # the engine's refusal: param was null
    with server.client() as c:  # token ids outside the vocabulary in the prompt: param was null
        r = c.post("/v1/completions", json={"prompt": [[99999999]], "max_tokens": 1})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt", r.text


def test_a_malformed_file_fails_validation_with_its_line_numbers(client):
    good = json.dumps(chat_line("a", "Hi"))
    raw = "\n".join([
        good,
        "not json",
        json.dumps(chat_line("a", "again")),  # the same custom_id
        json.dumps({**chat_line("c", "Hi"), "url": "/v1/completions"}),  # another endpoint
        json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),  # no custom_id
        json.dumps({**chat_line("d", "Hi"), "body": {**chat_line("d", "Hi")["body"], "model": "gpt-9"}}),
        "",
        json.dumps([1, 2]),
    ]).encode() + b"\n" + b'{"custom_id": "e\xff"}\n'
    batch = client.batches.create(input_file_id=upload(client, raw).id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    batch = wait_ended(client, batch.id)
    assert batch.status == "failed" and batch.failed_at is not None
    assert batch.output_file_id is None and batch.error_file_id is None and batch.in_progress_at is None
    got = [(e.line, e.code) for e in batch.errors.data]
    assert got == [(2, "invalid_json"), (3, "duplicate_custom_id"), (4, "mismatched_url"), (5, "missing_custom_id"),
                   (6, "model_not_found"), (8, "invalid_request"), (9, "invalid_utf8")]
    assert all(e.message.startswith(f"line {e.line}: ") for e in batch.errors.data)
    assert "also on line 1" in batch.errors.data[1].message


def test_an_empty_file_fails_validation(client):
    batch = client.batches.create(input_file_id=upload(client, b"\n\n").id, endpoint="/v1/completions",
                                  completion_window="24h")
    batch = wait_ended(client, batch.id)
    assert batch.status == "failed" and [e.code for e in batch.errors.data] == ["empty_file"]


def test_create_errors(client):
    f = upload(client, [chat_line("a", "Hi")])
    with pytest.raises(openai.NotFoundError, match="upload the requests with POST /v1/files"):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="endpoint '/v1/embeddings' is not supported"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window 'soon'"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="soon")
    for window in ("99999999999h", "0h"):  # a number out of range was "not a duration"
        with pytest.raises(openai.BadRequestError, match=f"completion_window '{window}' is out of range"):
            client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window=window)
    with pytest.raises(openai.BadRequestError, match="metadata takes at most 16 pairs.*; it has 17 pairs"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={str(i): "x" for i in range(17)})
    with pytest.raises(openai.BadRequestError, match="the value of 'k' has 513 characters"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"k": "v" * 513})
    with pytest.raises(openai.UnprocessableEntityError, match="completion_window"):
        client.post("/batches", body={"input_file_id": f.id, "endpoint": "/v1/chat/completions"}, cast_to=object)
    with pytest.raises(openai.NotFoundError, match="no batch 'batch_nope'"):
        client.batches.retrieve("batch_nope")
    # a misspelt field was accepted and ignored; OpenAI answers 400 naming it
    with pytest.raises(openai.BadRequestError, match="Unknown parameter: 'metdata'") as e:
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              extra_body={"metdata": {"k": "v"}})
    assert e.value.body["param"] == "metdata" and e.value.body["code"] == "unknown_parameter"
    assert all(b.input_file_id != f.id for b in client.batches.list().data)


def test_a_lone_surrogate_in_a_body_is_a_400_and_never_a_500(server, client):
    """JSON's "\\ud800" is valid JSON. In a batch's metadata it was stored, its create answered
    500, and every later list of batches answered 500 (restarts too); an error message that
    repeated it (an unknown field's name) was a 500 that then dropped the connection."""
    import httpx

    f = upload(client, [chat_line("a", "Hi")])
    create = ('{"input_file_id": "%s", "endpoint": "/v1/chat/completions", "completion_window": "24h", '
              '"metadata": %s}')
    with httpx.Client(base_url=server.url, timeout=60) as c:
        for metadata, where in (('{"k": "\\ud800"}', "the value of 'k'"), ('{"k\\udfff": "v"}', "the key 'k\\udfff'")):
            r = c.post("/v1/batches", content=create % (f.id, metadata), headers={"content-type": "application/json"})
            assert r.status_code == 400 and error_of(r)["code"] == "invalid_metadata", r.text
            assert f"{where} holds a lone surrogate" in error_of(r)["message"], r.text
        for path, body in (("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                                                     '"max_tokens": 2, "bogus\\ud800": 1}'),
                           ("/v1/batch/sync", '{"prompts": ["hi"], "max_tokens": 2, "bogus\\ud800": 1}'),
                           ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], '
                                                    '"max_tokens": "\\ud800"}'),
                           ("/v1/batches", '{"input_file_id": "\\ud800", "endpoint": "/v1/chat/completions", '
                                           '"completion_window": "24h"}')):
            r = c.post(path, content=body, headers={"content-type": "application/json"})
            assert 400 <= r.status_code < 500, (path, r.text)
            assert "\\ud800" in r.text, r.text  # JSON's escape of it, in the message
            assert c.get("/v1/models").status_code == 200  # the same connection still answers
        assert c.get("/v1/batches").status_code == 200
    assert all(b.input_file_id != f.id for b in client.batches.list().data)
    # A batch stored with one in a metadata key (as an earlier version took it) lists again.
    import sqlite3

    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    db = sqlite3.connect(server.log.parent / "data" / "meta.sqlite")
    with db:
        data = json.loads(db.execute("SELECT data FROM batches WHERE id = ?", (batch.id,)).fetchone()[0])
        db.execute("UPDATE batches SET data = ? WHERE id = ?",
                   (json.dumps(dict(data, metadata={"k\ud800": "v"})), batch.id))
    db.close()
    for path in ("/v1/batches", f"/v1/batches/{batch.id}"):
        r = httpx.get(server.url + path, timeout=60)
        assert r.status_code == 200 and '"k\\ud800":"v"' in r.text, r.text


def test_upload_errors(server, client):
    with pytest.raises(openai.BadRequestError, match="purpose 'fine-tune' is not supported"):
        client.files.create(file=("a.jsonl", b"{}\n"), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError, match="the file is empty"):
        client.files.create(file=("a.jsonl", b""), purpose="batch")
    with pytest.raises(openai.APIStatusError, match="--max-file-bytes") as e:
        client.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert e.value.status_code == 413
    with server.client() as c:
        r = c.post("/v1/files", files={"file": ("a.jsonl", b"{}\n")})  # no purpose: was "purpose None is not ..."
        assert r.status_code == 400 and error_of(r)["code"] == "missing_purpose", r.text
        assert error_of(r)["message"].startswith("purpose is required") and error_of(r)["param"] == "purpose"
        r = c.post("/v1/files", json={"purpose": "batch"})  # not multipart
        assert r.status_code == 400 and error_of(r)["code"] == "missing_file"
        r = c.post("/v1/files", files={"file": ("", b"{}\n")}, data={"purpose": "batch"})  # no filename
        assert r.status_code == 400 and "has no filename" in error_of(r)["message"], r.text
        r = c.post("/v1/files", content=b"--x\r\nbroken", headers={"Content-Type": "multipart/form-data; boundary=x"})
        assert 400 <= r.status_code < 500, r.text
        error_of(r)
        # Starlette's own refusals had code null and a bare message ("Too many files. ...")
        r = c.post("/v1/files", files=[("file", ("a.jsonl", b"{}\n")), ("file", ("b.jsonl", b"{}\n"))],
                   data={"purpose": "batch"})
        assert r.status_code == 400 and (error_of(r)["code"], error_of(r)["param"]) == ("invalid_multipart", "file")
        assert "Too many files" in error_of(r)["message"] and "Send one file" in error_of(r)["message"], r.text


def test_lists_page_with_after_and_limit(client):
    ids = []
    for i in range(3):
        f = upload(client, [completion_line("a", f"Count {i}:", 1)])
        ids.append(client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                         completion_window="24h").id)
    for batch_id in ids:
        wait_ended(client, batch_id)
    # The same line in three batches: OpenAI's ids are unique per request, so are ours (they
    # were a hash of custom_id and line only, the same in every batch).
    outs = [lines_of(client, client.batches.retrieve(b).output_file_id)[0] for b in ids]
    for key in (lambda o: o["id"], lambda o: o["response"]["request_id"], lambda o: o["response"]["body"]["id"]):
        assert len({key(o) for o in outs}) == 3, [key(o) for o in outs]
    newest = ids[::-1]
    first = client.batches.list(limit=2)
    assert [b.id for b in first.data] == newest[:2] and first.has_more
    second = client.batches.list(limit=2, after=newest[1])
    assert second.data[0].id == newest[2]
    seen = [b.id for b in client.batches.list(limit=1)]  # the client pages through them all
    assert seen[:3] == newest and len(seen) == len(set(seen))
    with pytest.raises(openai.BadRequestError, match="names no batch"):
        client.batches.list(after="batch_nope")
    with pytest.raises(openai.BadRequestError, match="limit must be a whole number from 1 to 100"):
        client.batches.list(limit=500)
    files = client.files.list(limit=2, purpose="batch")
    assert len(files.data) == 2 and files.has_more and all(isinstance(f, FileObject) for f in files.data)
    ascending = [f.id for f in client.files.list(order="asc", purpose="batch")]
    descending = [f.id for f in client.files.list(purpose="batch")]
    assert ascending == descending[::-1]
    assert [f.id for f in client.files.list(after=descending[0], limit=1, purpose="batch").data] == [descending[1]]


def test_output_readable_while_running_and_cancel_keeps_finished_rows(server, client):
    quick = [completion_line(f"q{i}", f"Number {i}:", 2) for i in range(6)]
    f = upload(client, quick + [long_line("long1"), long_line("long2")])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    # The output file exists from in_progress on, and holds the requests finished so far.
    batch = wait_for(client, batch.id, lambda b: b.output_file_id is not None and b.request_counts.completed >= 6,
                     "the quick requests finished")
    assert batch.status == "in_progress"
    partial = wait_for_lines(client, batch.output_file_id, 6)
    assert sorted(x["custom_id"] for x in partial) == [f"q{i}" for i in range(6)]
    assert client.files.retrieve(batch.output_file_id).bytes == len(client.files.content(batch.output_file_id).content)
    # Files a running batch reads or writes cannot be deleted.
    for file_id in (f.id, batch.output_file_id):
        with pytest.raises(openai.ConflictError, match="has not ended"):
            client.files.delete(file_id)
    cancelled = client.batches.cancel(batch.id)
    assert cancelled.status == "cancelling" and cancelled.cancelling_at  # as OpenAI answers (it waited up to 5 s)
    batch = wait_ended(client, batch.id)
    assert batch.status == "cancelled" and batch.cancelling_at and batch.cancelled_at and batch.completed_at is None
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 6, "failed": 2}
    assert [x["custom_id"] for x in lines_of(client, batch.output_file_id)] == [f"q{i}" for i in range(6)]
    errors = lines_of(client, batch.error_file_id)
    assert [(x["custom_id"], x["error"]["code"]) for x in errors] == [("long1", "batch_cancelled"),
                                                                       ("long2", "batch_cancelled")]
    assert all(x["response"] is None for x in errors)  # no HTTP answer: OpenAI's `error` alone
    server.wait_until(lambda s: s["engine"]["running"] == 0 and s["engine"]["waiting"] == 0,
                      "the engine dropped the cancelled requests")
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the same answer
    # The server's log says what became of the batch (it said nothing of batches).
    log = server.output()
    for line in (f"batch {batch.id} created: /v1/completions from file {f.id}, window 24h",
                 f"batch {batch.id} in_progress (0 completed, 0 failed of 8 requests)",
                 f"batch {batch.id} cancelling", f"batch {batch.id} cancelled (6 completed, 2 failed of 8 requests)"):
        assert line in log, line


def test_an_ended_batch_cannot_be_cancelled(client):
    f = upload(client, [completion_line("a", "Hi", 1)])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    assert wait_ended(client, batch.id).status == "completed"
    with pytest.raises(openai.ConflictError, match="has already ended \\(completed\\)"):
        client.batches.cancel(batch.id)


def wait_for_lines(client, file_id: str, n: int) -> list[dict]:
    """The file's lines once it has `n` (a running batch's output grows as its journal commits)."""
    deadline = time.monotonic() + 60
    while True:
        lines = lines_of(client, file_id)
        if len(lines) >= n:
            return lines
        assert time.monotonic() < deadline, f"the output has {len(lines)} lines, not {n}"
        time.sleep(0.2)


def test_a_short_window_is_counted_from_the_create_not_from_its_whole_second(client):
    """expires_at is in whole seconds (created_at + window), and the window ran out at it: a
    "2s" batch created 0.9 s into a second expired 1.1 s later."""
    f = upload(client, [long_line("long")])
    while time.time() % 1 < 0.85:  # created late in its second, where the two readings differ most
        time.sleep(0.01)
    t0 = time.monotonic()
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="2s")
    assert batch.expires_at == batch.created_at + 2  # OpenAI's shape stays
    time.sleep(max(0.0, t0 + 1.5 - time.monotonic()))
    assert client.batches.retrieve(batch.id).status in ("validating", "in_progress")  # 1.5 s in: not yet
    assert wait_ended(client, batch.id).status == "expired"


def test_expired_batch_keeps_what_finished(client):
    f = upload(client, [completion_line("q1", "One:"), completion_line("q2", "Two:"), long_line("long")])
    batch = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="3s")
    batch = wait_ended(client, batch.id)
    assert batch.status == "expired" and batch.expired_at is not None and batch.expired_at >= batch.expires_at - 1
    counts = batch.request_counts
    assert counts.total == 3 and counts.completed + counts.failed == 3
    out = lines_of(client, batch.output_file_id) if counts.completed else []  # no file if none finished
    errors = lines_of(client, batch.error_file_id)
    assert (batch.output_file_id is None) == (counts.completed == 0)
    assert sorted(x["custom_id"] for x in out + errors) == ["long", "q1", "q2"]  # each once
    assert {x["custom_id"]: x["error"]["code"] for x in errors}["long"] == "batch_expired"
    assert len(out) == counts.completed


def test_deleting_files(client):
    f = upload(client, [completion_line("a", "Hi", 1)])
    batch = wait_ended(client, client.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                                     completion_window="24h").id)
    for file_id in (f.id, batch.output_file_id):
        deleted = client.files.delete(file_id)
        assert (deleted.id, deleted.deleted) == (file_id, True)
        with pytest.raises(openai.NotFoundError):
            client.files.retrieve(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.content(file_id)
        with pytest.raises(openai.NotFoundError):
            client.files.delete(file_id)
    assert strict_batch(client, batch.id).status == "completed"  # the batch's record stays


def test_a_loop_that_deletes_the_files_it_lists_pages_on(client):
    """The openai client asks for the page after the last file it listed, which the loop had just
    deleted: "after='file-...' names no file" (400) after the first page."""
    ours = {upload(client, [completion_line("a", "Hi", 1)], f"cleanup-{i}.jsonl").id for i in range(5)}
    deleted = set()
    for f in client.files.list(limit=2, purpose="batch"):  # newest first: ours lead
        if f.id in ours:
            assert client.files.delete(f.id).deleted
            deleted.add(f.id)
        if deleted == ours:
            break
    assert deleted == ours
    assert not ours & {f.id for f in client.files.list(limit=10000)}
    with pytest.raises(openai.BadRequestError):  # a cursor that never named a file is still an error
        client.files.list(after="file-" + "0" * 24).data
