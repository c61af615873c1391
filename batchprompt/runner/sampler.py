"""Sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token log-probs."""
from __future__ import annotations

import torch

from ..engine.outputs import ScheduledChunk
from ..models.ops import TORCH_OPS, TorchOps
from ..structured.mask import apply_masks


def sample(logits: torch.Tensor, chunks: list[ScheduledChunk],
           ops: TorchOps = TORCH_OPS) -> tuple[list[int], list[float | None]]:
    """logits [N, V], one row per chunk -> the chosen token and, if asked, its log-prob.
    `ops.argmax` picks the greedy tokens. Logits in the model's dtype are used as they are when
    every row is greedy with no log-probs or grammar; otherwise they are taken to float32 first.

    Log-probs are those of the model's distribution before temperature, filters and grammar
    masks. Rows whose chunk has a grammar matcher are masked (in place) to the tokens it allows.
    """
    want = [i for i, c in enumerate(chunks) if c.params.logprobs]
    constrained = [i for i, c in enumerate(chunks) if c.matcher is not None]
    sampled_rows = [i for i, c in enumerate(chunks) if not c.params.greedy]
    if want or constrained or sampled_rows:
        logits = logits.float()
    raw_lp = None
    if want:
        idx = torch.tensor(want, device=logits.device)
        raw_lp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
    if constrained:
        apply_masks(logits, constrained, [chunks[i].matcher for i in constrained])
    tokens = ops.argmax(logits)
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, rows), [chunks[i] for i in sampled_rows])
        unseeded = [j for j, i in enumerate(sampled_rows) if chunks[i].generator is None]
        if unseeded:
            picks = torch.multinomial(probs[unseeded], 1).squeeze(1)
            tokens[rows[unseeded]] = picks
        for j, i in enumerate(sampled_rows):
            gen = chunks[i].generator
            if gen is not None:  # own stream: same draws whatever else is in the batch
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    chosen = tokens.tolist()
    logprobs: list[float | None] = [None] * len(chunks)
    if raw_lp is not None:
        picked = raw_lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1).tolist()
        for i, v in zip(want, picked):
            logprobs[i] = v
    return chosen, logprobs


def _filtered_probs(logits: torch.Tensor, chunks: list[ScheduledChunk]) -> torch.Tensor:
    temps = torch.tensor([c.params.temperature for c in chunks], device=logits.device)
    logits = logits / temps.unsqueeze(1)
    top_k = [c.params.top_k for c in chunks]
    top_p = [c.params.top_p for c in chunks]
    if any(k > 0 for k in top_k) or any(p < 1 for p in top_p):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        ps = torch.tensor(top_p, device=logits.device).unsqueeze(1)
        drop |= (cum - sorted_logits.softmax(dim=-1)) >= ps  # keep the smallest set reaching p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    return logits.softmax(dim=-1)
