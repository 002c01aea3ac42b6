"""From an OpenAI request to the engine's `SamplingParams`, with vLLM's length rules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from common.messages import SamplingParams
from gateway.api.protocol import ChatCompletionRequest, SamplingFields
from gateway.errors import bad_request
from gateway.generation_config import NEUTRAL, SamplingDefaults


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts: context length and vocabulary size."""

    max_model_len: int
    vocab_size: int


def check_prompt(prompt_token_ids: Sequence[int], limits: ModelLimits) -> None:
    """Reject prompts the engine could not run: empty, out-of-vocabulary, or too long."""
    if not prompt_token_ids:
        raise bad_request("The prompt is empty.", "prompt")
    if (bad := max(prompt_token_ids)) >= limits.vocab_size:
        raise bad_request(f"Token id {bad} is out of vocabulary (size {limits.vocab_size}).",
                          "prompt")
    if len(prompt_token_ids) >= limits.max_model_len:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, "
            f"your request has {len(prompt_token_ids)} input tokens. Please reduce the length "
            "of the input messages."
        )


COMPLETION_MAX_TOKENS = 16  # /v1/completions without max_tokens (OpenAI, vLLM)


def _max_tokens(request: SamplingFields, prompt_len: int, limits: ModelLimits) -> int:
    """The completion budget.

    It is what the request asks for. Without a value, like vLLM, chat gets whatever
    context the prompt leaves, and text completions get at most 16 tokens, which is
    OpenAI's legacy default.
    """
    asked = request.max_tokens
    chat = isinstance(request, ChatCompletionRequest)
    if chat and request.max_completion_tokens is not None:
        asked = request.max_completion_tokens
    room = limits.max_model_len - prompt_len
    if asked == 0:  # `echo` alone: one token is generated and left out (vLLM)
        return 1
    if asked is None:
        return room if chat else min(COMPLETION_MAX_TOKENS, room)
    if asked > room:
        raise bad_request(
            f"'max_tokens' or 'max_completion_tokens' is too large: {asked}. This model's "
            f"maximum context length is {limits.max_model_len} tokens and your request has "
            f"{prompt_len} input tokens ({asked} > {limits.max_model_len} - {prompt_len}).",
            "max_tokens",
        )
    return asked


def sampling_params(request: SamplingFields, prompt_token_ids: Sequence[int],
                    limits: ModelLimits, defaults: SamplingDefaults = NEUTRAL
                    ) -> SamplingParams:
    """Validate the request against the model and build the engine's sampling parameters.

    What the request leaves out comes from `defaults`, which hold the model's generation
    config. Where those have no value either, the neutral value is used.
    """
    check_prompt(prompt_token_ids, limits)
    stop_ids = _in_vocabulary(request.stop_token_ids, limits.vocab_size, "stop_token_ids")
    max_tokens = _max_tokens(request, len(prompt_token_ids), limits)
    if defaults.max_tokens is not None:  # the model's max_new_tokens caps every request
        max_tokens = min(max_tokens, defaults.max_tokens)
    top_k = _given(request.top_k, defaults.top_k, 0)
    if request.min_tokens > max_tokens:
        raise bad_request(f"min_tokens must be less than or equal to max_tokens={max_tokens}, "
                          f"got {request.min_tokens}.", "min_tokens")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=_given(request.temperature, defaults.temperature, 1.0),
        top_p=_given(request.top_p, defaults.top_p, 1.0),
        # k at or above the vocabulary size filters nothing, as 0 and -1 do. Sending 0
        # instead also keeps the value small enough for the wire.
        top_k=top_k if 0 < top_k < limits.vocab_size else 0,
        min_p=_given(request.min_p, defaults.min_p, 0.0),
        seed=None if request.seed is None else request.seed % 2**63,
        stop_token_ids=stop_ids,
        ignore_eos=request.ignore_eos,
        presence_penalty=request.presence_penalty or 0.0,
        frequency_penalty=request.frequency_penalty or 0.0,
        repetition_penalty=_given(request.repetition_penalty, defaults.repetition_penalty,
                                  1.0),
        logprobs=request.num_logprobs,
        min_tokens=request.min_tokens,
        prompt_logprobs=request.num_prompt_logprobs,
        logit_bias=_logit_bias(request.logit_bias, limits.vocab_size),
        allowed_token_ids=_in_vocabulary(request.allowed_token_ids, limits.vocab_size,
                                         "allowed_token_ids"),
        grammar=request.grammar(),
    )


def _logit_bias(asked: dict[str, float] | None, vocab: int) -> tuple[tuple[int, float], ...]:
    """Turn OpenAI's {"token id": bias} into (id, bias) pairs, one per id."""
    bias: dict[int, float] = {}
    for key, value in (asked or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys are token ids, not {key!r}.",
                              "logit_bias") from None
        bias[_in_vocabulary([token], vocab, "logit_bias")[0]] = value
    return tuple(bias.items())


def _in_vocabulary(ids: list[int] | None, vocab: int, param: str) -> tuple[int, ...]:
    if ids and (bad := max(ids)) >= vocab:
        raise bad_request(f"Token id {bad} in {param} is out of vocabulary (size {vocab}).",
                          param)
    if ids and min(ids) < 0:
        raise bad_request(f"Token id {min(ids)} in {param} is negative.", param)
    return tuple(ids or ())


Number = TypeVar("Number", int, float)


def _given(asked: Number | None, default: Number | None, neutral: Number) -> Number:
    """The request's value, else the model's default, else the neutral one."""
    return asked if asked is not None else default if default is not None else neutral
