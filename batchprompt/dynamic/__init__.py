"""Dynamic batching for any function: `bp.dynamically`."""
from .decorator import DynamicFunction, dynamically
from .errors import WorkerDied
from .processor import BatchProcessor, BatchSizeMismatch, DeadlineExceeded, QueueFull
from .stats import BatchStats

__all__ = ["BatchProcessor", "BatchSizeMismatch", "BatchStats", "DeadlineExceeded", "DynamicFunction",
           "QueueFull", "WorkerDied", "dynamically"]
