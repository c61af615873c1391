"""A progress bar on a terminal that reports 0 columns and 0 lines (a pseudo-terminal made
without a size, as `script` and some CI runners make) was not drawn at all."""
from __future__ import annotations

import os
import select
import time

from tqdm import tqdm

from batchprompt.progress_bar import LOG_INTERVAL_S, width_options


def _drawn(fd: int) -> str:
    out = b""
    while select.select([fd], [], [], 0.2)[0]:
        out += os.read(fd, 65536)
    return out.decode()


def test_a_terminal_of_no_size_gets_a_bar_all_the_same():
    master, slave = os.openpty()  # a new pseudo-terminal has no size: 0 x 0
    try:
        with os.fdopen(os.dup(slave), "w") as term:
            assert tuple(os.get_terminal_size(term.fileno())) == (0, 0)
            options = width_options(term)
            assert options.get("ncols", 0) > 0 and options.get("nrows", 0) > 0, options
            bar = tqdm(total=3, file=term, mininterval=0, **options)
            bar.update(1)
            term.flush()
            midway = _drawn(master)
            bar.update(2)
            bar.close()
            term.flush()
            end = _drawn(master)
    finally:
        os.close(master)
        os.close(slave)
    assert "1/3" in midway and "3/3" in end, (midway, end)


def test_anything_but_a_terminal_keeps_tqdm_s_own_width_and_is_written_seldom(tmp_path):
    """A log got tqdm's update ten times a second: hundreds of carriage-return lines for a job of
    seconds. It gets its first and last line, and one every LOG_INTERVAL_S between."""
    with open(tmp_path / "log", "w") as f:
        options = width_options(f)
        assert options == {"dynamic_ncols": True, "mininterval": LOG_INTERVAL_S}
        bar = tqdm(total=200, file=f, **options)
        for _ in range(200):
            bar.update(1)
            time.sleep(0.001)
        bar.close()
    assert (tmp_path / "log").read_text().count("\r") <= 3
