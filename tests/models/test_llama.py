"""Our model against Hugging Face transformers on the same weights."""
from __future__ import annotations

import pytest
import torch

from batchprompt.kernels import CompiledOps
from batchprompt.models import build_model, load_hf_weights, resolve_model
from batchprompt.models.gguf_reader import unpermute_rotary
from batchprompt.models.ops import TorchOps

from ..conftest import full_logits, tiny_hf_config


@pytest.fixture(params=["torch-ops", "compiled-ops"])
def ops(request):
    """Each comparison runs with the layers' PyTorch steps and with the compiled CPU kernels."""
    if request.param == "torch-ops":
        return TorchOps()
    return CompiledOps(request.getfixturevalue("compiled_kernels"))


def _hf_logits(hf_model, ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("overrides", [
    {},
    {"tie_word_embeddings": True},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
    {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
])
def test_tiny_random_llama_matches_transformers(tmp_path, overrides, ops):
    from transformers import LlamaForCausalLM

    torch.manual_seed(1)
    hf = LlamaForCausalLM(tiny_hf_config(**overrides)).eval()
    hf.save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (150,)).tolist()
    expected, got = _hf_logits(hf, ids), full_logits(ours, ids, ops)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_tiny_qwen2_with_bias_matches_transformers(tmp_path, ops):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    hf = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    hf.save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    assert args.attention_bias
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (40,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids, ops), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_tiny_qwen3_and_mistral_match_transformers(tmp_path, family, ops):
    import transformers

    torch.manual_seed(3)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    if family == "qwen3":
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=32, **common))
    else:
        hf = transformers.MistralForCausalLM(transformers.MistralConfig(sliding_window=None, **common))
    hf = hf.eval()
    if family == "qwen3":
        with torch.no_grad():  # q/k norms start at one; make them count
            for layer in hf.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf.save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    assert args.qk_norm == (family == "qwen3")
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (50,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids, ops), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_attention_bias_includes_the_output_projections_as_in_transformers(tmp_path, family, ops):
    """Llama's and Qwen3's `attention_bias` puts a bias on o_proj too: it was left out (log-probs
    0.7 off transformers' on the same weights)."""
    import transformers

    torch.manual_seed(4)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, attention_bias=True)
    hf = (transformers.LlamaForCausalLM(tiny_hf_config(attention_bias=True)) if family == "llama" else
          transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **common))).eval()
    with torch.no_grad():  # random init leaves biases at zero; make them count
        for layer in hf.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj):
                proj.bias.normal_()
    hf.save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    assert args.attention_bias and args.o_bias
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (40,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids, ops), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family, config, window", [
    ("mistral", {"sliding_window": 16}, 16),
    ("mistral", {"sliding_window": None}, None),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, 16),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2}, None),  # no layer has it
    ("qwen2", {"use_sliding_window": False, "sliding_window": 16}, None),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0}, 16),
])
def test_a_sliding_window_cuts_the_context_to_where_the_answers_are_transformers(tmp_path, family, config, window):
    """A sliding window was ignored without a word, and answers past it differed from the first
    token on. The context is now cut to the window (as vLLM's --disable-sliding-window), within
    which attention over the window is attention over everything."""
    import transformers

    torch.manual_seed(6)
    common = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256)
    classes = {"mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
    cfg = getattr(transformers, classes[family] + "Config")(**common, **config)
    hf = getattr(transformers, classes[family] + "ForCausalLM")(cfg).eval()
    hf.save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    assert args.max_position == (window or 256)
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = torch.randint(0, 97, (args.max_position if window else 40,)).tolist()
    torch.testing.assert_close(full_logits(ours, ids), _hf_logits(hf, ids), atol=1e-4, rtol=1e-4)


def test_unpermute_inverts_llama_cpp_permutation():
    w = torch.randn(12, 5).numpy()
    n_head = 3
    permuted = w.reshape(n_head, 2, 2, 5).swapaxes(1, 2).reshape(w.shape)  # llama.cpp's convert
    assert (unpermute_rotary(permuted, n_head) == w).all()


@pytest.mark.slow
def test_embedded_model_matches_transformers_gguf_loader(ops):
    """The embedded GGUF: our reader and model against transformers' own GGUF reader (which
    dequantizes and un-permutes Q/K independently of ours) in a dense transformers Llama."""
    from transformers import AutoModelForCausalLM

    source = resolve_model(None)
    hf = AutoModelForCausalLM.from_pretrained(str(source.path.parent), gguf_file=source.path.name,
                                              dtype=torch.float32).eval()
    args, weights = load_hf_weights(source)
    ours = build_model(args, weights, torch.float32, torch.device("cpu"))
    ids = list(range(1, 60)) + [9690, 198, 2683, 359, 253, 26804, 5866]
    expected, got = _hf_logits(hf, ids), full_logits(ours, ids, ops)
    scale = expected.abs().max()
    assert (got - expected).abs().max() <= 1e-4 * scale
    assert (got.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("rows", [128, 57, 200])  # padded to 64 rows (57) and 208 (200)
@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 0.01), (torch.float32, 1e-5)])
def test_packed_weights_give_the_same_logits(tmp_path, dtype, tolerance, rows):
    """On the CPU, every step uses oneDNN-packed weights where the build can pack them; their
    logits equal the plain GEMMs' to the dtype's rounding."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(4)
    LlamaForCausalLM(tiny_hf_config(tie_word_embeddings=True)).save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    model = build_model(args, weights, dtype, torch.device("cpu"))
    ids = torch.randint(0, 97, (rows,)).tolist()
    plain = full_logits(model, ids)
    if not model.pack_weights():
        pytest.skip("this PyTorch build cannot pack weights for oneDNN")
    assert model.head_packed is not None and model.layers[0].gate_up.packed is not None
    packed = full_logits(model, ids)
    scale = plain.abs().max()
    assert (packed - plain).abs().max() <= tolerance * scale
    assert (packed.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.95


def test_packed_gemms_meet_few_row_counts(tmp_path, monkeypatch):
    """oneDNN compiles and keeps a kernel for every row count a packed GEMM meets: steps of up
    to 128 tokens must meet only 1-8 and multiples of 8, and larger ones 8 row counts per
    doubling, or a server's memory grows with each new step size it sees (see gemm_rows)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(4)
    LlamaForCausalLM(tiny_hf_config()).save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    model = build_model(args, weights, torch.float32, torch.device("cpu"))
    if not model.pack_weights():
        pytest.skip("this PyTorch build cannot pack weights for oneDNN")
    seen: set[int] = set()
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *rest):
        seen.add(x.shape[0])
        return real(x, *rest)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    for n in (3, 9, 20, 57, 100, 129, 200, 250):
        full_logits(model, torch.randint(0, 97, (n,)).tolist())
    allowed = set(range(1, 9)) | set(range(8, 129, 8)) | set(range(144, 257, 16)) | set(range(288, 513, 32))
    assert seen and seen <= allowed, sorted(seen - allowed)
    assert {144, 208, 256} <= seen  # the steps over 128 tokens went through the packed GEMMs


