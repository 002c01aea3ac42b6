"""Prefix-affinity routing over attention groups: a request goes where its prompt's first
blocks were sent, within a balance of load; through real processes, the turns of two chats
each find their history in their own group's prefix cache."""

from __future__ import annotations

import httpx
import pytest

from gateway.prefix_affinity import PrefixAffinity, block_keys
from switchyard.serve_process import Served
from tests.test_engine_parity import prompts, reference_greedy


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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("policy", ["prefix-affinity", "least-busy"])
def test_each_chats_turns_find_its_history_in_its_group(qwen3_ckpt: tuple, policy: str
                                                        ) -> None:
    """Two attention groups. Chat A's first turn decodes long, so chat B's first turn goes
    to the other group; the second turns are sent B first. With prefix affinity each finds
    its whole history cached (and generates what transformers does); least busy sends B's
    to the idle first group, where its history is not."""
    path, model = qwen3_ckpt
    flags = ["--model", str(path), "--attention-groups", "2", "--dispatch-backend", "local",
             "--enable-prompt-tokens-details", "--routing-policy", policy]
    first = {"a": prompts(seed=70, lengths=(20,))[0], "b": prompts(seed=71, lengths=(20,))[0]}
    lengths = {"a": 200, "b": 8}
    with Served(flags) as served:
        url = f"{served.url}/v1/completions"
        name = httpx.get(f"{served.url}/v1/models").json()["data"][0]["id"]

        def body(prompt: list[int], n: int) -> dict:
            return {"model": name, "prompt": prompt, "max_tokens": n, "temperature": 0,
                    "ignore_eos": True, "return_token_ids": True}

        answers: dict[str, list[int]] = {}
        with httpx.Client(timeout=120) as http:
            with http.stream("POST", url, json={**body(first["a"], lengths["a"]),
                                                "stream": True}) as a:
                events = (httpx.Response(200, content=line[6:]).json()["choices"]
                          for line in a.iter_lines() if line.startswith("data: {"))
                answers["a"] = [t for choice in next(events) for t in choice["token_ids"]]
                # a runs on: b goes to the other group
                answers["b"] = http.post(url, json=body(first["b"], 8)).json()[
                    "choices"][0]["token_ids"]
                answers["a"] += [t for choices in events for choice in choices
                                 for t in choice["token_ids"]]
            cached, second = {}, {}
            for chat in ("b", "a"):
                prompt = first[chat] + answers[chat] + [7, 8, 9]
                r = http.post(url, json=body(prompt, 4)).json()
                details = r["usage"].get("prompt_tokens_details") or {}
                cached[chat] = details.get("cached_tokens", 0)
                second[chat] = (prompt, r["choices"][0]["token_ids"])
    assert len(answers["a"]) == lengths["a"]
    full = {c: (len(first[c]) + lengths[c]) // 16 * 16 for c in first}
    if policy == "prefix-affinity":
        assert cached == full
        for prompt, tokens in second.values():
            assert tokens == reference_greedy(model, prompt, 4)
    else:
        assert cached["b"] == 0 and cached["a"] == full["a"]
