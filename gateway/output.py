"""A generation's engine deltas as text: what each step adds, and the collected whole."""

from __future__ import annotations

from collections.abc import AsyncIterator, Collection
from dataclasses import dataclass

from gateway.detokenizer import IncrementalDetokenizer
from gateway.engine_client import Generation
from gateway.errors import bad_request


@dataclass
class Output:
    """New text and token ids of one step (or of the whole generation)."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None


async def outputs(generation: Generation, detokenizer: IncrementalDetokenizer,
                  stop_token_ids: Collection[int]) -> AsyncIterator[Output]:
    """One `Output` per engine delta; the last carries the finish reason."""
    async for delta in generation:
        if delta.finish_reason == "error":
            raise bad_request(delta.error or "The engine rejected the request.")
        text_ids = delta.token_ids
        if delta.finish_reason == "stop" and text_ids and text_ids[-1] in stop_token_ids:
            # Like vLLM, the stop token is reported in token ids but not in the text.
            text_ids = text_ids[:-1]
        text = detokenizer.add(text_ids)
        if delta.finish_reason is not None:
            text += detokenizer.flush()
        yield Output(text, list(delta.token_ids), delta.finish_reason)


async def collect(steps: AsyncIterator[Output]) -> Output:
    """The whole generation as one `Output`."""
    texts: list[str] = []
    token_ids: list[int] = []
    finish_reason = None
    async for step in steps:
        texts.append(step.text)
        token_ids += step.token_ids
        finish_reason = step.finish_reason
    return Output("".join(texts), token_ids, finish_reason)
