"""A generation's engine deltas as text.

This covers what each step adds, stop strings, the collected whole, and interleaving
several choices.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Collection, Sequence
from dataclasses import dataclass, field

from common.messages import TokenLogprobs
from gateway.errors import bad_request, engine_unavailable
from gateway.observability.metrics import RequestTimer
from gateway.routing.engine_pool import FailoverGeneration
from gateway.text.detokenizer import IncrementalDetokenizer


@dataclass
class Output:
    """New text and token ids of one step, or of the whole generation."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # with the first output
    stop_reason: int | str | None = None  # vLLM: the stop token id or string that ended it


class StopStrings:
    """Finds stop strings in streamed text.

    Text that might be the start of a stop string is held back until the next step
    decides. The text ends before the earliest stop string found. With `include`, which is
    vLLM's include_stop_str_in_output, it ends after that stop string.
    """

    def __init__(self, stops: Sequence[str], include: bool = False) -> None:
        self._stops = list(stops)
        self._longest = max(map(len, stops))
        self._include = include
        self._held = ""
        self._dead = 0  # leading characters of `_held` that no stop string may end in

    def feed(self, text: str, armed: bool = True) -> tuple[str, str | None]:
        """Return the text that is safe to emit, and the stop string found, if any.

        Once a stop string is found, nothing follows. Unarmed text is the text of the first
        min_tokens tokens, as in vLLM. No stop string may end in it, though one that ends
        in later text may start in it.
        """
        text = self._held + text
        dead = self._dead if armed else len(text)
        hits = [(i, stop) for stop in self._stops
                if (i := text.find(stop, max(0, dead - len(stop) + 1))) >= 0] if armed else []
        if hits:
            self._held, self._dead = "", 0
            start, stop = min(hits, key=lambda hit: hit[0])  # the first listed on a tie
            return text[:start + len(stop) if self._include else start], stop
        keep = self._partial_suffix(text)
        self._held = text[len(text) - keep:]
        self._dead = max(0, dead - (len(text) - keep))
        return text[:len(text) - keep], None

    def flush(self) -> str:
        """Return the held-back text at the end of the generation.

        It was not a stop string after all.
        """
        held, self._held = self._held, ""
        return held

    def _partial_suffix(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        for k in range(min(len(text), self._longest - 1), 0, -1):
            if any(stop.startswith(text[-k:]) for stop in self._stops):
                return k
        return 0


async def outputs(generation: FailoverGeneration, detokenizer: IncrementalDetokenizer,
                  stop_token_ids: Collection[int], stops: StopStrings | None,
                  timer: RequestTimer, min_tokens: int = 0, keep_stop_token: bool = False,
                  reason_ids: Collection[int] = ()) -> AsyncIterator[Output]:
    """Yield one `Output` per engine delta. The last one carries the finish reason.

    A stop string ends the output early and aborts the engine request. As in vLLM, it must
    end in the text of a token after the first `min_tokens`. With `keep_stop_token`, which
    is include_stop_str_in_output, a stop token's text stays in the text. `reason_ids`
    are the stop token ids that become the `stop_reason` when they end the output. As in
    vLLM, they are the request's own stop ids and, unless EOS is ignored, EOS ids.
    """
    generated = 0
    async for delta in generation:
        before, generated = generated, generated + len(delta.token_ids)
        timer.on_delta(delta, generation.arrived)
        if delta.finish_reason == "error":
            if delta.retryable:
                raise engine_unavailable(delta.error or "the engine failed the request")
            raise bad_request(delta.error or "The engine rejected the request.")
        text_ids = delta.token_ids
        if delta.finish_reason == "stop" and text_ids and text_ids[-1] in stop_token_ids \
                and not keep_stop_token:
            # Like vLLM, the stop token is reported in token ids but not in the text.
            text_ids = text_ids[:-1]
        protected = max(0, min(len(text_ids), min_tokens - before))  # within min_tokens
        text = ""
        # Past min_tokens nothing is protected, so this per-token path is skipped.
        if protected:
            text = detokenizer.add(text_ids[:protected])
            if stops is not None:
                text = stops.feed(text, armed=False)[0]  # unarmed text never ends a stop
        tail = detokenizer.add(text_ids[protected:])
        if delta.finish_reason is not None:
            tail += detokenizer.flush()
        reason = delta.finish_reason
        stop_reason = delta.token_ids[-1] if reason == "stop" and delta.token_ids \
            and delta.token_ids[-1] in reason_ids else None
        if stops is None:
            text += tail
        else:
            tail, hit = stops.feed(tail, armed=generated > min_tokens)
            text += tail
            if hit is not None:
                timer.finish("stop", generation.arrived)
                # Abort now, so that the request's other choices may run on.
                await generation.aclose()
                yield Output(text, list(delta.token_ids), "stop", list(delta.logprobs or ()),
                             delta.prompt_logprobs, hit)
                return
            if reason is not None:
                text += stops.flush()
        yield Output(text, list(delta.token_ids), reason, list(delta.logprobs or ()),
                     delta.prompt_logprobs, stop_reason)


async def collect(steps: AsyncIterator[Output]) -> Output:
    """The whole generation as one `Output`."""
    whole = Output("", [])
    texts: list[str] = []
    async for step in steps:
        texts.append(step.text)
        whole.token_ids += step.token_ids
        whole.logprobs += step.logprobs
        whole.prompt_logprobs = whole.prompt_logprobs or step.prompt_logprobs
        whole.finish_reason, whole.stop_reason = step.finish_reason, step.stop_reason
    whole.text = "".join(texts)
    return whole


async def interleave(streams: Sequence[AsyncIterator[Output]]
                     ) -> AsyncIterator[tuple[int, Output]]:
    """Yield (choice index, output) pairs from several choices, in the order they arrive."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(anext(s)): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for future in sorted(done, key=pending.__getitem__):
                index = pending.pop(future)
                try:
                    out = future.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(streams[index]))] = index
                yield index, out
    finally:
        for future in pending:
            future.cancel()
