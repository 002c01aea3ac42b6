"""Which attention group a request goes to: the one whose prefix cache most likely holds
the start of its prompt, unless that one is busier than the least busy group by more than
`balance` requests; else the least busy (SGLang's cache-aware routing, simplified).

Each group's recent prompts are remembered by the prefix cache's chain keys of their whole
blocks (`common.prefix_keys.chain_keys`, a block a span), at most
as many as the group has KV blocks, the least recently sent forgotten first: a guess at
what that group's prefix cache holds, made without asking it (its own eviction differs).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.prefix_keys import chain_keys

POLICIES = ("prefix-affinity", "least-busy")


def block_keys(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
    """The chain key of each whole block of `token_ids` (the cache salt in the first)."""
    return chain_keys(token_ids, block_size, salt, [], len(token_ids) // block_size)


class PrefixAffinity:
    """The blocks each of `num_groups` groups was last sent, and the choice of a group."""

    def __init__(self, num_groups: int, balance: int) -> None:
        self.balance = balance
        self._sent: list[OrderedDict[bytes, None]] = [OrderedDict()
                                                       for _ in range(num_groups)]

    def choose(self, keys: list[bytes], loads: dict[int, int], capacity: int) -> int:
        """The group for a prompt of block `keys`, among the connected groups `loads`
        (group -> requests in flight), remembered there (at most `capacity` blocks)."""
        least = min(loads, key=loads.__getitem__)
        near = [g for g in loads if loads[g] <= loads[least] + self.balance]
        matched = {g: self._matched(g, keys) for g in near}
        best = max(near, key=lambda g: (matched[g], -loads[g]))  # the first of equals
        chosen = best if matched[best] else least
        sent = self._sent[chosen]
        for key in keys:
            sent[key] = None
            sent.move_to_end(key)
        while len(sent) > capacity:
            sent.popitem(last=False)
        return chosen

    def _matched(self, group: int, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, were sent to `group`."""
        sent, n = self._sent[group], 0
        while n < len(keys) and keys[n] in sent:
            n += 1
        return n
