"""EngineConfig: bad options are one error naming the option and its value."""
from __future__ import annotations

import pytest

from batchprompt.engine import EngineConfig


@pytest.mark.parametrize("options, error, words", [
    ({"no_such_option": 1}, TypeError, "unknown engine option no_such_option: the options are EngineConfig's fields: "
                                       "block_size, max_num_seqs"),
    ({"kv_cache_memory": "abc"}, TypeError, "kv_cache_memory must be a whole number of bytes, got 'abc'"),
    ({"kv_cache_memory": 0.99}, TypeError, "kv_cache_memory must be a whole number of bytes, got 0.99"),
    ({"max_num_seqs": "8"}, TypeError, "max_num_seqs must be a whole number, got '8'"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs must be >= 1, got 0"),
    ({"max_num_batched_tokens": -1}, ValueError, "max_num_batched_tokens must be >= 1, got -1"),
    ({"max_model_len": 0}, ValueError, "max_model_len must be >= 1"),
    ({"max_model_len": -5}, ValueError, "max_model_len must be >= 1"),
    ({"watermark": 5.0}, ValueError, "watermark must be in [0, 0.5)"),
    ({"watermark": -1.0}, ValueError, "watermark must be in [0, 0.5)"),
    ({"kv_memory_fraction": "0.3"}, TypeError, "kv_memory_fraction must be a number, got '0.3'"),
    ({"enable_prefix_caching": "no"}, TypeError, "enable_prefix_caching must be True or False, got 'no'"),
], ids=["unknown", "text bytes", "fraction as bytes", "text count", "zero", "negative", "zero context",
        "negative context", "watermark above", "watermark below", "text fraction", "text switch"])
def test_bad_engine_options_name_the_option_and_value(options, error, words):
    """They were Python's own errors ("'<=' not supported between 'str' and 'int'", "unexpected
    keyword argument"), a fraction taken as bytes, and a message naming two options for one."""
    with pytest.raises(error) as e:
        EngineConfig.from_options(options)
    assert words in str(e.value)


def test_the_step_budget_defaults_by_device_and_a_given_one_is_kept():
    """None means the device's default: 2,048 tokens a step on the CPU, 8,192 on CUDA (vLLM's
    offline default); a value given is kept on every device."""
    assert EngineConfig().max_num_batched_tokens is None
    assert EngineConfig().for_device("cpu").max_num_batched_tokens == 2048
    assert EngineConfig().for_device("cuda").max_num_batched_tokens == 8192
    assert EngineConfig(max_num_batched_tokens=512).for_device("cuda").max_num_batched_tokens == 512
