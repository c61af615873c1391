"""Durable batch jobs over files: `batchprompt run` (OpenAI batch JSONL, plain JSONL, CSV, Parquet)."""
from .journal import Journal, JournalMismatch
from .rows import InputError, Row, RowError, read_rows
from .run import JobOptions, JobSummary, run_job

__all__ = ["InputError", "JobOptions", "JobSummary", "Journal", "JournalMismatch", "Row", "RowError",
           "read_rows", "run_job"]
