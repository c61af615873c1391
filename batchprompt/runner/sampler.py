"""Sampling: greedy, temperature, top-k, top-p, min-p, penalties, logit bias, min_tokens,
per-request seeds, chosen-token and top-k log-probs."""
from __future__ import annotations

import torch

from ..steps import ScheduledChunk
from ..models.ops import TORCH_OPS, TorchOps
from ..structured.mask import apply_masks


class Logprob(float):
    """A chosen token's log-prob that also carries the row's top-k: [(token id, log-prob)],
    most likely first. A float, so the runner hands it on like any other log-prob."""

    top: list[tuple[int, float]]

    def __new__(cls, value: float, top: list[tuple[int, float]]) -> "Logprob":
        self = super().__new__(cls, value)
        self.top = top
        return self


def sample(logits: torch.Tensor, chunks: list[ScheduledChunk],
           ops: TorchOps = TORCH_OPS) -> tuple[list[int], list[float | None]]:
    """logits [N, V], one row per chunk -> the chosen token and, if asked, its log-prob (a
    `Logprob` with the top k when params.top_logprobs is set).
    `ops.argmax` picks the greedy tokens. Logits in the model's dtype are used as they are when
    every row is greedy with no log-probs, grammar or logit adjustments; otherwise they are
    taken to float32 first. Adjustments (penalties, logit_bias, min_tokens) touch only the rows
    that ask for them.

    Log-probs are those of the model's distribution before penalties, temperature, filters and
    grammar masks (vLLM's default). Rows whose chunk has a grammar matcher are masked (in place)
    to the tokens it allows.
    """
    want = [i for i, c in enumerate(chunks) if c.params.logprobs]
    constrained = [i for i, c in enumerate(chunks) if c.matcher is not None]
    sampled_rows = [i for i, c in enumerate(chunks) if not c.params.greedy]
    adjusted = [i for i, c in enumerate(chunks) if c.params.adjusts_logits]
    if want or constrained or sampled_rows or adjusted:
        logits = logits.float()
    raw_lp = None
    if want:
        idx = torch.tensor(want, device=logits.device)
        raw_lp = torch.log_softmax(logits.index_select(0, idx), dim=-1)
    for i in adjusted:
        adjust_logits(logits[i], chunks[i])
    if constrained:
        apply_masks(logits, constrained, [chunks[i].matcher for i in constrained])
    tokens = ops.argmax(logits)
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        probs = _filtered_probs(logits.index_select(0, rows), [chunks[i] for i in sampled_rows])
        # A row left with no distribution (a temperature or top_p below float32's smallest
        # number, a repetition penalty that overflowed a logit to inf: NaNs, or nothing left)
        # keeps its most likely token, the limit of its options, instead of failing the step
        # for every request in it.
        drawable = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
        unseeded = [j for j, i in enumerate(sampled_rows) if chunks[i].generator is None and drawable[j]]
        if unseeded:
            picks = torch.multinomial(probs[unseeded], 1).squeeze(1)
            tokens[rows[unseeded]] = picks
        for j, i in enumerate(sampled_rows):
            gen = chunks[i].generator
            if gen is not None and drawable[j]:  # own stream: same draws whatever else is in the batch
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
    chosen = tokens.tolist()
    logprobs: list[float | None] = [None] * len(chunks)
    if raw_lp is not None:
        picked = raw_lp.gather(1, tokens.index_select(0, idx).unsqueeze(1)).squeeze(1).tolist()
        for j, (i, v) in enumerate(zip(want, picked)):
            k = chunks[i].params.top_logprobs
            if k:
                values, ids = raw_lp[j].topk(min(k + 1, raw_lp.shape[1]))
                logprobs[i] = Logprob(v, top_pairs(ids.tolist(), values.tolist(), k))
            else:
                logprobs[i] = v
    return chosen, logprobs


def top_pairs(ids: list[int], values: list[float], k: int) -> list[tuple[int, float]]:
    """The k most likely (token id, log-prob) of topk's k + 1, equal values in token id order:
    greedy's argmax takes the first of equal ones, so the chosen token comes first among its
    equals here too (topk's order of ties is its own; bfloat16 logits tie often)."""
    return sorted(zip(ids, values), key=lambda pair: (-pair[1], pair[0]))[:k]


def adjust_logits(row: torch.Tensor, chunk: ScheduledChunk) -> None:
    """Apply one row's logit_bias, penalties and min_tokens ban in place (float32 logits [V]).
    Order as vLLM: bias, then repetition, frequency and presence penalties; the ban last, so
    no bias lifts a banned token."""
    p = chunk.params
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), device=row.device)
        row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), device=row.device))
    out = chunk.output_token_ids or []
    if p.repetition_penalty != 1:
        seen = torch.tensor(list(chunk.prompt_token_ids or []) + list(out), device=row.device).unique()
        if len(seen):
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and out:
        counts = torch.bincount(torch.tensor(out, device=row.device), minlength=row.shape[0]).to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    if chunk.banned_token_ids:
        row[torch.tensor(chunk.banned_token_ids, device=row.device)] = float("-inf")


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
    probs = logits.softmax(dim=-1)
    min_p = [c.params.min_p for c in chunks]
    if any(min_p):  # drop tokens less likely than min_p times the most likely (after temperature)
        floor = probs.max(dim=-1, keepdim=True).values * torch.tensor(min_p, device=probs.device).unsqueeze(1)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs
