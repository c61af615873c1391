"""Helpers of the Batch API tests: input files, bounded polling, strict parsing of the objects
with the official client's own types (pydantic validation, not its lenient construction)."""
from __future__ import annotations

import json
import time

import openai
from openai.types import Batch, FileObject

ENDED = ("completed", "failed", "expired", "cancelled")
WAIT_S = 300  # bounded waits: a broken build fails instead of hanging


def chat_line(custom_id: str, content: str, max_tokens: int = 3, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "smollm2-135m", "messages": [{"role": "user", "content": content}],
                     "max_tokens": max_tokens, **body}}


def completion_line(custom_id: str, prompt: str, max_tokens: int = 2, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **body}}


def long_line(custom_id: str, tokens: int = 3000) -> dict:
    """A request that runs `tokens` steps (the grammar allows no end before), or until cancelled."""
    return completion_line(custom_id, "Letters:", tokens, structured_outputs={"regex": f"[ab]{{{tokens}}}"})


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


def upload(client: openai.OpenAI, lines: list[dict] | bytes, name: str = "requests.jsonl") -> FileObject:
    data = lines if isinstance(lines, bytes) else jsonl(lines)
    return client.files.create(file=(name, data), purpose="batch")


def strict_batch(client: openai.OpenAI, batch_id: str) -> Batch:
    """The batch, validated against the client's Batch type field by field (no unknown keys)."""
    raw = client.batches.with_raw_response.retrieve(batch_id).http_response.json()
    assert set(raw) <= set(Batch.model_fields), set(raw) - set(Batch.model_fields)
    return Batch.model_validate(raw)


def wait_for(client: openai.OpenAI, batch_id: str, done, what: str, timeout: float = WAIT_S) -> Batch:
    """Poll the batch until `done(batch)`; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        batch = strict_batch(client, batch_id)
        if done(batch):
            return batch
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s; last {batch}"
        time.sleep(0.2)


def wait_ended(client: openai.OpenAI, batch_id: str, timeout: float = WAIT_S) -> Batch:
    return wait_for(client, batch_id, lambda b: b.status in ENDED, "the batch ended", timeout)


def lines_of(client: openai.OpenAI, file_id: str) -> list[dict]:
    assert file_id is not None, "the batch names no such file"
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
