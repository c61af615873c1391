"""Padding and stacking dict items of numpy arrays or torch tensors, and splitting outputs back."""
from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any, Callable

from .errors import BatchSizeMismatch


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def pad_stack(items: list[dict[str, Any]], pad_token: dict[str, Any]) -> dict[str, Any]:
    """{key: [B, L, ...]} from items {key: [L_i, ...]}, right-padded with pad_token[key] (default 0).
    Items that do not stack (not a dict, other keys, other shapes past the first dimension) raise
    a TypeError or ValueError that says so; the batch is then split, so such an item fails alone."""
    _check_items(items, pad_token)
    keys = items[0].keys()
    out = {}
    for key in keys:
        values = [it[key] for it in items]
        pad = pad_token.get(key, 0)
        if _is_torch(values[0]):
            import torch
            if values[0].dim() == 0:
                out[key] = torch.stack(values)
                continue
            batch = torch.nn.utils.rnn.pad_sequence(values, batch_first=True, padding_value=pad)
        else:
            import numpy as np
            values = [np.asarray(v) for v in values]
            if values[0].ndim == 0:
                out[key] = np.stack(values)
                continue
            length = max(v.shape[0] for v in values)
            batch = np.full((len(values), length, *values[0].shape[1:]), pad, dtype=values[0].dtype)
            for i, v in enumerate(values):
                batch[i, :v.shape[0]] = v
        out[key] = batch
    return out


def _check_items(items: list[Any], pad_token: dict[str, Any]) -> None:
    for item in items:
        if not isinstance(item, Mapping) or not item:
            raise TypeError(f"with tensors=True or pad_token, an item is a dict of numpy arrays or torch tensors, "
                            f"such as {{'input_ids': 1-D array}}; got {_kind(item)}")
        missing = [k for k in pad_token if k not in item]
        if missing:
            raise ValueError(f"an item has no {missing[0]!r}, which pad_token names (it has {sorted(map(str, item))})")
        for key, value in item.items():
            if not _array_like(value):
                raise TypeError(f"with tensors=True or pad_token, an item's values are numpy arrays, torch tensors "
                                f"or lists of numbers; its {key!r} is {_kind(value)}")
            if key in pad_token and not _shape(value):  # it was stacked as [B], and the output blamed
                raise ValueError(f"an item's {key!r} is a single number (0-d), but pad_token pads {key!r} along "
                                 f"its first dimension: give it as a [L] array (a number of a key that pad_token "
                                 f"does not name is stacked as [B])")
    first = items[0]
    for item in items[1:]:
        if item.keys() != first.keys():
            raise ValueError(f"the items of one batch need the same keys: one has {sorted(map(str, item))}, "
                             f"another {sorted(map(str, first))}")
        for key, value in item.items():
            a, b = _shape(value), _shape(first[key])
            if len(a) != len(b) or a[1:] != b[1:]:
                raise ValueError(f"the items' {key!r} values do not stack: shapes {a} and {b} (only the first "
                                 f"dimension, the one padded, may differ)")


def _array_like(x: Any) -> bool:
    if getattr(x, "shape", None) is not None:
        return True
    if isinstance(x, bool) or isinstance(x, (int, float)):
        return True
    return isinstance(x, (list, tuple)) and all(isinstance(v, (int, float, list, tuple)) for v in x)


def _shape(x: Any) -> tuple:
    shape = getattr(x, "shape", None)
    if shape is not None:
        return tuple(shape)
    import numpy as np
    try:
        return tuple(np.shape(x))
    except ValueError:  # ragged nested lists
        return (len(x), None)


def _kind(x: Any) -> str:
    return "a dict with no values" if isinstance(x, Mapping) else f"a {type(x).__name__}"


def split(outputs: Any, n: int, where: str = "the output") -> list:
    """Per-item outputs from a batched output: an array/tensor [B, ...], a dict or a tuple of them
    (each item gets a dict or a tuple of its parts), or a list (already one result per item)."""
    if isinstance(outputs, dict):
        parts = {k: split(v, n, f"{where}[{k!r}]") for k, v in outputs.items()}
        return [{k: parts[k][i] for k in parts} for i in range(n)]
    if isinstance(outputs, tuple):  # (logits, hidden), as models return them: split each part
        parts = [split(v, n, f"{where}[{j}]") for j, v in enumerate(outputs)]
        return [tuple(p[i] for p in parts) for i in range(n)]
    if isinstance(outputs, list):
        return outputs
    size = _leading(outputs)
    if size != n:
        shape = getattr(outputs, "shape", None)
        raise BatchSizeMismatch(f"{where} has " + (f"shape {tuple(shape)}" if shape is not None else
                                                   f"type {type(outputs).__name__}")
                                + f": it must have one row per item, {n} rows (a first dimension of the batch size)")
    return [outputs[i] for i in range(n)]


def _leading(x: Any) -> int | None:
    """The first dimension of an array or tensor (None for a scalar or what has no length)."""
    shape = getattr(x, "shape", None)
    if shape is not None:
        return int(shape[0]) if len(shape) else None
    try:
        return len(x)
    except TypeError:
        return None


class TensorBatcher:
    """Wraps fn(batch_dict) -> batched outputs into fn(items) -> per-item outputs."""

    def __init__(self, fn: Callable, pad_token: dict[str, Any]):
        self.fn, self.pad_token = fn, pad_token
        self.__qualname__ = getattr(fn, "__qualname__", "function")

    def __call__(self, items: list[dict[str, Any]], **replica):
        out = self.fn(pad_stack(items, self.pad_token), **replica)
        if inspect.isawaitable(out):
            async def finish():
                return split(await out, len(items))
            return finish()
        return split(out, len(items))


def item_length(item: dict[str, Any]) -> int:
    """The tensor variant's own length of an item: its longest value (the dimension padded)."""
    return max((len(v) if getattr(v, "ndim", 1) else 1) for v in item.values())
