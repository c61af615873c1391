"""PromptStage: batchprompt as a Ray Data stage, for pipelines that already use Ray Data.

    import ray, batchprompt.ray as bpr
    ds = ray.data.read_parquet("in.parquet")
    ds = ds.map_batches(bpr.PromptStage, fn_constructor_kwargs=dict(column="prompt", system="...",
                        max_tokens=64), concurrency=4, num_gpus=1, batch_size=256)
    ds.write_parquet("out/")

Ray Data runs the class as a pool of actors (`concurrency`), each loading one engine once, as
Ray Data LLM's processors do with vLLM. Each batch's prompts run through that engine's batch
API (prefix sharing, structured output, each prompt failing alone) and come back as two new
columns: `result` (the answer's text, null where it failed) and `error` (null where it did
not). Every other column passes through unchanged, so an id column for Ray Data's
checkpointing (DataContext.checkpoint_config) stays.
"""
from __future__ import annotations

from typing import Any


class PromptStage:
    """A callable class for `Dataset.map_batches`: adds `result` and `error` columns.

    column          the prompt column: text, or chat messages (a list of {"role", "content"})
    model           as for LanguageModel.create (None: the embedded model)
    system          the system prompt of every row
    threads         torch threads of this actor's engine (default: torch's choice)
    result_column, error_column  names of the added columns
    **options       generation options (max_tokens, temperature, seed, choices, json_schema, ...)
    """

    def __init__(self, column: str = "prompt", *, model: Any = None, system: str | None = None,
                 device: str = "auto", dtype: str = "auto", engine_options: dict | None = None,
                 threads: int | None = None, result_column: str = "result", error_column: str = "error",
                 **options: Any):
        if threads is not None:
            import torch

            torch.set_num_threads(threads)
        from ..api.session import LanguageModel

        self.column, self.result_column, self.error_column = column, result_column, error_column
        self.lm = LanguageModel.create(system=system, model=model, device=device, dtype=dtype,
                                       engine_options=engine_options, **options)

    def __call__(self, batch):
        import numpy as np

        if hasattr(batch, "columns") and hasattr(batch, "assign"):  # a pandas DataFrame
            prompts = list(batch[self._column(batch.columns)])
            texts, errors = self._run(prompts)
            return batch.assign(**{self.result_column: texts, self.error_column: errors})
        prompts = [_plain(p) for p in batch[self._column(batch.keys())]]
        texts, errors = self._run(prompts)
        out = dict(batch)
        out[self.result_column] = np.array(texts, dtype=object)
        out[self.error_column] = np.array(errors, dtype=object)
        return out

    def _column(self, columns) -> str:
        if self.column not in list(columns):
            raise KeyError(f"PromptStage: the batch has no column {self.column!r} (its columns: "
                           f"{', '.join(map(str, columns))}); pass column=<the prompt column>")
        return self.column

    def _run(self, prompts: list) -> tuple[list, list]:
        results = self.lm.batch_prompt(prompts)
        return ([r.text if r.error is None else None for r in results],
                [r.error for r in results])


def _plain(value):
    """A cell as the batch API takes it: numpy's object arrays of messages become lists."""
    if isinstance(value, str):
        return value
    try:
        import numpy as np

        if isinstance(value, np.ndarray):
            value = value.tolist()
    except ImportError:  # pragma: no cover  (Ray Data needs numpy)
        pass
    if isinstance(value, (list, tuple)):
        return [dict(m) for m in value]
    return value
