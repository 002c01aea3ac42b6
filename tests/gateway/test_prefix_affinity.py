"""Prefix-affinity routing over attention groups: a request goes where its prompt's first
blocks were sent, within a balance of load (through real processes:
tests/e2e/test_prefix_affinity.py)."""

from __future__ import annotations

from gateway.routing.prefix_affinity import PrefixAffinity, block_keys


def test_block_keys_chain_whole_blocks_and_the_salt() -> None:
    tokens = list(range(40))
    keys = block_keys(tokens, 16, None)
    assert len(keys) == 2 and block_keys(tokens[:31], 16, None) == keys[:1]
    assert block_keys([99, *tokens[1:]], 16, None)[1] != keys[1]  # a chain, not per block
    assert block_keys(tokens, 16, "tenant")[0] != keys[0]


def test_a_prompt_goes_where_its_prefix_went_within_the_balance() -> None:
    router = PrefixAffinity(3, balance=2)
    a, b = block_keys(list(range(40)), 16, None), block_keys(list(range(100, 140)), 16, None)
    assert router.choose(a, {0: 0, 1: 0, 2: 0}, 100) == 0  # nothing sent yet: least busy
    assert router.choose(b, {0: 1, 1: 0, 2: 0}, 100) == 1
    a_more = block_keys([*range(40), *range(200, 230)], 16, None)  # a's next turn
    assert router.choose(a_more, {0: 2, 1: 1, 2: 0}, 100) == 0  # 2 above the least: kept
    assert router.choose(a_more, {0: 3, 1: 1, 2: 0}, 100) == 2  # 3 above: the least busy
    assert router.choose(a_more, {0: 1, 1: 0, 2: 0}, 100) == 2  # equal matches: less busy
    assert router.choose(b, {1: 9, 2: 9}, 100) == 1  # group 0 not connected
    assert router.choose(block_keys(list(range(40)), 16, "s"), {0: 1, 1: 0, 2: 1}, 100) == 1
    longest = PrefixAffinity(2, balance=5)
    assert longest.choose(a, {0: 0, 1: 0}, 100) == 0
    assert longest.choose(a_more, {0: 9, 1: 0}, 100) == 1  # 0 too busy
    assert longest.choose(a_more, {0: 0, 1: 3}, 100) == 1  # 4 blocks there, 2 on the idle 0


def test_what_a_group_was_sent_is_forgotten_beyond_its_capacity() -> None:
    router = PrefixAffinity(2, balance=100)
    old, new = block_keys(list(range(48)), 16, None), block_keys(list(range(50, 98)), 16, None)
    assert router.choose(old, {0: 0, 1: 5}, 4) == 0
    assert router.choose(new, {0: 0, 1: 5}, 4) == 0  # 6 blocks sent, 4 kept: old's last 2 go
    assert router.choose(old[:1], {0: 5, 1: 0}, 4) == 1  # old's first block is gone from 0
    assert router.choose(new, {0: 5, 1: 0}, 4) == 0


