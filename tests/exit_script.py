"""A script that ends while its batch still runs, and what its exit must say: the exit test of
each backend that is not the local engine (tests/ray, tests/remote; the local one's, with its
callback counts, is in tests/api/test_shutdown.py)."""
from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import sys, time
import batchprompt as bp
lm = bp.LanguageModel.create({session})
print(bool(lm.prompt("hi", max_tokens=2)), flush=True)  # the backend is up
batch = lm.create_batch([f"Write a long story about a cat named {{i}}" for i in range(8)], max_tokens=400,
                        min_tokens=400)
batch.on_result(lambda i, r: print("CALLBACK", i, r.finish_reason, flush=True)).start()
time.sleep(1)
print("leaving", batch.progress.done, flush=True)
"""


def end_while_a_batch_runs(session: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Run the script with `session` as LanguageModel.create's arguments (they may read
    sys.argv[1:], which is `args`) and check its exit: status 0 with none of the 8 prompts done,
    no callback run for them (as on a local engine), the one warning naming them, no traceback."""
    p = subprocess.run([sys.executable, "-c", SCRIPT.format(session=session), *args], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert p.returncode == 0 and "leaving 0" in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "CALLBACK" not in p.stdout, p.stdout
    assert ("the script ended with 8 prompts unfinished: cancelled, without the 8 callback calls due "
            "for them") in p.stderr, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    return p


INTERRUPTED = """
import os, signal, sys, threading
import batchprompt as bp
lm = bp.LanguageModel.create({session})
print(bool(lm.prompt("hi", max_tokens=2)), flush=True)  # the backend is up
threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
try:
    lm.batch_prompt([f"Write a long story about a cat named {{i}}" for i in range(8)], max_tokens=400, min_tokens=400)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def interrupt_a_batch(session: str, args: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Ctrl-C inside `batch_prompt`, then the script ends: the batch was cancelled by the Ctrl-C,
    so the exit must not speak of prompts left unfinished for want of a wait()."""
    from tests.conftest import sigint_default  # SIGINT is ignored in a background job's children (make test &)

    p = subprocess.run([sys.executable, "-c", INTERRUPTED.format(session=session), *args], capture_output=True,
                       text=True, timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                       preexec_fn=sigint_default)
    assert p.returncode == 0 and "interrupted" in p.stdout, (p.returncode, p.stdout, p.stderr[-3000:])
    assert "unfinished" not in p.stderr and "Traceback" not in p.stderr, p.stderr[-3000:]
    return p
