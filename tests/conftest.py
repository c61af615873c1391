"""Shared fixtures: a tiny random Llama, the embedded model, a helper to get full logits."""
from __future__ import annotations

import gc
import os
import signal

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from batchprompt.data import SPAM_SYSTEM, read_sms  # noqa: E402,F401  (re-exported for tests)


def sigint_default() -> None:
    """`preexec_fn` of a child process that a test interrupts with SIGINT (Ctrl-C). Python turns
    SIGINT into KeyboardInterrupt only if SIGINT is not ignored when it starts; a non-interactive
    shell starts background commands (`make test &`, nohup) with SIGINT ignored, and children
    inherit that, so there such a child ran on as if Ctrl-C had never come."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def sms_rows(n: int | None = None) -> list[tuple[str, str]]:
    return read_sms(limit=n)


def tiny_hf_config(**overrides):
    from transformers import LlamaConfig

    cfg = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
               bos_token_id=1, eos_token_id=2)
    cfg.update(overrides)
    return LlamaConfig(**cfg)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A random Llama saved as a local HF directory (config.json + safetensors), no tokenizer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_hf_config()).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def embedded_engine():
    """The embedded SmolLM2-135M in bfloat16, as users get it by default."""
    from batchprompt import LLMEngine

    return LLMEngine.from_pretrained(max_num_batched_tokens=1024)


@pytest.fixture(scope="session")
def engine32():
    """The embedded model in float32, where batching changes no greedy token."""
    from batchprompt import LLMEngine

    return LLMEngine.from_pretrained(dtype="float32", max_num_batched_tokens=1024)


@pytest.fixture(autouse=True, scope="module")
def _hand_built_engines_released():
    """After each module, the engine threads of sessions on engines built by hand (engine32) end:
    such a thread keeps stepping its engine after its sessions are destroyed, and meanwhile
    refuses another thread's add_request() and step(), which the next module may call."""
    yield
    from batchprompt.api import service

    for key, running in list(service._services.items()):
        if key[0] == "engine":
            running.shutdown(timeout=30)
    gc.collect()
    service._trim_heap()  # the module's dropped engines: `make test` grew to 9.7 GB of RSS without it


@pytest.fixture(scope="session")
def compiled_kernels():
    """The compiled CPU kernels module. Skipped only where no C++ compiler exists; with one,
    the kernels must build."""
    import shutil

    from batchprompt.kernels import compiled_module

    module = compiled_module(torch.device("cpu"))
    if module is None and shutil.which("c++") is None:
        pytest.skip("no C++ compiler: the engine runs PyTorch's ops")
    assert module is not None, "a C++ compiler is present, so the kernels must build (see the log)"
    return module


def full_logits(model, token_ids: list[int], ops=None) -> torch.Tensor:
    """Logits of every position of one prompt, run through the paged-cache path (`ops`: the
    layers' elementwise steps; default PyTorch's)."""
    from batchprompt.engine.outputs import ScheduledChunk
    from batchprompt.engine.sampling_params import SamplingParams
    from batchprompt.runner.inputs import build_inputs
    from batchprompt.runner.kv_tensors import KVTensors

    block_size = 4
    blocks = -(-len(token_ids) // block_size)
    param = next(model.parameters())
    kv = KVTensors(model.args, block_size, param.dtype, param.device)
    kv.ensure(blocks, blocks)
    chunk = ScheduledChunk("r", list(token_ids), 0, list(range(blocks)), True, SamplingParams())
    inputs = build_inputs([chunk], block_size, param.device)
    with torch.inference_mode():
        hidden = model(inputs.input_ids, inputs.positions, kv.layers, inputs.attention, ops)
        return model.logits(hidden)
