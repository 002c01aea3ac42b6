"""What the gateway's tests share: a tiny tokenizer checkpoint, a fake engine speaking the
attention service's protocol, an SSE reader, and the tool-calling fixtures (a chat
template, two tools)."""

from __future__ import annotations

import json
import logging
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import SocketAttribute, SocketStream
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from common.auth import NO_SECRET
from common.messages import (
    AbortRequest,
    EngineInfo,
    EngineStats,
    GenerateRequest,
    InfoRequest,
    StatsRequest,
    TokenDelta,
)
from common.rpc import FrameStream, accept
from tests.support import DATA

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are helpful.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>"]
CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Grüße aus Köln: naïve café, déjà vu. 你好，世界。こんにちは。",
    "Emoji: 🚀🔥 and math ∑∫√ — “quotes” and ‘more’.",
    "system user assistant You are helpful. What is the capital of France? Paris.",
]
REPLY = "Hello, wörld! 你好 🚀 done."
# Prompt first tokens the fake engine treats as instructions (no text prompt starts with them).
REJECT = 0  # <|endoftext|>
HANG = 3  # <s>

log = logging.getLogger("fake-engine")


def train_tokenizer(add_bos: bool = False) -> Tokenizer:
    """A small byte-level BPE: multi-byte characters split across several tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    if add_bos:  # as Llama-family tokenizer.json files do
        bos = ("<s>", tokenizer.token_to_id("<s>"))
        tokenizer.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[bos]
        )
    return tokenizer


def write_checkpoint(directory: Path, template: str = CHATML, add_bos: bool = False,
                     **config: object) -> Path:
    """A model directory holding tokenizer.json and tokenizer_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    train_tokenizer(add_bos).save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": template,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": False,
                      "normalized": False, "rstrip": False, "single_word": False,
                      "special": True},
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        **config,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return directory


class FakeEngine:
    """Speaks the engine protocol over TCP with a scripted reply.

    Every request gets `reply_ids` one token per delta, then EOS (finish "stop") unless
    max_tokens runs out first or a stop token id comes first (finish "stop"). A prompt
    starting with HANG sends one token and then waits for the abort; one starting with
    REJECT is refused with an error.
    """

    def __init__(self, reply_ids: list[int], eos_id: int, max_model_len: int = 256) -> None:
        self.reply_ids = reply_ids
        self.info = EngineInfo("FakeMoE", max_model_len, 400, (eos_id,), "bf16", 16, 16)
        self.requests: list[GenerateRequest] = []
        self.warmups: list[GenerateRequest] = []
        self.aborts: list[str] = []
        self.aborted = anyio.Event()
        self.received = anyio.Event()
        self.accepting = True
        self.resets = 0  # connections still to reset at once, before the handshake
        self._refused = anyio.Event()
        self.port = 0
        self._connections: list[FrameStream] = []

    async def drop_connections(self) -> None:
        """Simulate the engine going away."""
        for frames in self._connections:
            await frames.aclose()
        self._connections.clear()

    async def _reply(self, frames: FrameStream, request: GenerateRequest) -> None:
        if request.warmup:  # the gateway's readiness check: kept apart from the requests
            self.warmups.append(request)
            await frames.send(TokenDelta(request.request_id, [self.reply_ids[0]], "length", 1))
            return
        self.requests.append(request)
        self.received.set()
        rid, sampling = request.request_id, request.sampling
        if request.prompt_token_ids[0] == REJECT:
            await frames.send(TokenDelta(rid, [], "error", error="prompt rejected by engine"))
            return
        if request.prompt_token_ids[0] == HANG:
            await frames.send(TokenDelta(rid, [self.reply_ids[0]]))
            return  # the gateway must abort it
        stops = {*self.info.eos_token_ids, *sampling.stop_token_ids}
        tokens = [*self.reply_ids, self.info.eos_token_ids[0]]
        tokens = tokens[:next(i + 1 for i, t in enumerate(tokens) if t in stops)]
        tokens = tokens[: sampling.max_tokens]
        for i, token in enumerate(tokens):
            last = i == len(tokens) - 1
            finish = ("stop" if token in stops else "length") if last else None
            await frames.send(TokenDelta(rid, [token], finish, len(request.prompt_token_ids)))

    async def _handle(self, stream: SocketStream) -> None:
        if self.resets:  # as a service stopping while the gateway connects
            self.resets -= 1
            stream.extra(SocketAttribute.raw_socket).setsockopt(
                socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await stream.aclose()
            return
        async with stream:
            if self.accepting:
                frames = await accept(stream, NO_SECRET, "the gateway", log)
                if frames is None:
                    return
                self._connections.append(frames)
                await self._serve(frames)
            else:
                refused, self._refused = self._refused, anyio.Event()
                refused.set()

    async def next_refusal(self) -> None:
        """Wait until a connection attempt is refused (while not `accepting`)."""
        await self._refused.wait()

    async def _serve(self, frames: FrameStream) -> None:
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    message = await frames.receive()
                    if isinstance(message, InfoRequest):
                        await frames.send(self.info)
                    elif isinstance(message, StatsRequest):
                        await frames.send(EngineStats(0, 0, 0, self.info.num_kv_blocks, 0, []))
                    elif isinstance(message, GenerateRequest):
                        tg.start_soon(self._reply, frames, message)
                    elif isinstance(message, AbortRequest):
                        self.aborts.append(message.request_id)
                        self.aborted.set()
        except* (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            pass  # the gateway went away, or the test dropped the connection

    @asynccontextmanager
    async def running(self) -> AsyncIterator[FakeEngine]:
        """Listen on a free local port for the duration of the block."""
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, self._handle)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()


def sse_events(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, checking the framing on the way."""
    assert body.endswith("\n\n")
    events = body.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e.removeprefix("data: ") for e in events]


QWEN3_TEMPLATE = DATA / "qwen3_chat_template.jinja"


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters


# A chat the tokenization tests send, and the OpenAI error body they check.
CHAT = [{"role": "user", "content": "What is 123 + 456?"}]


def error_of(r: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error
