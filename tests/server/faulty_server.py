"""`python -m tests.server.faulty_server ARGS`: the server, but the batch journal raises a
RuntimeError (a bug's stand-in) when it is asked to record its FAIL_AT_ROW-th request (an
environment variable), so a test can see what a batch that fails mid-run keeps."""
import os

from batchprompt.jobs.journal import Journal
from batchprompt.server.command import main

FAIL_AT = int(os.environ["FAIL_AT_ROW"])
_record = Journal.record
_calls = 0


def record(self, *args, **kwargs):
    global _calls
    _calls += 1
    if _calls == FAIL_AT:
        raise RuntimeError(f"injected fault at the journal's row {FAIL_AT}")
    return _record(self, *args, **kwargs)


Journal.record = record
raise SystemExit(main())
