"""TextStream: a generated text handed out piece by piece as its tokens come, never taking
back what it handed out.

Text that may still change is held back: an incomplete UTF-8 character (decoded as a trailing
U+FFFD until its last byte's token comes) and, where stop strings are set, as many characters
as the longest of them less one (a stop string that completes is cut from the output). The
finished output's text then gives what was held back (`finish`)."""
from __future__ import annotations

import logging
from typing import Callable, Sequence

log = logging.getLogger("batchprompt")


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stop: Sequence[str] = ()):
        self._decode = decode
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._ids: list[int] = []
        self.sent = ""

    def push(self, ids: Sequence[int]) -> str:
        """The new text that `ids` (the tokens made since the last push) make certain ("" if none)."""
        self._ids.extend(ids)
        # The incomplete character first, then the stop strings' hold-back: the other order counted
        # a half-made emoji's U+FFFD among the held-back characters and sent the stop string's first.
        complete = self._decode(self._ids).rstrip("\ufffd")
        # Not below 0: a text shorter than the hold-back sliced from its end ("abc"[:-1]), and a stop
        # string longer than the text so far had its first characters sent.
        ready = complete[:max(0, len(complete) - self._hold)] if self._hold else complete
        if len(ready) <= len(self.sent) or not ready.startswith(self.sent):
            return ""
        piece, self.sent = ready[len(self.sent):], ready
        return piece

    def finish(self, text: str) -> str:
        """What of the finished output's `text` was not handed out yet."""
        if not text.startswith(self.sent):  # the hold-back above prevents it; never send twice
            log.warning("a streamed output's final text differs from what was sent (%r, then %r)",
                        self.sent[-20:], text[len(self.sent) - 20:len(self.sent)])
        piece = text[len(self.sent):]
        self.sent += piece
        return piece
