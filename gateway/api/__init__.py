"""The OpenAI surface, with vLLM's OpenAI server as the reference.

The package holds the protocol structs (`protocol`), the handlers (`chat`, `completions`,
`tokenization`), and what the handlers share (`serving`). `serving` parses bodies and
checks their limits, holds `Admission`, and starts a request's generations.

- Requests are msgspec Structs whose constraints are the validation. `/openapi.json` is
  generated from the same structs, so it cannot drift from what the server parses.
- Structured outputs and named or "required" tool choices become one llguidance grammar
  in the gateway, built by `gateway.parsers`. Structured outputs are `response_format`,
  and vLLM's `structured_outputs` and `guided_*` fields. The grammar travels in
  `SamplingParams.grammar`, and a bad schema makes the request a 400. `sampling` turns
  the rest of a request into the engine's `SamplingParams`, which the engine applies.
- What a request leaves out comes from the model's `generation_config.json`, as with
  vLLM's `--generation-config auto`. See `gateway.generation_config`. `vllm` gives
  neutral values instead, and `DIR` reads DIR's file, for these defaults only.
- Chat requests and `/tokenize` show `tools` and `documents` to the chat template, as
  vLLM does. They also take these fields:
  - `add_generation_prompt`.
  - `continue_final_message`, which cuts the rendered prompt where the last message's
    content ends, as transformers cuts it.
  - `chat_template_kwargs`, which may set any template variable, such as Qwen3's
    `enable_thinking`, except `messages`, `chat_template` and `tokenize`.
  When tools are given, the tokenizer renders with a checkpoint's `tool_use` template,
  as transformers picks it.
- `n` > 1 fans out into `n` engine requests. Each has the id `{id}-{i}` and the seed
  seed + i. Their outputs are interleaved into one stream by `output.interleave`.
- Stop strings are found in the detokenized text by `output.StopStrings`, which holds
  back text that may start one.
"""
