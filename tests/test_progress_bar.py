"""A progress bar on a terminal that reports 0 columns and 0 lines (a pseudo-terminal made
without a size, as `script` and some CI runners make) was not drawn at all."""
from __future__ import annotations

import os
import select

from tqdm import tqdm

from batchprompt.progress_bar import width_options


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


def test_anything_but_a_terminal_keeps_tqdm_s_own_width(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert width_options(f) == {"dynamic_ncols": True}
