"""The Batch API's bookkeeping without a model: checking an input file, the records in SQLite,
and the data directory's lock."""
from __future__ import annotations

import json

import pytest

from batchprompt.jobs import openai_io
from batchprompt.jobs.rows import Row, RowError, parse_line
from batchprompt.server.batch_input import MAX_ERRORS, check_input
from batchprompt.server.batch_store import Store, UnknownCursor
from batchprompt.server.data_dir import DataDir, DataDirError
from tests.json_depth import DEEP

CHAT = "/v1/chat/completions"


def line(cid, url=CHAT, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": url,
                       "body": {"messages": [{"role": "user", "content": "Hi"}], **body}})


def check(*lines: str | bytes):
    raw = b"\n".join(x.encode() if isinstance(x, str) else x for x in lines)
    return check_input(raw, CHAT, "m", {"m", "alias"})


def test_good_file_with_a_bom_blank_lines_and_a_bad_body():
    got = check(b"\xef\xbb\xbf" + line("a").encode(), "", line("b", messages=[]), line("c", model="alias"), "  ")
    assert got.ok
    a, b, c = got.rows
    assert isinstance(a, Row) and a.line == 1 and isinstance(c, Row) and c.line == 4
    assert isinstance(b, RowError) and b.line == 3 and b.code == "invalid_messages"  # its own error, not the batch's


def test_every_bad_line_is_named_once_with_its_number():
    got = check(line("a"), "{", line("a"), line("b", url="/v1/completions"), line("c", url="/v1/embeddings"),
                json.dumps({"url": CHAT, "body": {}}), json.dumps({"custom_id": "d", "url": CHAT, "method": "GET",
                                                                   "body": {}}),
                json.dumps({"custom_id": "e", "url": CHAT}), line("f", messages=[], model="other"), "7",
                b'{"custom_id": "\xff"}', '{"body": ' + "[" * DEEP + "]" * DEEP + "}",
                line("g", seed=1).replace('"seed": 1', '"seed": ' + "9" * 4401))  # failed the batch (below)
    assert not got.ok
    assert [(e["line"], e["code"]) for e in got.errors] == [
        (2, "invalid_json"), (3, "duplicate_custom_id"), (4, "mismatched_url"), (5, "invalid_url"),
        (6, "missing_custom_id"), (7, "invalid_method"), (8, "missing_body"), (9, "model_not_found"),
        (10, "invalid_request"), (11, "invalid_utf8"), (12, "invalid_json"), (13, "invalid_json")]
    # 12: too deep, 13: a number of 4,401 digits (each failed the batch with one internal_error and no line)
    assert "nested too deeply" in got.errors[10]["message"]
    assert all(e["message"].startswith(f"line {e['line']}: ") for e in got.errors)
    assert "'other' does not exist here; this server runs 'm'" in got.errors[7]["message"]


def test_a_request_that_asks_to_stream_fails_the_batch_as_openai_validates_it():
    # It ran unstreamed without a word; OpenAI refuses such a file as it validates it.
    got = check(line("a"), line("b", stream=True), line("c", stream=False))
    [err] = got.errors
    assert (err["line"], err["code"], err["param"]) == (2, "invalid_request", "body.stream")
    assert err["message"].startswith("line 2: a batch request cannot stream (stream: true)")
    # Another value is the row's own 422, as the endpoint answers it (not the whole file's failure).
    got = check(line("a"), line("b", stream="false"), line("c", stream=1))
    assert got.ok and [getattr(r, "code", None) for r in got.rows] == [None, "invalid_type", "invalid_type"]


def test_an_empty_custom_id_is_named_as_empty():
    # It said "each line needs a string custom_id", of an id that is a string.
    got = check(json.dumps({"custom_id": "", "method": "POST", "url": CHAT, "body": {}}), line("a"))
    [err] = got.errors
    assert err["code"] == "missing_custom_id" and err["param"] == "custom_id"
    assert err["message"] == "line 1: each line needs a custom_id, a non-empty string (it is empty)"
    assert check(json.dumps({"url": CHAT, "body": {}})).errors[0]["message"] == (
        "line 1: each line needs a custom_id, a non-empty string")
    # A number was told it is missing.
    assert check(json.dumps({"custom_id": 5, "url": CHAT, "body": {}})).errors[0]["message"] == (
        "line 1: each line needs a custom_id, a non-empty string (got a number: write it in quotes)")


