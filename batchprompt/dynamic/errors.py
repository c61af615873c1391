"""The errors a dynamic batcher raises to its callers."""


class QueueFull(Exception):
    """The batcher's queue holds `max_queue` items; retry later, or pass block_when_full=True."""


class DeadlineExceeded(TimeoutError):
    """The item's deadline passed before its result was ready."""


class BatchSizeMismatch(ValueError):
    """The function returned a different number of results than it was given items."""