def _bf16_tiny_model(tmp_path):
    from transformers import LlamaForCausalLM

    torch.manual_seed(4)
    config = tiny_hf_config(tie_word_embeddings=True, max_position_embeddings=1024)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    args, weights = load_hf_weights(resolve_model(tmp_path))
    return build_model(args, weights, torch.bfloat16, torch.device("cpu"))


def test_plain_bfloat16_gemms_meet_few_row_counts(tmp_path, monkeypatch):
    """oneDNN keeps several MiB for every row count a bfloat16 GEMM meets on the CPU, also
    without the packed weights: steps of more than 128 tokens must meet 8 row counts per
    doubling (multiples of 16 up to 256, of 32 up to 512, ...), or a server's memory grows with
    each new step size (about 100 KiB a request, without end)."""
    import torch.nn.functional as F

    model = _bf16_tiny_model(tmp_path)
    seen: set[int] = set()
    real_mm, real_linear = torch.mm, F.linear

    def mm(x, w):
        seen.add(x.shape[0])
        return real_mm(x, w)

    def linear(x, w, bias=None):
        seen.add(x.shape[0])
        return real_linear(x, w, bias)

    monkeypatch.setattr(torch, "mm", mm)
    monkeypatch.setattr(F, "linear", linear)
    for n in (129, 200, 257, 333, 517):
        full_logits(model, torch.randint(0, 97, (n,)).tolist())
    allowed = set(range(144, 257, 16)) | set(range(288, 513, 32)) | set(range(576, 1025, 64))
    assert seen and seen <= allowed, sorted(seen - allowed)


def test_padded_bfloat16_gemms_give_the_same_logits(tmp_path, monkeypatch):
    """The zero rows that pad a step's GEMMs change nothing in its own rows' logits (to the
    dtype's rounding, as another GEMM kernel may sum in another order)."""
    from batchprompt.models import llama

    model = _bf16_tiny_model(tmp_path)
    ids = torch.randint(0, 97, (200,)).tolist()  # GEMMs of 208 rows
    padded = full_logits(model, ids)
    monkeypatch.setattr(llama, "_plain_padded", lambda x: x)
    monkeypatch.setattr(llama.LlamaModel, "step_rows", lambda self, n: n)
    plain = full_logits(model, ids)
    assert (padded - plain).abs().max() <= 0.01 * plain.abs().max()
    assert (padded.argmax(-1) == plain.argmax(-1)).float().mean() >= 0.95


def test_a_step_runs_its_layers_on_the_padded_rows_and_returns_its_tokens(tmp_path, monkeypatch):
    """The residual stream carries the GEMMs' padding rows from the embedding on (no GEMM pads
    its input with a copy), attention and the cache see only the step's tokens, and the hidden
    states come back for the tokens alone."""
    import torch.nn.functional as F

    from batchprompt.models import llama

    model = _bf16_tiny_model(tmp_path)
    ids = torch.randint(0, 97, (200,)).tolist()
    assert model.step_rows(200) == 208 and model.step_rows(208) == 208
    padded: list[int] = []  # the dimensions of each tensor padded
    real_pad = F.pad

    def pad(x, p, *rest, **kw):
        padded.append(x.dim())
        return real_pad(x, p, *rest, **kw)

    monkeypatch.setattr(llama.F, "pad", pad)
    logits = full_logits(model, ids)
    assert logits.shape[0] == 200
    # The token ids once, and the output head's input (its rows are the sampled ones only):
    # no layer's GEMM pads its input.
    assert sorted(padded) == [1, 2]
    monkeypatch.setattr(llama.LlamaModel, "step_rows", lambda self, n: n)
    assert torch.allclose(full_logits(model, ids), logits, atol=0.02 * logits.abs().max().item())
