"""Turn a SchedulerOutput into model inputs: flat token ids, positions, slots, attention groups."""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Callable

import torch

from ..models.attention import AttentionGroup, AttentionMetadata, DecodeBatch, VarlenBatch
from ..steps import ScheduledChunk

# A group of padded attention rows may cost at most this much more than its real area.
MAX_PADDING_RATIO = 1.5


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionMetadata
    logits_index: torch.Tensor  # flat index of the last token of each sampling chunk
    sampling_chunks: list[ScheduledChunk]
    # Prompt tokens to score: flat index of the predicting token, the target, (request, position).
    score_index: torch.Tensor | None = None
    score_tokens: torch.Tensor | None = None
    score_owners: list[tuple[str, int]] | None = None


def build_inputs(chunks: list[ScheduledChunk], block_size: int, device: torch.device,
                 decode_op: Callable | None = None, varlen_op: Callable | None = None) -> ModelInputs:
    """`decode_op`: a compiled decode-attention kernel; when given, all one-token chunks are
    laid out first and served by it as one DecodeBatch. `varlen_op`: a variable-length
    attention kernel (CUDA); when given, it serves every chunk, laid out in their order, as one
    VarlenBatch (and `decode_op` is not used)."""
    if varlen_op is not None:  # one call for every chunk, in their order
        decode_op, decodes, plan = None, [], [list(range(len(chunks)))]
    else:
        decodes = [i for i, c in enumerate(chunks) if len(c.token_ids) == 1] if decode_op is not None else []
        plan = ([decodes] if decodes else []) + _plan_groups(chunks, skip=set(decodes))
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    offsets: list[int] = [0] * len(chunks)
    # Tokens are laid out group by group, so an unpadded group is one contiguous slice.
    for i in (i for members in plan for i in members):
        c = chunks[i]
        offsets[i] = len(ids)
        ids.extend(c.token_ids)
        for p in range(c.start, c.context_len):
            positions.append(p)
            slots.append(c.block_ids[p // block_size] * block_size + p % block_size)
    sampling = [(i, c) for i, c in enumerate(chunks) if c.sample]
    as_long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
    if varlen_op is not None:
        meta = AttentionMetadata(as_long(slots), [], len(ids), varlen=_varlen_batch(chunks, block_size, varlen_op,
                                                                                     device))
    else:
        groups = [_group(chunks, offsets, members, block_size, device) for members in plan[1 if decodes else 0:]]
        meta = AttentionMetadata(as_long(slots), groups, len(ids))
    if decodes:
        meta.decode = _decode_batch([chunks[i] for i in decodes], block_size, decode_op, as_long)
    inputs = ModelInputs(
        input_ids=as_long(ids),
        positions=as_long(positions),
        attention=meta,
        logits_index=as_long([offsets[i] + len(c.token_ids) - 1 for i, c in sampling]),
        sampling_chunks=[c for _, c in sampling],
    )
    scored = [(i, off, tok) for i, c in enumerate(chunks) for off, tok in c.score_targets]
    if scored:
        inputs.score_index = as_long([offsets[i] + off for i, off, _ in scored])
        inputs.score_tokens = as_long([tok for _, _, tok in scored])
        inputs.score_owners = [(chunks[i].request_id, chunks[i].start + off + 1) for i, off, _ in scored]
    return inputs


def _decode_batch(sel: list[ScheduledChunk], block_size: int, op: Callable, as_long) -> DecodeBatch:
    """The decode rows are the first len(sel) tokens of the step."""
    lens = [c.context_len for c in sel]
    return DecodeBatch(0, len(sel), as_long(_block_table(sel, block_size)), as_long(lens), block_size, op)


def _block_table(chunks: list[ScheduledChunk], block_size: int) -> list[list[int]]:
    """Each chunk's blocks, as many as the longest context needs, padded with block 0."""
    width = -(-max(c.context_len for c in chunks) // block_size)
    return [c.block_ids[:width] + [0] * (width - min(len(c.block_ids), width)) for c in chunks]


def _varlen_batch(chunks: list[ScheduledChunk], block_size: int, op: Callable, device) -> VarlenBatch:
    """Every chunk's keys (positions 0 .. context_len - 1) as cache slots, back to back. Made
    on the device from each chunk's block table, with nothing that waits on it (a boolean index
    or a repeat without its size would)."""
    q_lens = [len(c.token_ids) for c in chunks]
    k_lens = [c.context_len for c in chunks]
    max_k, total = max(k_lens), sum(k_lens)
    table = torch.tensor(_block_table(chunks, block_size), dtype=torch.long, device=device)
    cu_q, cu_k = [0, *itertools.accumulate(q_lens)], [0, *itertools.accumulate(k_lens)]
    row = torch.repeat_interleave(torch.arange(len(chunks), device=device),
                                  torch.tensor(k_lens, device=device), output_size=total)
    pos = torch.arange(total, device=device) - torch.tensor(cu_k[:-1], device=device)[row]
    key_slots = table[row, pos // block_size] * block_size + pos % block_size
    as_int = lambda xs: torch.tensor(xs, dtype=torch.int32, device=device)  # noqa: E731
    return VarlenBatch(key_slots, as_int(cu_q), as_int(cu_k), max(q_lens), max_k, op)


def _plan_groups(chunks: list[ScheduledChunk], skip: set[int] = frozenset()) -> list[list[int]]:
    """Split chunks (but those in `skip`) into groups of similar shape, so padding stays under
    MAX_PADDING_RATIO. Decodes (one query) and prefills never share a group."""
    groups: list[list[int]] = []
    for is_decode in (True, False):
        members = [i for i, c in enumerate(chunks) if (len(c.token_ids) == 1) == is_decode and i not in skip]
        members.sort(key=lambda i: (len(chunks[i].token_ids), chunks[i].context_len))
        current: list[int] = []
        real = max_q = max_k = 0
        for i in members:
            q, k = len(chunks[i].token_ids), chunks[i].context_len
            mq, mk = max(max_q, q), max(max_k, k)
            if current and (len(current) + 1) * mq * mk > MAX_PADDING_RATIO * (real + q * k):
                groups.append(current)
                current, real, mq, mk = [], 0, q, k
            current.append(i)
            real, max_q, max_k = real + q * k, mq, mk
        if current:
            groups.append(current)
    return groups


def _group(chunks, offsets, members, block_size, device) -> AttentionGroup:
    sel = [chunks[i] for i in members]
    q_lens = torch.tensor([len(c.token_ids) for c in sel], device=device)
    starts = torch.tensor([c.start for c in sel], device=device)
    max_q = int(q_lens.max())
    max_k = max(c.context_len for c in sel)
    table = torch.tensor(_block_table(sel, block_size), dtype=torch.long, device=device)
    key_slots = (table.unsqueeze(-1) * block_size
                 + torch.arange(block_size, device=device)).view(len(sel), -1)[:, :max_k]
    q_pos = torch.arange(max_q, device=device)
    clamped = torch.minimum(q_pos.unsqueeze(0), (q_lens - 1).unsqueeze(1))  # padding repeats the last query
    offs = torch.tensor([offsets[i] for i in members], dtype=torch.long, device=device)
    query_index = offs.unsqueeze(1) + clamped
    # A query at position start+i sees keys 0..start+i (causal), which also hides key padding.
    visible = (starts.unsqueeze(1) + clamped).unsqueeze(-1)
    mask = (torch.arange(max_k, device=device).view(1, 1, -1) <= visible).unsqueeze(1)
    valid, token_range = None, None
    if max_q > 1 and bool((q_lens != max_q).any()):
        valid = (q_pos.unsqueeze(0) < q_lens.unsqueeze(1)).view(-1).nonzero().squeeze(1)
    else:
        token_range = (offsets[members[0]], offsets[members[0]] + len(members) * max_q)
    return AttentionGroup(query_index, key_slots, mask, valid, token_range)
