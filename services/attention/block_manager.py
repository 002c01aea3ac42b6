"""Paged KV cache bookkeeping: fixed-size blocks on each rank, reference counts, a free
queue, per-sequence block tables, and, optionally, the prefix cache over them.

A sequence's table on rank r, `seq.block_tables[r]`, covers the tokens that rank r holds of
it, as `dcp.sharding.Sharding` assigns them. Without DCP there is one rank, holding every
token. The table's i-th block holds the rank's local token indices
[i * block_size, (i + 1) * block_size), at slot `block * block_size + offset` of that rank's
cache.

With prefix caching, a sequence's full spans are kept in `prefix_cache` and shared by later
sequences that start with the same tokens. A block is free when no sequence holds it, and a
free block that is cached stays cached until it is handed out again. As in vLLM, the free
queue hands out plain blocks first, then cached ones, least recently freed first. Of one
sequence's blocks, the later ones go first, because more prefixes share the earlier ones.
"""

from __future__ import annotations

from collections import OrderedDict

from common.prefix_keys import chain_keys
from dcp.sharding import ONE_RANK, Sharding
from services.attention.prefix_cache import CachedPrefix, PrefixCache, span_tokens
from services.attention.sequence import Sequence

NOTHING_CACHED = CachedPrefix()


class BlockManager:
    """Hands out KV blocks of `block_size` token slots, `blocks_per_rank` on each rank."""

    def __init__(self, blocks_per_rank: int, block_size: int,
                 sharding: Sharding = ONE_RANK, prefix_caching: bool = False) -> None:
        if blocks_per_rank < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got "
                             f"{blocks_per_rank}x{block_size}")
        self.sharding = sharding
        self.block_size = block_size
        self.blocks_per_rank = blocks_per_rank
        self.num_blocks = blocks_per_rank * sharding.size
        self._refs = [[0] * blocks_per_rank for _ in range(sharding.size)]
        # free blocks per rank, handed out from the front
        self._free = [OrderedDict.fromkeys(range(blocks_per_rank))
                      for _ in range(sharding.size)]
        self.prefix_cache = PrefixCache(sharding.size) if prefix_caching else None
        self.span = span_tokens(block_size, sharding)  # W tokens
        self._span_blocks = self.span // sharding.size // block_size  # m blocks per rank

    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self._free))

    def free_blocks(self, rank: int) -> int:
        return len(self._free[rank])

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int,
                      cached: CachedPrefix = NOTHING_CACHED) -> list[int]:
        """Free blocks each rank must give so that seq, after taking `cached`, holds KV for
        `num_new_tokens` more tokens. These are new blocks, and cached ones that no sequence
        holds."""
        total = max(seq.num_computed_tokens, cached.num_tokens) + num_new_tokens
        tables = seq.block_tables or [[]] * self.sharding.size
        found = cached.tables or ((),) * self.sharding.size
        return [max(0, self._blocks_for(r, total) - len(table) - len(blocks))
                + sum(self._refs[r][b] == 0 for b in blocks)
                for r, (table, blocks) in enumerate(zip(tables, found, strict=True))]

    def can_allocate(self, seq: Sequence, num_new_tokens: int,
                     cached: CachedPrefix = NOTHING_CACHED) -> bool:
        return all(n <= len(free) for n, free in
                   zip(self.blocks_needed(seq, num_new_tokens, cached), self._free, strict=True))

    def allocate(self, seq: Sequence, num_new_tokens: int,
                 cached: CachedPrefix = NOTHING_CACHED) -> None:
        """Give seq the blocks for `num_new_tokens` more tokens.

        A sequence that holds no blocks first takes the blocks of `cached`. Their KV then
        counts as computed. The first time, the prompt tokens among them are the request's
        `num_cached_tokens`.
        """
        if not self.can_allocate(seq, num_new_tokens, cached):
            raise RuntimeError(f"out of KV blocks: need "
                               f"{self.blocks_needed(seq, num_new_tokens, cached)} per rank")
        if not seq.block_tables:
            seq.block_tables = [[] for _ in range(self.sharding.size)]
            if self.prefix_cache is not None and seq.num_cached_tokens is None:
                seq.num_cached_tokens = min(cached.num_tokens, seq.num_prompt_tokens)
        for r, blocks in enumerate(cached.tables):
            for b in blocks:
                if self._refs[r][b] == 0:
                    del self._free[r][b]
                self._refs[r][b] += 1
            seq.block_tables[r].extend(blocks)
        if cached.num_tokens:
            seq.num_computed_tokens = cached.num_tokens
            seq.num_cached_spans = cached.num_tokens // self.span
        total = seq.num_computed_tokens + num_new_tokens
        for r, table in enumerate(seq.block_tables):
            for _ in range(self._blocks_for(r, total) - len(table)):
                table.append(self._take(r))

    def _blocks_for(self, rank: int, num_tokens: int) -> int:
        """Blocks rank `rank` needs for its share of a sequence's first `num_tokens`."""
        return -(-self.sharding.num_owned(rank, num_tokens) // self.block_size)

    def _take(self, rank: int) -> int:
        block, _ = self._free[rank].popitem(last=False)
        if self.prefix_cache is not None:
            self.prefix_cache.evict(rank, block)
        self._refs[rank][block] = 1
        return block

    def free(self, seq: Sequence) -> None:
        """Give back seq's blocks. A sequence never allocated, still queued or preempted,
        holds none. Cached blocks join the back of the free queue, later blocks first."""
        for r, table in enumerate(seq.block_tables):
            refs, free = self._refs[r], self._free[r]
            for b in reversed(table):
                refs[b] -= 1
                if refs[b] == 0:
                    free[b] = None
                    if self.prefix_cache is None or not self.prefix_cache.holds(r, b):
                        free.move_to_end(b, last=False)  # nothing to keep: hand out first
        seq.block_tables = []
        seq.num_cached_spans = 0

    def lookup(self, seq: Sequence) -> CachedPrefix:
        """The longest run of seq's first spans that the cache holds, within
        `seq.num_reusable_tokens`. A sequence that holds blocks already finds nothing."""
        if self.prefix_cache is None or seq.block_tables:
            return NOTHING_CACHED
        num_spans = seq.num_reusable_tokens // self.span
        keys = chain_keys(seq.token_ids, self.span, seq.cache_salt, seq.span_keys, num_spans)
        tables: list[list[int]] = [[] for _ in range(self.sharding.size)]
        found = 0
        for key in keys[:num_spans]:
            blocks = self.prefix_cache.get(key)
            if blocks is None:
                break
            for table, b in zip(tables, blocks, strict=True):
                table.extend(b)
            found += 1
        if not found:
            return NOTHING_CACHED
        return CachedPrefix(found * self.span, tuple(map(tuple, tables)))

    def cache_computed(self, seq: Sequence) -> None:
        """After a step, cache seq's spans whose every token's KV is now computed."""
        done = seq.num_computed_tokens // self.span
        if self.prefix_cache is None or done <= seq.num_cached_spans:  # most steps
            return
        keys = chain_keys(seq.token_ids, self.span, seq.cache_salt, seq.span_keys, done)
        m = self._span_blocks
        for s in range(seq.num_cached_spans, done):
            self.prefix_cache.add(keys[s], tuple(tuple(t[s * m:(s + 1) * m])
                                                 for t in seq.block_tables))
        seq.num_cached_spans = done
