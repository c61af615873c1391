"""The errors a dynamic batcher raises to its callers."""


class QueueFull(Exception):
    """The batcher's queue holds `max_queue` items; retry later, or pass block_when_full=True."""


class DeadlineExceeded(TimeoutError):
    """The item's deadline passed before its result was ready."""


class Withdrawn(Exception):
    """The item was taken off the queue unrun: its caller stopped waiting (an imap or aimap left
    before its turn). Nobody reads it; it fills the slot so that nothing waits on it."""


class BatchSizeMismatch(ValueError):
    """The function returned a different number of results than it was given items."""


class WorkerDied(Exception):
    """Raised by the batched function to say that its worker (its replica: a lost GPU, a
    crashed model server) can serve no more. The worker ends, a new one takes its place (with a
    new replica from the factory), and the batch is run again once; an item whose batch kills a
    worker a second time fails with this error."""
