"""Prefix-affinity routing through `switchyard serve` with two attention groups: each chat's
turns find its history in the group that holds it."""

from __future__ import annotations

import httpx
import pytest

from switchyard.serve_process import Served
from tests.support.engines import prompts, reference_greedy


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
