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


def test_a_model_path_that_does_not_exist_says_so(tmp_path):
    """It was "unknown model ...: give a .gguf file, ...", as if a .gguf path were not one."""
    for missing in (tmp_path / "nothing.gguf", "./models/none", "org/model.gguf"):
        with pytest.raises(ModelNotFoundError, match=r"no such file or directory: .*\(the model path\)"):
            resolve_model(str(missing))


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


@pytest.mark.parametrize("config, words", [
    ({"model_type": "gpt2", "n_head": 2}, "architecture 'gpt2' is not supported"),
    ({}, "config.json lacks vocab_size, hidden_size"),
    ({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
      "hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
])
def test_a_config_this_engine_would_compute_wrongly_or_cannot_read_is_refused(tmp_path, config, words):
    """mlp_bias and gelu were dropped silently (other answers than transformers'); a GPT-2 or an
    empty config was a KeyError."""
    import json

    from batchprompt.models import load_hf_weights

    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelNotFoundError, match=words) as e:
        load_hf_weights(resolve_model(tmp_path))
    assert str(tmp_path) in str(e.value)


def test_a_rope_scaling_not_computed_here_is_refused_naming_the_config(tmp_path):
    """`yarn` was refused as the rotary table was made, after every weight was read, without the
    file's name (and `batchprompt run` showed a traceback); `dynamic` is the plain RoPE within
    the model's context, as transformers computes it."""
    import json

    from batchprompt.models import load_hf_weights

    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "max_position_embeddings": 4096}
    (tmp_path / "config.json").write_text(json.dumps({**base, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}))
    with pytest.raises(ModelNotFoundError, match=r"config\.json: rope scaling 'yarn' is not supported") as e:
        load_hf_weights(resolve_model(tmp_path))
    assert "Is it complete" not in str(e.value)
    from batchprompt.models.config import ModelArgs

    # transformers reads no original_max_position_embeddings for "dynamic": the plain RoPE up to the context
    dynamic = ModelArgs.from_hf_config({**base, "rope_scaling": {"type": "dynamic", "factor": 2.0,
                                                                  "original_max_position_embeddings": 1024}})
    assert (dynamic.rope_scaling, dynamic.max_position) == (None, 4096)


@pytest.mark.parametrize("model_type, context", [("llama", 2048), ("mistral", 131072), ("qwen2", 32768),
                                                 ("qwen3", 32768)])
def test_a_config_without_a_context_takes_its_architectures_default(model_type, context):
    """It was 8,192 for every architecture: positions a Llama never saw (transformers' 2,048)."""
    from batchprompt.models.config import ModelArgs

    args = ModelArgs.from_hf_config({"model_type": model_type, "vocab_size": 10, "hidden_size": 8,
                                     "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                                     "sliding_window": None})
    assert args.max_position == context


def test_a_checkpoint_with_tensors_this_code_does_not_compute_is_refused(tmp_path):
    """A classifier's checkpoint (LlamaForSequenceClassification: `model_type` llama, a
    `score.weight`, no lm_head) ran with the embeddings as its output head."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from batchprompt.models import load_hf_weights

    from ..conftest import tiny_hf_config

    LlamaForSequenceClassification(tiny_hf_config(num_labels=3)).save_pretrained(tmp_path / "cls")
    with pytest.raises(ModelNotFoundError, match=r"tensors this code does not compute \(score\.weight\)"):
        load_hf_weights(resolve_model(tmp_path / "cls"))
    # An untied head that is not there
    from safetensors.torch import load_file, save_file

    LlamaForCausalLM(tiny_hf_config()).save_pretrained(tmp_path / "lm")
    weights = load_file(tmp_path / "lm" / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, tmp_path / "lm" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelNotFoundError, match="no lm_head.weight"):
        load_hf_weights(resolve_model(tmp_path / "lm"))


def test_a_directory_without_a_tokenizer_is_refused_before_its_weights(tmp_path, tiny_model_dir, monkeypatch):
    """It failed after the weights were read, with transformers' "Couldn't instantiate the
    backend tokenizer ... sentencepiece or tiktoken", and `batchprompt run` showed a traceback."""
    from batchprompt import LLMEngine
    from batchprompt.models import loader

    def weights_read(source):
        raise AssertionError("the weights were read")

    monkeypatch.setattr("batchprompt.engine.engine.load_hf_weights", weights_read)
    with pytest.raises(ModelNotFoundError, match=r"has no tokenizer files \(one of tokenizer\.json"):
        LLMEngine.from_pretrained(str(tiny_model_dir))
    assert loader.TOKENIZER_FILES[0] == "tokenizer.json"


def test_a_truncated_or_foreign_gguf_file_is_named(tmp_path):
    """They were numpy's "When changing to a larger dtype ..." and a bare "GGUF magic invalid"."""
    from batchprompt.models import load_hf_weights

    cut = tmp_path / "cut.gguf"
    with open(resolve_model(None).path, "rb") as f:
        cut.write_bytes(f.read(1 << 20))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a model" * 100)
    for path in (cut, junk):
        with pytest.raises(ModelNotFoundError, match="cannot be loaded as a GGUF file.*truncated") as e:
            load_hf_weights(resolve_model(path))
        assert str(path) in str(e.value)


def test_a_bad_dtype_or_device_is_refused_before_any_weights_are_read(monkeypatch):
    import torch

    from batchprompt import LLMEngine
    from batchprompt.engine import engine

    monkeypatch.setattr(engine, "load_hf_weights", lambda source: pytest.fail("the weights were read"))
    for kwargs, words in ((dict(dtype="float64"), "unknown dtype 'float64'"), (dict(dtype=torch.int8), "floating"),
                          (dict(device="gpu"), "unknown device 'gpu'"), (dict(device="meta"), "not supported")):
        with pytest.raises(ValueError, match=words):
            LLMEngine.from_pretrained(**kwargs)


def test_generation_config_end_of_sequence_ids_stop_generation_too(tiny_model_dir, tmp_path):
    """A Llama 3 Instruct names <|end_of_text|> in config.json and <|eot_id|> only in
    generation_config.json, as vLLM and transformers read them; only the first stopped an answer."""
    import json
    import shutil

    from batchprompt.models.loader import load_hf_weights

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    config = json.loads((model / "config.json").read_text())
    config["eos_token_id"] = 2
    (model / "config.json").write_text(json.dumps(config))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, True, "x", -1, 10**9]}))
    args, _ = load_hf_weights(resolve_model(str(model)))
    assert args.eos_token_ids == (2, 7)
    (model / "generation_config.json").write_text("{not json")  # unreadable: config.json's alone, as before
    assert load_hf_weights(resolve_model(str(model)))[0].eos_token_ids == (2,)
