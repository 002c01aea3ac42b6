"""The last finished requests, kept so that the dashboard can list a window's slowest and
link each to its trace."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

# Requests kept: about an hour's worth at one a second, and a few seconds' at a thousand.
KEPT = 4096


@dataclass(frozen=True)
class RequestRecord:
    """One request as it ended.

    It records when the request ended, in Unix seconds, and how long it took from arrival
    to its last token. It also records its first token's latency, its output tokens, how
    its choices finished, and its trace id, 32 hex digits, if it was traced.
    """

    id: str
    ended: float
    e2e_s: float
    ttft_s: float | None
    output_tokens: int
    finish_reasons: tuple[str, ...]
    trace_id: str | None


class RequestLog:
    """A ring of the last `KEPT` finished requests."""

    def __init__(self, kept: int = KEPT) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=kept)

    def add(self, record: RequestRecord) -> None:
        self._records.append(record)

    def slowest(self, since: float, n: int) -> list[RequestRecord]:
        """The `n` longest requests that ended after `since` (Unix seconds)."""
        ended = [r for r in self._records if r.ended > since]
        return sorted(ended, key=lambda r: -r.e2e_s)[:n]
