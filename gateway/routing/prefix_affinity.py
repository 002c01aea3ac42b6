"""Which attention group a request goes to.

A request goes to the group whose prefix cache most likely holds the start of its prompt,
unless that group is busier than the least busy group by more than `balance` requests.
Otherwise it goes to the least busy group. This is a simplified form of SGLang's
cache-aware routing.

Each group's recent prompts are remembered by the prefix cache's chain keys of their whole
blocks, from `common.prefix_keys.chain_keys`, where each span is one block. A group keeps at
most as many keys as it has KV blocks, and the least recently sent are forgotten first.
This is a guess at what that group's prefix cache holds, made without asking it. The
group's own eviction differs.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from common.prefix_keys import chain_keys

POLICIES = ("prefix-affinity", "least-busy")


def block_keys(token_ids: Sequence[int], block_size: int, salt: str | None) -> list[bytes]:
    """The chain key of each whole block of `token_ids`. The cache salt goes into the first."""
    return chain_keys(token_ids, block_size, salt, [], len(token_ids) // block_size)


class PrefixAffinity:
    """The blocks each of `num_groups` groups was last sent, and the choice of a group."""

    def __init__(self, num_groups: int, balance: int) -> None:
        self.balance = balance
        self._sent: list[OrderedDict[bytes, None]] = [OrderedDict()
                                                       for _ in range(num_groups)]

    def choose(self, keys: list[bytes], loads: dict[int, int], capacity: int) -> int:
        """Choose the group for a prompt with block `keys`, and remember the keys there.

        `loads` maps each connected group to its requests in flight. A group remembers at
        most `capacity` blocks.
        """
        least = min(loads, key=loads.__getitem__)
        near = [g for g in loads if loads[g] <= loads[least] + self.balance]
        matched = {g: self._matched(g, keys) for g in near}
        best = max(near, key=lambda g: (matched[g], -loads[g]))  # the first group wins a tie
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
