"""The compiled layer steps against the PyTorch ones (models/ops.py) on the same inputs."""
from __future__ import annotations

import pytest
import torch

from batchprompt.kernels import CompiledOps
from batchprompt.models.ops import TorchOps

REF = TorchOps()
# One rounding step of the dtype apart at most: the two sum in different orders.
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=1e-2, rtol=8e-3)}
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops(compiled_kernels):
    return CompiledOps(compiled_kernels)


def rand(*shape, dtype, seed=0, scale=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 576), (37, 64), (300, 100)])  # 100: a tail past 16 lanes
def test_rms_norm_and_add_rms_norm(ops, dtype, rows, width):
    x, d, w = rand(rows, width, dtype=dtype), rand(rows, width, dtype=dtype, seed=1), rand(width, dtype=dtype, seed=2)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), **TOL[dtype])
    r1, r2 = x.clone(), x.clone()
    got, want = ops.add_rms_norm(r1, d, w, 1e-6), REF.add_rms_norm(r2, d, w, 1e-6)
    assert torch.equal(r1, r2)  # the residual is updated in place, rounded as PyTorch rounds
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (64, 40), (7, 3)])
def test_silu_mul(ops, dtype, rows, inter):
    gate_up = rand(rows, 2 * inter, dtype=dtype, scale=4.0)  # wide range: silu's tails
    gate_up[0, 0], gate_up[0, 1] = -200.0, 200.0  # far tails: exp over/underflow
    torch.testing.assert_close(ops.silu_mul(gate_up), REF.silu_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)  # greedy steps take bfloat16 logits as they come
def test_argmax_matches_torch_with_ties_and_nan(ops, dtype):
    x = rand(6, 49152, dtype=dtype)
    x[1, 10] = x[1, 40000] = 99.0  # a tie: the first index wins
    x[2, 7] = float("nan")
    x[3, 49151] = 50.0  # the last element
    x[4] = 0.0  # all equal
    x[5, :3] = 5.0
    assert torch.equal(ops.argmax(x), x.argmax(-1))
    assert torch.equal(ops.argmax(x[:, :17]), x[:, :17].argmax(-1))  # short rows, strided


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (2, 1, 6)])
def test_rotary_to_cache(ops, dtype, heads, kv_heads, dim):
    from batchprompt.models.rotary import rotary_table

    tokens, slots_total = 11, 40
    cos, sin = rotary_table(dim, 64, 10000.0, None)
    pos = torch.randint(0, 64, (tokens,), generator=torch.Generator().manual_seed(3))
    cos, sin = cos[pos].to(dtype), sin[pos].to(dtype)
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(4))[:tokens]
    qkv = rand(tokens, heads + 2 * kv_heads, dim, dtype=dtype)
    caches = [torch.zeros(slots_total, kv_heads, dim, dtype=dtype) for _ in range(4)]
    q_ref = REF.rotary_to_cache(qkv.clone(), heads, kv_heads, cos, sin, caches[0], caches[1], slots)
    q = ops.rotary_to_cache(qkv.clone(), heads, kv_heads, cos, sin, caches[2], caches[3], slots)
    if dtype == torch.bfloat16:  # every product and sum rounded to bfloat16 as PyTorch does: equal
        assert torch.equal(q, q_ref)
        assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    else:  # float32: the compiler may fuse a multiply and an add (one rounding fewer)
        torch.testing.assert_close(q, q_ref, **TOL[dtype])
        torch.testing.assert_close(caches[2], caches[0], **TOL[dtype])
        torch.testing.assert_close(caches[3], caches[1], **TOL[dtype])
    assert caches[2][slots].abs().sum() > 0 and caches[3].abs().sum() > 0


def test_bad_inputs_are_errors(ops):
    with pytest.raises(RuntimeError, match="weight"):
        ops.rms_norm(torch.randn(2, 8), torch.randn(7), 1e-5)
    with pytest.raises(RuntimeError, match="even"):
        ops.silu_mul(torch.randn(2, 5))
    with pytest.raises(RuntimeError, match="slot"):
        ops.rotary_to_cache(torch.randn(1, 3, 4), 1, 1, torch.randn(1, 4), torch.randn(1, 4),
                            torch.zeros(2, 1, 4), torch.zeros(2, 1, 4), torch.tensor([5]))
