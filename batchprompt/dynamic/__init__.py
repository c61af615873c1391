"""Dynamic batching for any function: `bp.dynamically`."""
from .decorator import DynamicFunction, dynamically
from .processor import BatchProcessor, BatchSizeMismatch, DeadlineExceeded, QueueFull
from .stats import BatchStats

__all__ = ["BatchProcessor", "BatchSizeMismatch", "BatchStats", "DeadlineExceeded", "DynamicFunction",
           "QueueFull", "dynamically"]
