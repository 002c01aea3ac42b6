"""A checkpoint's tokenizer and chat template, rendered the way transformers renders them."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.errors import bad_request

_SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)

NO_TOKENIZER_MESSAGE = (
    "The model has no tokenizer (no tokenizer.json in its checkpoint), so text prompts and chat "
    "cannot be used; send token ids instead: /v1/completions with `prompt` as a list of integers."
)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json stores special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_templates(config: dict[str, Any], model_dir: Path) -> dict[str, str]:
    """The checkpoint's chat templates by name, as transformers reads them.

    Template files take precedence over the `chat_template` in tokenizer_config.json. The
    files are `chat_template.jinja`, which is the default, and
    `additional_chat_templates/NAME.jinja`. The config's `chat_template` holds one
    template, or a list of named ones.
    """
    files = {"default": model_dir / "chat_template.jinja",
             **{path.stem: path for path in (model_dir / "additional_chat_templates")
                .glob("*.jinja")}}
    found = {name: path.read_text(encoding="utf-8") for name, path in files.items()
             if path.is_file()}
    if found:
        return found
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template
                if isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {"default": template} if isinstance(template, str) else {}


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which changes the prompt the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


class _GenerationTag(jinja2.ext.Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (assistant-mask markup) as a no-op."""

    tags = {"generation"}  # noqa: RUF012  jinja reads this class attribute

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment transformers' `apply_chat_template` uses."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template."""

    def __init__(self, backend: tokenizers.Tokenizer, config: dict[str, Any],
                 chat_templates: dict[str, str]) -> None:
        self.backend = backend
        self.special_tokens = {
            name: text for name in _SPECIAL_TOKEN_NAMES
            if (text := _token_text(config.get(name))) is not None
        }
        self._templates = {name: compile_chat_template(source)
                           for name, source in chat_templates.items()}

    def _template(self, tools: object) -> jinja2.Template:
        """The template that transformers, and so vLLM, picks.

        That is "tool_use" when tools are given and the checkpoint has a template of that
        name, and the default otherwise.
        """
        if tools is not None and "tool_use" in self._templates:
            return self._templates["tool_use"]
        if "default" in self._templates:
            return self._templates["default"]
        if not self._templates:
            raise bad_request("The model's tokenizer has no chat template; use "
                              "/v1/completions.")
        raise bad_request("The model has several chat templates and none is the default: "
                          f"{', '.join(sorted(self._templates))}.")

    @property
    def eos_token_id(self) -> int | None:
        """The id of tokenizer_config.json's `eos_token`, if it names one."""
        text = self.special_tokens.get("eos_token")
        return None if text is None else self.backend.token_to_id(text)

    @classmethod
    def load(cls, model_dir: Path) -> Tokenizer | None:
        """The checkpoint's tokenizer, or None when it ships no tokenizer.json."""
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            return None
        config_file = model_dir / "tokenizer_config.json"
        config = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}
        return cls(tokenizers.Tokenizer.from_file(str(path)), config,
                   _chat_templates(config, model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids for `text`."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text for `token_ids`."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def render_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False) -> str:
        """The prompt text for a conversation.

        By default the text ends with the assistant's generation prompt. `template_kwargs`
        are the template's own variables, such as Qwen3's `enable_thinking`, as in
        transformers' `apply_chat_template(**kwargs)`. With `continue_final_message`, the
        text ends where the last message's content ends, so the reply continues it. This
        is the option of that name in transformers and vLLM.
        """
        template = self._template((template_kwargs or {}).get("tools"))
        try:
            text = template.render(**{
                **self.special_tokens, "tools": None, "documents": None,
                "add_generation_prompt": add_generation_prompt, **(template_kwargs or {}),
                "messages": messages})
        # The template is foreign code. Whatever it raises is about these messages.
        except Exception as exc:
            raise bad_request(f"Chat template error: {exc}", "messages") from exc
        return _cut_after_final(text, messages) if continue_final_message else text

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None,
                    continue_final_message: bool = False, add_special_tokens: bool = False
                    ) -> list[int]:
        """Prompt token ids for a conversation.

        The template already wrote any special tokens, so the tokenizer adds none unless
        asked to.
        """
        return self.encode(self.render_chat(messages, add_generation_prompt, template_kwargs,
                                            continue_final_message), add_special_tokens)


def _cut_after_final(text: str, messages: list[dict[str, Any]]) -> str:
    """`text` up to the end of the last message's content, as transformers cuts it.

    For templates that strip contents, the stripped content is matched.
    """
    final = messages[-1].get("content") or ""
    if not final:  # as in transformers, with nothing to continue keep the whole text
        return text
    for content in (final, final.strip()):
        if content and (at := text.rfind(content)) >= 0:
            return text[:at + len(content)]
    raise bad_request("continue_final_message needs a last message whose content the chat "
                      "template writes out.", "messages")
