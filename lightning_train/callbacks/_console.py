"""Lines for a person at the console that never end up glued onto a progress bar's line."""

from __future__ import annotations

import sys

from tqdm import tqdm

from lightning_train._compat import open_tqdm_bars


def print_line(text: str) -> None:
    """Print ``text`` (one or more lines) on stdout, on lines of its own.

    While a tqdm bar is drawn (Lightning's bar writes to stdout without a newline) the bar is cleared,
    the text printed and the bar drawn again below it (``tqdm.write``); otherwise a plain print."""
    tqdm.write(text, file=sys.stdout)
    sys.stdout.flush()


def close_progress_bars(leave: bool = True) -> None:
    """End every open tqdm bar, leaving its last state on screen (``leave``) or clearing it, so that
    what follows starts on a new line. Lightning closes its bars when training ends normally, but not
    when it ends by an exception (a preemption, Ctrl-C, an abort)."""
    for bar in open_tqdm_bars():
        bar.leave = leave
        bar.close()
