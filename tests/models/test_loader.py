"""Finding a model: clear errors for what a user can get wrong."""
from __future__ import annotations

import pytest

from batchprompt.models import ModelNotFoundError, resolve_model


def test_embedded_model_resolves():
    src = resolve_model(None)
    assert src.kind == "gguf" and src.path.is_file()
    assert resolve_model("smollm2-135m").path == src.path


def test_unknown_model_names_the_alternatives():
    with pytest.raises(ModelNotFoundError, match="local Hugging Face model directory"):
        resolve_model("no-such-model")


def test_hub_id_offline_says_so_and_names_local_options(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError, match="Offline.*local path"):
        resolve_model("SomeOrg/some-model-that-is-not-cached")


def test_directory_without_weights_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="neither config.json"):
        resolve_model(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    src = resolve_model(tmp_path)
    from batchprompt.models import load_hf_weights
    (tmp_path / "config.json").write_text('{"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, '
                                          '"num_hidden_layers": 1, "num_attention_heads": 2}')
    with pytest.raises(ModelNotFoundError, match="no \\*.safetensors"):
        load_hf_weights(src)
