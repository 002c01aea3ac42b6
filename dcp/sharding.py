"""Which rank of a DCP group holds the KV of which token. The group's block tables are in
`services.attention.block_manager`.

Token position `p` lives on rank `(p // I) % D`, where `I` is the interleave and `D` the
group size. Its local index on that rank is `(p // (I * D)) * I + p % I`. Each rank's paged
cache holds only its own tokens, so the group holds D times one rank's context.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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


ONE_RANK = Sharding(1)  # no DCP: one rank holds every key
