"""Engine log-probabilities in the two OpenAI shapes: chat and legacy completions."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from common.messages import TokenLogprobs
from gateway.api.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
    TopLogprob,
)
from gateway.text.tokenizer import Tokenizer


def token_text(tokenizer: Tokenizer | None, token_id: int) -> str:
    """How one token reads on its own. Without a tokenizer, it is vLLM's `token_id:N`."""
    if tokenizer is None:
        return f"token_id:{token_id}"
    return tokenizer.decode([token_id], skip_special_tokens=False)


def _texts(tokenizer: Tokenizer | None) -> Callable[[int], str]:
    """`token_text`, decoding each id only once per response.

    This matters because a long prompt's top alternatives repeat the same few tokens many
    times.
    """
    cache: dict[int, str] = {}

    def text(token_id: int) -> str:
        if (known := cache.get(token_id)) is None:
            known = cache[token_id] = token_text(tokenizer, token_id)
        return known

    return text


def chat_logprobs(tokenizer: Tokenizer | None, token_ids: Sequence[int],
                  entries: Sequence[TokenLogprobs]) -> ChatLogprobs:
    name = _texts(tokenizer)

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = name(token_id)
        return TopLogprob(text, logprob, list(text.encode()))

    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = name(token_id)
        content.append(ChatTokenLogprob(
            text, entry.logprob, list(text.encode()),
            [top(i, lp) for i, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)]))
    return ChatLogprobs(content)


def completion_logprobs(tokenizer: Tokenizer | None, token_ids: Sequence[int],
                        entries: Sequence[TokenLogprobs | None], offset: int = 0
                        ) -> CompletionLogprobs:
    """Logprobs in the legacy completions shape.

    `offset` is where the first token's text starts in the choice's whole text. A None
    entry becomes null, as in vLLM. That is the entry for an echoed prompt's first token,
    which nothing predicts.
    """
    out, name = CompletionLogprobs([], [], [], []), _texts(tokenizer)
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = name(token_id)
        out.text_offset.append(offset)
        out.tokens.append(text)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry.logprob)
        # As in OpenAI and vLLM, the sampled token always comes first, then up to
        # `logprobs` alternatives.
        out.top_logprobs.append({text: entry.logprob, **{
            name(i): lp for i, lp in zip(entry.top_ids, entry.top_logprobs, strict=True)}})
    return out


def prompt_logprobs(tokenizer: Tokenizer | None, token_ids: Sequence[int],
                    entries: Sequence[TokenLogprobs | None]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`.

    For each prompt token, it maps ids to entries, for the token itself and the likeliest
    alternatives, ranked from 1. The first prompt token gets None.
    """
    out: PromptLogprobs = []
    name = _texts(tokenizer)
    for token_id, entry in zip(token_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        alternatives = zip(entry.top_ids, entry.top_logprobs, strict=True)
        out.append({str(i): PromptLogprob(lp, rank, name(i))
                    for i, lp, rank in [(token_id, entry.logprob, entry.rank),
                                        *((i, lp, r) for r, (i, lp)
                                          in enumerate(alternatives, start=1))]})
    return out
