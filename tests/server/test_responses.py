"""How a failed result is answered: the request's fault (400) or the server's (500)."""
from __future__ import annotations

import pytest

from batchprompt.api.result import Result
from batchprompt.server.responses import result_error


@pytest.mark.parametrize("message", [
    "the model failed on this step: RuntimeError: probability tensor contains either `inf`, `nan` or element < 0",
    "the engine failed: RuntimeError: boom",
    "the engine could not queue this prompt: RuntimeError: cannot build the grammar's tokenizer",
])
def test_an_engine_or_model_failure_is_a_server_error(message):
    # A model step that raised was answered 400 invalid_request: the client was told to fix a
    # request that was fine, and the fuzz's "no 5xx" could not see the server's failure.
    e = result_error(Result(0, error=message))
    assert (e.status, e.code, e.message) == (500, "engine_error", message)


def test_a_request_the_model_cannot_hold_is_the_clients_error():
    message = ("the model ran out of memory running this request alone, one token at a time (OutOfMemoryError: "
               "x): shorten the prompt, or leave the model more memory")
    e = result_error(Result(0, error=message))
    assert (e.status, e.code) == (400, "context_length_exceeded")