def test_nan_is_not_json_and_types_have_json_names():
    got = check(line("a", temperature=float("nan")), line("b", top_p=float("inf")), "null")
    assert [(e["line"], e["code"]) for e in got.errors] == [(1, "invalid_json"), (2, "invalid_json"),
                                                             (3, "invalid_request")]
    assert "NaN is not a JSON value" in got.errors[0]["message"]
    assert "Infinity is not a JSON value" in got.errors[1]["message"]
    assert got.errors[2]["message"] == "line 3: expected a JSON object, got null"  # was "got NoneType"


def test_errors_are_capped_with_a_count_of_the_rest():
    got = check(*["nope"] * (MAX_ERRORS + 5))
    assert len(got.errors) == MAX_ERRORS + 1
    assert got.errors[-1] == {"code": "too_many_errors", "line": None, "param": None,
                              "message": "and 5 more lines with errors"}


def test_an_empty_file_is_an_error():
    assert [e["code"] for e in check("", " ").errors] == ["empty_file"]


@pytest.mark.parametrize("raw, message", [
    # It was "line 1: not valid JSON (Extra data at column 118)", and nothing said why.
    ("\r".join([line("a"), line("b")]).encode(), "the file: its lines end with a carriage return alone"),
    # It was "line 1: not valid UTF-8 (byte 1 of the line)", and a "line 2: not valid JSON".
    ((line("a") + "\n").encode("utf-16"), "the file is UTF-16 (as Windows PowerShell's > writes), not UTF-8"),
])
def test_a_file_of_cr_line_ends_or_utf16_is_named_for_what_it_is_as_run_names_it(raw, message):
    got = check_input(raw, CHAT, "m", {"m"})
    assert [e["code"] for e in got.errors] == ["invalid_file"] and message in got.errors[0]["message"], got.errors
    assert check_input((line("a") + "\r\n" + line("b")).encode(), CHAT, "m", {"m"}).ok  # CRLF is fine


def test_an_id_that_is_not_valid_text_is_its_rows_error():
    got = check(line("a"), '{"custom_id": "\\ud800", "url": "/v1/chat/completions", "body": {"messages": '
                           '[{"role": "user", "content": "x"}]}}')
    assert got.ok and isinstance(got.rows[1], RowError) and got.rows[1].code == "invalid_custom_id"


def _file(i: int, purpose: str = "batch") -> dict:
    return {"id": f"file-{i}", "filename": "x", "purpose": purpose, "bytes": 1, "created_at": 0,
            "status": "processed", "batch_id": None, "kind": None}


def _batch(i: int, status: str = "validating") -> dict:
    return {"id": f"batch_{i}", "status": status, "input_file_id": "file-0"}


def test_store_pages_newest_first_and_keeps_records_across_connections(tmp_path):
    store = Store(tmp_path / "meta.sqlite")
    for i in range(5):
        store.add_file(_file(i, "batch" if i % 2 == 0 else "batch_output"))
        store.add_batch(_batch(i, "completed" if i < 3 else "in_progress"))
    files, more = store.list_files(None, 2)
    assert [f["id"] for f in files] == ["file-4", "file-3"] and more
    files, more = store.list_files("file-3", 10, "desc", "batch")
    assert [f["id"] for f in files] == ["file-2", "file-0"] and not more
    assert [f["id"] for f in store.list_files("file-0", 2, "asc")[0]] == ["file-1", "file-2"]
    with pytest.raises(UnknownCursor):
        store.list_batches("batch_9", 2)
    store.update_batch("batch_3", status="cancelling", cancelling_at=7)
    store.close()

    store = Store(tmp_path / "meta.sqlite")
    assert [b["id"] for b in store.unfinished_batches()] == ["batch_3", "batch_4"]
    assert store.get_batch("batch_3") == {**_batch(3, "cancelling"), "cancelling_at": 7}
    assert store.batches_reading("file-0") == ["batch_3", "batch_4"]
    done = store.finish_batch("batch_3", {"file-1": 42}, {"status": "cancelled"})
    assert done["status"] == "cancelled" and store.get_file("file-1")["bytes"] == 42
    assert store.delete_file("file-1") and not store.delete_file("file-1") and store.get_file("file-1") is None
    store.close()


def test_one_server_per_data_dir(tmp_path):
    first = DataDir(tmp_path / "d")
    with pytest.raises(DataDirError, match=r"is in use by another batchprompt server \(pid \d+"):
        DataDir(tmp_path / "d")
    first.close()
    DataDir(tmp_path / "d").close()  # free again
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataDirError, match="cannot create it"):
        DataDir(tmp_path / "file" / "d")
    with pytest.raises(DataDirError, match="this is a file, not a directory"):  # it said "cannot create it"
        DataDir(tmp_path / "file")


