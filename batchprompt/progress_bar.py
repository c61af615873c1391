"""How large a progress bar is drawn. tqdm's dynamic_ncols follows the terminal as it is resized,
but a terminal that reports 0 columns and 0 lines (a pseudo-terminal made without a size:
`script`, some CI runners and containers) got no bar at all (tqdm hides a bar below the
screen's height); it then gets $COLUMNS x $LINES, else 80 x 24."""
from __future__ import annotations

import os
import shutil
import sys
from typing import IO, Any


#: How often a bar on a file that is not a terminal (a log, CI's output) is written: tqdm's 0.1 s
#: wrote hundreds of carriage-return updates into a log for a job of seconds.
LOG_INTERVAL_S = 30.0


def width_options(file: IO | None = None) -> dict[str, Any]:
    """tqdm keyword arguments for the bar on `file` (default stderr, as tqdm's): its width, and
    on a file that is not a terminal, an update every LOG_INTERVAL_S (its first and last still come)."""
    file = sys.stderr if file is None else file
    try:
        size = os.get_terminal_size(file.fileno())
    except (AttributeError, OSError, ValueError):  # not a terminal: tqdm draws its default width
        return {"dynamic_ncols": True, "mininterval": LOG_INTERVAL_S}
    if size.columns > 0 and size.lines > 0:
        return {"dynamic_ncols": True}
    fallback = shutil.get_terminal_size()
    return {"ncols": size.columns or fallback.columns or 80, "nrows": size.lines or fallback.lines or 24}
