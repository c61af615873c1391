"""ModelRunner: executes one scheduled step on the model and samples."""
from __future__ import annotations

from typing import Callable

import torch

from ..device import available_memory
from ..kernels import CompiledOps, compiled_module
from ..models.flash_attention import varlen_op
from ..models.llama import LlamaModel
from ..models.ops import TORCH_OPS
from ..steps import ModelRunnerOutput, SchedulerOutput
from .inputs import build_inputs
from .kv_tensors import KVTensors
from .sampler import sample, top_pairs


class ModelRunner:
    """Owns the model and its KV cache tensors. `kv_cache_memory` is the cache's ceiling in
    bytes (None: `kv_memory_fraction` of the device's free memory); `max_blocks` is how many
    blocks of `block_size` tokens it holds, which the engine's block pool hands out."""

    def __init__(self, model: LlamaModel, block_size: int, kv_cache_memory: int | None = None,
                 kv_memory_fraction: float = 0.25, kv_dtype: torch.dtype | None = None):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        kv_dtype = kv_dtype or self.dtype
        self.bytes_per_block = KVTensors.bytes_per_block(model.args, block_size, kv_dtype)
        budget = kv_cache_memory or int(available_memory(self.device) * kv_memory_fraction)
        self.max_blocks = max(1, budget // self.bytes_per_block)
        self.kv = KVTensors(model.args, block_size, kv_dtype, self.device)
        # On the CPU, the compiled kernels: paged decode attention (None: PyTorch attention for
        # all rows) and the layers' fused elementwise steps.
        module = compiled_module(self.device)
        self.decode_op = None if module is None else module.decode_attention
        self.ops = TORCH_OPS if module is None else CompiledOps(module)
        # On CUDA, FlashAttention's variable-length kernel for every step's attention, where it
        # serves (None: padded SDPA groups).
        a = model.args
        self.varlen_op = varlen_op(self.device, self.dtype, a.num_heads, a.num_kv_heads, a.head_dim)
        # On the CPU, a second copy of the weights in oneDNN's packed layout, which every step
        # uses (LlamaModel.pack_weights: its GEMMs run 15-20% faster in bfloat16, 2.3x in
        # float32), where that copy takes at most a quarter of the free memory.
        if self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float32):
            weights = sum(p.numel() * p.element_size() for p in model.parameters())
            if weights <= available_memory(self.device) // 4:
                model.pack_weights()

    def holds(self, sched: SchedulerOutput) -> bool:
        """Whether the KV tensors hold `sched`'s blocks now, without growing (a step run inside
        another step's `pause` must not: growing replaces the tensors under the outer step)."""
        return sched.num_blocks <= self.kv.capacity_blocks

    @staticmethod
    def _prompt_tops(sched: SchedulerOutput, inputs, logits: torch.Tensor, norm: torch.Tensor,
                     out: ModelRunnerOutput) -> None:
        """The k most likely tokens at each scored prompt position of the requests that ask
        (prompt_top_logprobs: an echoed prompt's top_logprobs), and each prompt token's rank among
        the vocabulary where asked (prompt_ranks: vLLM's prompt_logprobs). Those requests' own
        prompt log-probs are then read from the same logits, as a sampled token's are, so that a
        token among its position's top ones has one value (the float32 product of the scoring path
        differed from it by up to 0.06 in bfloat16), and its rank agrees with them."""
        asked = {c.request_id: (c.params.prompt_top_logprobs, c.params.prompt_ranks) for c in sched.chunks
                 if c.params.prompt_top_logprobs or c.params.prompt_ranks}
        rows = [row for row, (rid, _) in enumerate(inputs.score_owners) if rid in asked]
        if not rows:
            return
        # Only the rows of those requests (a step's other scored rows, a choice's labels, need none).
        index = torch.tensor(rows, device=logits.device)
        full, base = logits.index_select(0, index).float(), norm.index_select(0, index)[:, None]
        most = max(k for k, _ in asked.values())
        width = min(most + 1, full.shape[1]) if most else 0  # one more: see top_pairs
        values, ids = torch.topk(full, width, dim=-1) if most else (full[:, :0], full[:, :0].long())
        values, ids = (values - base).tolist(), ids.tolist()
        chosen_logits = full.gather(1, inputs.score_tokens.index_select(0, index)[:, None])
        chosen = (chosen_logits - base).squeeze(1).tolist()
        ranks = ((full > chosen_logits).sum(dim=1) + 1).tolist()  # 1 + the tokens likelier than it
        own: dict[str, list[tuple[int, float]]] = {}
        for i, row in enumerate(rows):
            rid, pos = inputs.score_owners[row]
            k, rank = asked[rid]
            if k:
                out.prompt_top.setdefault(rid, []).append((pos, top_pairs(ids[i], values[i], k)))
            if rank:
                out.prompt_ranks.setdefault(rid, []).append((pos, ranks[i]))
            own.setdefault(rid, []).append((pos, chosen[i]))
        out.prompt_logprobs.update(own)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, pause: Callable[[], None] | None = None) -> ModelRunnerOutput:
        """Run one step. `pause` is called between the model's layers (see LlamaModel.forward)."""
        self.kv.ensure(sched.num_blocks, self.max_blocks)
        inputs = build_inputs(sched.chunks, self.block_size, self.device, self.decode_op, self.varlen_op)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv.layers, inputs.attention, self.ops, pause)
        out = ModelRunnerOutput({})
        rows = inputs.logits_index
        if inputs.score_index is not None:
            rows = torch.cat([rows, inputs.score_index])
        if not len(rows):
            return out
        picked_hidden = hidden.index_select(0, rows)
        logits = self.model.logits(picked_hidden, float32=False)
        n = len(inputs.sampling_chunks)
        # A scored token's log-prob: its logit computed in float32, less the log of the sum over
        # the vocabulary, from the logits as computed (it cancels between labels at one position).
        if inputs.score_index is not None:
            exact = self.model.token_logits(picked_hidden[n:], inputs.score_tokens)
            norm = torch.logsumexp(logits[n:].float(), dim=-1)
            picked = (exact - norm).tolist()
            for (rid, pos), v in zip(inputs.score_owners, picked):
                out.prompt_logprobs.setdefault(rid, []).append((pos, v))
            self._prompt_tops(sched, inputs, logits[n:], norm, out)
        if not n:
            return out
        chunks = inputs.sampling_chunks
        for i, c in enumerate(chunks):  # scoring requests: each candidate's first token
            if c.params.score_choices:
                first = torch.tensor([ids[0] for ids in c.params.score_choices], device=logits.device)
                exact = self.model.token_logits(picked_hidden[i].expand(len(first), -1), first)
                out.choice_logprobs[c.request_id] = (exact - torch.logsumexp(logits[i].float(), dim=-1)).tolist()
        tokens, logprobs = sample(logits[:n], chunks, self.ops)
        ids = [c.request_id for c in chunks]
        out.sampled = dict(zip(ids, tokens))
        out.logprobs = {i: lp for i, lp in zip(ids, logprobs) if lp is not None}
        return out
