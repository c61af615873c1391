"""ModelRunner: executes one scheduled step on the model and samples."""
from __future__ import annotations

import torch

from ..engine.outputs import ModelRunnerOutput, SchedulerOutput
from ..models.llama import LlamaModel
from .inputs import build_inputs
from .kv_tensors import KVTensors
from .sampler import sample


class ModelRunner:
    def __init__(self, model: LlamaModel, block_size: int, max_blocks: int,
                 kv_dtype: torch.dtype | None = None):
        self.model = model
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.kv = KVTensors(model.args, block_size, kv_dtype or self.dtype, self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.kv.ensure(sched.num_blocks, self.max_blocks)
        inputs = build_inputs(sched.chunks, self.block_size, self.device)
        hidden = self.model(inputs.input_ids, inputs.positions, self.kv.layers, inputs.attention)
        if not inputs.sampling_chunks:
            return ModelRunnerOutput({})
        logits = self.model.logits(hidden.index_select(0, inputs.logits_index))
        tokens, logprobs = sample(logits, inputs.sampling_chunks)
        ids = [c.request_id for c in inputs.sampling_chunks]
        return ModelRunnerOutput(
            sampled=dict(zip(ids, tokens)),
            logprobs={i: lp for i, lp in zip(ids, logprobs) if lp is not None},
        )
