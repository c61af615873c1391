"""The compiled paged decode attention against PyTorch's attention on the same cache."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(scope="module")
def op(compiled_kernels):
    return compiled_kernels.decode_attention


def reference(q, k_cache, v_cache, table, lens, block_size):
    """Per request: gather its keys and values, then plain SDPA in float64."""
    out = []
    for b in range(q.shape[0]):
        n = int(lens[b])
        slots = torch.stack([table[b, t // block_size] * block_size + t % block_size for t in range(n)])
        k = k_cache[slots].double().transpose(0, 1)  # [Hkv, n, D]
        v = v_cache[slots].double().transpose(0, 1)
        qb = q[b].double().unsqueeze(1)  # [H, 1, D]
        group = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(qb, k, v).squeeze(1))
    return torch.stack(out)


CASES = [  # heads, kv_heads, head_dim, block_size
    (9, 3, 64, 4),  # SmolLM2-135M: the vector path
    (4, 4, 128, 16),  # no grouping, wider heads
    (14, 2, 64, 7),  # a group of 7, an odd block size: values in chunks of 4 + 3 heads
    (10, 2, 128, 4),  # a group of 5 at head size 128: chunks of 2 + 2 + 1 heads
    (2, 1, 256, 3),  # head size 256: one head per pass over the values
    (4, 2, 16, 4),  # the tests' tiny model
    (6, 3, 24, 5),  # a head size the vector path does not take: the plain loop
]


@pytest.mark.parametrize("heads,kv_heads,dim,block_size", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_reference(op, heads, kv_heads, dim, block_size, dtype, tol):
    g = torch.Generator().manual_seed(heads * dim + block_size)
    num_blocks, batch = 64, 6
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=g).to(dtype)
    # Context lengths: 1 key, under and over sixteen, a full table; blocks scattered.
    lens = torch.tensor([1, 5, 16, 17, 40, 8 * block_size]).clamp(max=8 * block_size)
    table = torch.stack([torch.randperm(num_blocks, generator=g)[:8] for _ in range(batch)])
    # q as the model makes it: a strided view into a wider [T, heads + 2 * kv_heads, D] tensor.
    qkv = torch.randn(batch, heads + 2 * kv_heads, dim, generator=g).to(dtype)
    q = qkv[:, :heads]
    got = op(q, k_cache, v_cache, table, lens, block_size, dim ** -0.5)
    want = reference(q, k_cache, v_cache, table, lens, block_size)
    assert got.dtype == dtype and got.shape == (batch, heads, dim)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def test_bad_inputs_are_errors(op):
    q = torch.randn(2, 4, 16)
    cache = torch.randn(32, 2, 16)
    table = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="context length"):
        op(q, cache, cache, table, torch.tensor([3, 9]), 4, 0.25)  # 9 keys > 2 blocks of 4
    with pytest.raises(RuntimeError, match="dtype"):
        op(q.bfloat16(), cache, cache, table, torch.tensor([3, 3]), 4, 0.25)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        op(torch.randn(2, 3, 16), cache, cache, table, torch.tensor([3, 3]), 4, 0.25)
