"""The variable-length attention kernel for CUDA, and when it is used."""
from __future__ import annotations

import pytest
import torch

from batchprompt.models.flash_attention import flash_varlen, varlen_op, varlen_reference


def _case(device, dtype, q_lens, k_lens, heads=9, kv_heads=3, dim=64):
    g = torch.Generator().manual_seed(1)
    rand = lambda n, h: torch.randn(n, h, dim, generator=g).to(device, dtype)  # noqa: E731
    cum = lambda xs: torch.tensor([0, *torch.tensor(xs).cumsum(0).tolist()], dtype=torch.int32,  # noqa: E731
                                  device=device)
    return (rand(sum(q_lens), heads), rand(sum(k_lens), kv_heads), rand(sum(k_lens), kv_heads),
            cum(q_lens), cum(k_lens), max(q_lens), max(k_lens), dim ** -0.5)


def test_the_reference_is_causal_from_the_end_of_each_requests_keys():
    """A request's queries are its last tokens: the reference equals full causal attention over
    the whole sequence, read at those positions."""
    q, k, v, cu_q, cu_k, mq, mk, scale = _case("cpu", torch.float32, [3, 1, 5], [8, 4, 5])
    got = varlen_reference(q, k, v, cu_q, cu_k, mq, mk, scale)
    for i, (nq, nk) in enumerate([(3, 8), (1, 4), (5, 5)]):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        full_q = torch.zeros(nk, 9, 64)
        full_q[nk - nq:] = q[qs]
        want = torch.nn.functional.scaled_dot_product_attention(
            full_q.transpose(0, 1), k[ks].repeat_interleave(3, 1).transpose(0, 1),
            v[ks].repeat_interleave(3, 1).transpose(0, 1), is_causal=True, scale=scale).transpose(0, 1)
        torch.testing.assert_close(got[qs], want[nk - nq:])


def test_not_used_off_cuda_in_float32_or_when_turned_off(monkeypatch):
    assert varlen_op(torch.device("cpu"), torch.bfloat16, 9, 3, 64) is None
    if torch.cuda.is_available():
        assert varlen_op(torch.device("cuda"), torch.float32, 9, 3, 64) is None
        monkeypatch.setenv("BATCHPROMPT_ATTENTION", "sdpa")
        assert varlen_op(torch.device("cuda"), torch.bfloat16, 9, 3, 64) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_kernel_gives_the_references_results_on_this_gpu():
    if torch.cuda.get_device_capability()[0] < 8:
        pytest.skip("FlashAttention needs compute capability 8.0 or newer")
    assert varlen_op(torch.device("cuda"), torch.bfloat16, 9, 3, 64) is flash_varlen
    args = _case("cuda", torch.bfloat16, [1] * 40 + [37, 128, 5], [300] * 20 + [17] * 20 + [400, 128, 700])
    got, want = flash_varlen(*args), varlen_reference(*args)
    assert (got.float() - want.float()).abs().max().item() < 0.02
