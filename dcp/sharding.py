"""Which rank of a DCP group holds the KV of which token, and the group's block tables.

Token position `p` lives on rank `(p // I) % D` (`I` the interleave, `D` the group size),
at that rank's local index `(p // (I * D)) * I + p % I`; each rank's paged cache holds only
its own tokens, so the group holds D times one rank's context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.attention.sequence import Sequence


@dataclass(frozen=True)
class Sharding:
    size: int  # D, ranks in the group
    interleave: int = 1  # I, consecutive tokens per rank before moving on

    def __post_init__(self) -> None:
        if self.size < 1 or self.interleave < 1:
            raise ValueError(f"--dcp-size and --dcp-interleave must be at least 1, got "
                             f"{self.size} and {self.interleave}")

    def owner(self, pos: torch.Tensor) -> torch.Tensor:
        """The rank holding each position's KV: int64 [T] positions -> int64 [T] ranks."""
        return (pos // self.interleave) % self.size

    def local_index(self, pos: torch.Tensor) -> torch.Tensor:
        """Index of each position among its owner's tokens of the sequence: int64 [T]
        positions -> int64 [T] indices."""
        cycle = self.interleave * self.size
        return (pos // cycle) * self.interleave + pos % self.interleave

    def num_owned(self, rank: int, length: int) -> int:
        """How many of positions [0, length) rank `rank` holds."""
        full, rest = divmod(length, self.interleave * self.size)
        return full * self.interleave + min(max(rest - rank * self.interleave, 0),
                                            self.interleave)

    def max_length(self, tokens_per_rank: int) -> int:
        """The longest sequence whose every shard fits in `tokens_per_rank` slots."""
        lo, hi = 0, tokens_per_rank * self.size + self.interleave
        while lo < hi:  # rank 0 always holds the most: the largest L with owned(0, L) <= cap
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.num_owned(0, mid) <= tokens_per_rank else (lo, mid - 1)
        return lo


class ShardedBlockManager:
    """`BlockManager`'s interface over D ranks' block pools: a sequence's table on rank r,
    `seq.shard_tables[r]`, covers the tokens rank r holds."""

    def __init__(self, blocks_per_rank: int, block_size: int, sharding: Sharding) -> None:
        if blocks_per_rank < 1 or block_size < 1:
            raise ValueError(f"need at least one block of one slot, got "
                             f"{blocks_per_rank}x{block_size}")
        self.sharding = sharding
        self.block_size = block_size
        self.blocks_per_rank = blocks_per_rank
        self.num_blocks = blocks_per_rank * sharding.size
        self._free = [list(range(blocks_per_rank - 1, -1, -1)) for _ in range(sharding.size)]

    @property
    def num_free_blocks(self) -> int:
        return sum(map(len, self._free))

    def free_blocks(self, rank: int) -> int:
        return len(self._free[rank])

    def _needed(self, seq: Sequence, num_new_tokens: int) -> list[int]:
        total = seq.num_computed_tokens + num_new_tokens
        if not seq.shard_tables:
            seq.shard_tables = [[] for _ in range(self.sharding.size)]
        return [max(0, -(-self.sharding.num_owned(r, total) // self.block_size) - len(t))
                for r, t in enumerate(seq.shard_tables)]

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        return all(n <= len(free) for n, free in zip(self._needed(seq, num_new_tokens),
                                                     self._free, strict=True))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        needed = self._needed(seq, num_new_tokens)
        if not self.can_allocate(seq, num_new_tokens):
            raise RuntimeError(f"out of KV blocks: need {needed} per rank")
        for table, free, n in zip(seq.shard_tables, self._free, needed, strict=True):
            table.extend(free.pop() for _ in range(n))

    def free(self, seq: Sequence) -> None:
        """Give back seq's blocks; one never allocated (still queued, or preempted) holds
        none."""
        if not seq.shard_tables:
            return
        for table, free in zip(seq.shard_tables, self._free, strict=True):
            free.extend(reversed(table))
        seq.shard_tables = []
