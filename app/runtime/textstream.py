"""Turns one request's generated token pieces into final text: UTF-8 safe, with stop strings held back.

A stream must equal the non-streamed result, so text that could still be the beginning of a stop string is
held until it is ruled out, and the stop string itself never reaches the client. Pure logic, no engine.
"""

from __future__ import annotations

import codecs
from dataclasses import dataclass


@dataclass
class StopHit:
    word: str


class StopFilter:
    """Releases text once no stop string can start inside it; detects the first complete stop string."""

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.hit: StopHit | None = None

    def push(self, text: str) -> str:
        """Add decoded text; return what is now safe to send (possibly "")."""
        if self.hit is not None:
            return ""
        if not self._stops:
            return text
        buf = self._held + text
        first = self._first_complete(buf)
        if first is not None:
            pos, word = first
            self.hit = StopHit(word)
            self._held = ""
            return buf[:pos]
        keep = self._partial_suffix_len(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep]

    def flush(self) -> str:
        """End of generation: held text was not a stop string after all."""
        out, self._held = self._held, ""
        return "" if self.hit is not None else out

    def _first_complete(self, buf: str) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for s in self._stops:
            pos = buf.find(s)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, s)
        return best

    def _partial_suffix_len(self, buf: str) -> int:
        # Longest suffix of buf that is a proper prefix of some stop string: that much must wait.
        longest = 0
        for s in self._stops:
            for n in range(min(len(s) - 1, len(buf)), longest, -1):
                if buf.endswith(s[:n]):
                    longest = n
                    break
        return longest


class Utf8Assembler:
    """Joins raw token bytes into text, releasing only complete UTF-8 characters."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, piece: bytes) -> str:
        return self._dec.decode(piece)

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class TextStream:
    """Per-request text state: token pieces in, safe text deltas out, stop detection."""

    def __init__(self, stops: list[str]):
        self._utf8 = Utf8Assembler()
        self._stop = StopFilter(stops)

    @property
    def stopped(self) -> StopHit | None:
        return self._stop.hit

    def push(self, piece: bytes) -> str:
        return self._stop.push(self._utf8.push(piece))

    def finish(self) -> str:
        tail = self._stop.push(self._utf8.flush())
        return tail + self._stop.flush()
