"""The pool's tokenizer, fetched from the hub by the served model's name."""
from __future__ import annotations

import json

import pytest

from batchprompt.models import Tokenizer, resolve_model
from batchprompt.remote import tokenizer as pool_tokenizer


def test_a_hub_tokenizer_is_fetched_in_one_call_and_read_from_disk(tmp_path, monkeypatch):
    """AutoTokenizer fetched a hub repository's files one by one, each retried: offline, a served
    name that is no hub id took about 50 s to fail. One snapshot of the tokenizer's files is
    fetched (2 s offline), and the tokenizer and the context are read from it."""
    Tokenizer.load(resolve_model(None)).hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 1234}))
    calls = []

    def snapshot_download(repo_id, allow_patterns=None, **kwargs):
        calls.append((repo_id, allow_patterns))
        return str(tmp_path)

    monkeypatch.setattr("huggingface_hub.snapshot_download", snapshot_download)
    tok, context = pool_tokenizer.load_tokenizer("some-org/some-model")
    assert calls == [("some-org/some-model", pool_tokenizer.TOKENIZER_PATTERNS)]
    assert context == 1234 and tok.encode("hello") == Tokenizer.load(resolve_model(None)).encode("hello")


def test_a_hub_tokenizer_that_cannot_be_fetched_names_the_option(monkeypatch):
    def offline(repo_id, **kwargs):
        raise OSError("Name or service not known")

    monkeypatch.setattr("huggingface_hub.snapshot_download", offline)
    with pytest.raises(pool_tokenizer.PoolError, match="cannot load the tokenizer of 'other-model'.*--tokenizer"):
        pool_tokenizer.load_tokenizer("other-model")
