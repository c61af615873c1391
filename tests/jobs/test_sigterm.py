"""jobs/sigterm.py: the first Ctrl-C or SIGTERM stops a job; later ones are ignored."""
from __future__ import annotations

import os
import signal
import time

import pytest

from batchprompt.jobs.sigterm import Terminated, sigterm_as_interrupt


@pytest.fixture
def handlers():
    """Python's own handlers while the test runs (SIGINT may be ignored where the suite was started
    in the background), and the suite's put back after it."""
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield
    signal.signal(signal.SIGINT, before[0])
    signal.signal(signal.SIGTERM, before[1])


@pytest.mark.parametrize("first, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, Terminated)])
def test_after_the_first_signal_a_held_block_leaves_later_ones_ignored(handlers, first, raised):
    """`batchprompt run` printed its summary after the block, with the handlers put back: a second
    Ctrl-C 0.3 s after the first ended the process by the signal, not with 130 and its summary."""
    with pytest.raises(raised):
        with sigterm_as_interrupt(hold_after=True):
            os.kill(os.getpid(), first)
            time.sleep(5)  # the handler raises before this ends
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    os.kill(os.getpid(), signal.SIGINT)  # ignored: nothing is raised
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)


def test_without_a_signal_the_handlers_are_put_back(handlers):
    with sigterm_as_interrupt(hold_after=True):
        pass
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