def test_a_server_removes_the_temp_files_a_killed_one_left(tmp_path):
    """A server killed between writing a file's temp copy and renaming it left the copy in
    files/ for good; the next server on the directory (holding its lock) removes it."""
    DataDir(tmp_path / "d").close()
    files = tmp_path / "d" / "files"
    (files / "file-1a2b.0badcafe.tmp").write_text("half a copy")
    (files / "file-1a2b").write_text("a file")
    (files / "file-9.notours.tmp").write_text("x")
    DataDir(tmp_path / "d").close()
    assert sorted(p.name for p in files.iterdir()) == ["file-1a2b", "file-9.notours.tmp"]


def test_a_callback_url_with_a_bad_port_is_told_so():
    """It was told to be "an http:// or https:// URL with a host", which it was."""
    from batchprompt.server.batches import check_callback_url
    from batchprompt.server.errors import ApiError

    for port in (99999, 0):  # 0: no receiver listens there
        with pytest.raises(ApiError, match="callback_url has a port that is not a number from 1 to 65535"):
            check_callback_url(f"http://127.0.0.1:{port}/x")
    with pytest.raises(ApiError, match="callback_url must be an http:// or https:// URL with a host"):
        check_callback_url("ftp://example.com/x")
    assert check_callback_url("http://127.0.0.1:8080/x") == "http://127.0.0.1:8080/x"


def test_a_line_without_url_says_it_needs_one():
    # It said "url None is not supported".
    [err] = check(json.dumps({"custom_id": "a", "method": "POST", "body": {}})).errors
    assert (err["code"], err["param"]) == ("missing_url", "url")
    assert err["message"] == f"line 1: the line needs a url, the batch's endpoint {CHAT}"


def test_a_data_dir_made_before_file_expiry_gets_its_columns(tmp_path):
    """The records of a --data-dir made by an earlier release open with the columns expiry needs."""
    import sqlite3

    db = sqlite3.connect(tmp_path / "meta.sqlite")
    db.execute("CREATE TABLE files (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, filename TEXT "
               "NOT NULL, purpose TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, status TEXT "
               "NOT NULL, batch_id TEXT, kind TEXT)")
    db.execute("CREATE TABLE batches (seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, status TEXT "
               "NOT NULL, input_file_id TEXT NOT NULL, data TEXT NOT NULL)")
    db.execute("INSERT INTO files (id, filename, purpose, bytes, created_at, status) VALUES ('file-old', 'a.jsonl', "
               "'batch', 3, 100, 'processed')")
    db.commit()
    db.close()
    store = Store(tmp_path / "meta.sqlite")
    assert store.get_file("file-old")["expires_at"] is None
    assert store.expired_files(10**10) == []
    store.close()


@pytest.mark.parametrize("extra", [
    {"guided_choice": "spam"}, {"guided_choice": [1, 2]}, {"guided_regex": 5}, {"guided_json": 5},
    {"n": 1.5}, {"max_tokens": "8"}, {"stop": 3}, {"temperature": "hot"},
    {"n": 0}, {"max_tokens": 0}, {"temperature": -1}, {"messages": None}, {"messages": []},
])
def test_run_and_the_batch_api_answer_a_body_alike(extra):
    """`batchprompt run` answered a field of the wrong type (guided_choice: "spam") with 400
    invalid_parameter where the server's Batch API, reading the same line, answered 422
    invalid_type: the README promises they accept and refuse the same things."""
    from batchprompt.jobs.run import JobOptions, row_params

    text = line("a", **extra)
    served, ran = check(text).rows[0], parse_line(1, text)

    def error(row):  # a value that only the sampling options refuse fails when the row is planned
        if isinstance(row, RowError):
            return openai_io.row_error_line(row)["response"]
        try:
            row_params(row, JobOptions("in", "out"))
        except ValueError as e:
            return str(e)
        return None

    assert error(served) == error(ran) and error(ran) is not None, (served, ran)


def test_a_damaged_metadata_database_says_to_start_the_server_again(tmp_path):
    """It ended with a job's words: "run the same command again to resume (finished rows ...)"."""
    from batchprompt.jobs.storage import StorageError

    (tmp_path / "meta.sqlite").write_bytes(b"not a database at all\n" * 100)
    with pytest.raises(StorageError) as e:
        Store(tmp_path / "meta.sqlite")
    assert "start the server again" in str(e.value) and "same command" not in str(e.value), e.value
