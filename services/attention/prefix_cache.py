"""Automatic prefix caching: full spans of KV blocks, found again by the tokens they hold.

A span is the `W = lcm(block_size, I) * D` consecutive tokens [s * W, (s + 1) * W) of a
sequence, where D is the number of ranks in a DCP group and I its interleave. Without DCP, W
is the block size. On every rank a span fills whole blocks, `m = lcm(block_size, I) /
block_size` of them: that rank's table entries [s * m, (s + 1) * m). A span's key is a chain
hash, sha256 of the previous span's key and its own tokens, so two sequences share a key
only when every token up to the span's end is the same. A request's cache salt, like vLLM's
`cache_salt`, enters the first key, so requests with different salts never share blocks.

Only spans whose every token's KV is computed are cached, and a sequence writes only past
what it computed or found, so a cached block is never written again while it is cached.

It is on by default (`--enable-prefix-caching`), as in vLLM. A sequence admitted from the
queue takes the blocks of its longest run of cached spans, shares them with whoever holds
them, and computes from there. It never takes its last token, whose row must run to sample.
It takes nothing while prompt logprobs are still to be scored, since every scored row must
run.
Handing a free cached block out forgets its span. A preempted sequence finds its own blocks
this way when it is admitted again. DCP peers hold no books: the plan's block tables already
point at the shared blocks. Each attention group has its own cache; the gateway's
prefix-affinity routing sends a chat's next turn where its history is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dcp.sharding import Sharding


def span_tokens(block_size: int, sharding: Sharding) -> int:
    """W: the tokens of one span (whole blocks on every rank)."""
    return math.lcm(block_size, sharding.interleave) * sharding.size


@dataclass(frozen=True)
class CachedPrefix:
    """A sequence's first `num_tokens` tokens, whose KV the cache holds in `tables[r]`: the
    blocks on rank r, in table order. Empty tables mean nothing was found."""

    num_tokens: int = 0
    tables: tuple[tuple[int, ...], ...] = ()


class PrefixCache:
    """Span key -> its blocks on each rank, and each cached block's span (for eviction)."""

    def __init__(self, num_ranks: int) -> None:
        self._spans: dict[bytes, tuple[tuple[int, ...], ...]] = {}
        self._span_of: list[dict[int, bytes]] = [{} for _ in range(num_ranks)]

    def __len__(self) -> int:
        return len(self._spans)

    def get(self, key: bytes) -> tuple[tuple[int, ...], ...] | None:
        return self._spans.get(key)

    def holds(self, rank: int, block: int) -> bool:
        return block in self._span_of[rank]

    def add(self, key: bytes, tables: tuple[tuple[int, ...], ...]) -> None:
        """Cache a span's blocks, unless an equal span is cached already. That happens when
        two sequences computed the same tokens in one step; the first one's blocks stay."""
        if key in self._spans:
            return
        self._spans[key] = tables
        for owner, blocks in zip(self._span_of, tables, strict=True):
            owner.update(dict.fromkeys(blocks, key))

    def evict(self, rank: int, block: int) -> None:
        """Forget the span `block` belongs to, if any, because the block is being handed
        out again. The span's other blocks, free like it, stay free as plain blocks."""
        key = self._span_of[rank].get(block)
        if key is None:
            return
        for owner, blocks in zip(self._span_of, self._spans.pop(key), strict=True):
            for b in blocks:
                del owner[b]
