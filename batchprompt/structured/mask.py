"""Token masks: ask each request's matcher which tokens may come next; forbid the others."""
from __future__ import annotations

import torch


def allowed_tokens(matchers: list, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A bool tensor [len(matchers), vocab_size]: True where a token keeps the output in its grammar."""
    # llguidance's numpy helpers: its torch module compiles a kernel we do not need on import.
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(len(matchers), vocab_size)
    for i, m in enumerate(matchers):
        fill_next_token_bitmask(m, bitmask, i)
    # Bit j of 32-bit word w is token 32*w + j: unpack bytes (little-endian) into bits.
    u8 = torch.from_numpy(bitmask).to(device).view(torch.uint8)
    shifts = torch.arange(8, dtype=torch.uint8, device=device)
    bits = (u8.unsqueeze(-1) >> shifts) & 1
    return bits.view(len(matchers), -1)[:, :vocab_size].bool()


def apply_masks(logits: torch.Tensor, rows: list[int], matchers: list) -> None:
    """Set the forbidden tokens' logits of `rows` to -inf, in place."""
    allowed = allowed_tokens(matchers, logits.shape[-1], logits.device)
    idx = torch.tensor(rows, device=logits.device)
    logits[idx] = logits.index_select(0, idx).masked_fill(~allowed, float("-inf"))
