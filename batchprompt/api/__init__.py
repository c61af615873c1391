"""The batch prompt API: static (`batch_prompt`), sessions (`LanguageModel`) and streaming (`Batch`)."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from .batch import Batch
from .options import GenerationOptions
from .progress import Progress
from .result import BatchError, EngineStoppedError, Result, SessionDestroyedError, Usage
from .service import shutdown
from .session import LanguageModel, Message, Prompt


def batch_prompt(prompts: Iterable[Prompt], *, system: str | None = None,
                 initial_prompts: Sequence[Message] | None = None, model=None, errors: str = "return",
                 progress: bool = False, device: str = "auto", dtype: str = "auto",
                 engine_options: dict | None = None, **options: Any) -> list[Result]:
    """Run every prompt with a shared system prompt; results in input order. `model`, `device`,
    `dtype` and `engine_options` are LanguageModel.create's."""
    with LanguageModel.create(system=system, initial_prompts=initial_prompts, model=model, device=device,
                              dtype=dtype, engine_options=engine_options) as lm:
        return lm.batch_prompt(prompts, errors=errors, progress=progress, **options)


async def abatch_prompt(prompts: Iterable[Prompt], *, system: str | None = None,
                        initial_prompts: Sequence[Message] | None = None, model=None, errors: str = "return",
                        device: str = "auto", dtype: str = "auto", engine_options: dict | None = None,
                        **options: Any) -> list[Result]:
    import asyncio

    lm = await asyncio.to_thread(LanguageModel.create, system=system, initial_prompts=initial_prompts,
                                 model=model, device=device, dtype=dtype, engine_options=engine_options)
    try:
        return await lm.abatch_prompt(prompts, errors=errors, **options)
    finally:
        lm.destroy()


__all__ = ["Batch", "BatchError", "EngineStoppedError", "GenerationOptions", "LanguageModel", "Progress",
           "Result", "SessionDestroyedError", "Usage", "abatch_prompt", "batch_prompt", "shutdown"]
