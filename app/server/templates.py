"""Chat templates: turn OpenAI-style messages into the prompt text the model was trained on.

The template is the GGUF's `tokenizer.chat_template` (or `--chat-template[-file]`), rendered with jinja2 in a
sandbox set up the way Hugging Face transformers renders it: trim_blocks/lstrip_blocks, the loop-controls
extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and the variables
`messages`, `tools`, `add_generation_prompt`, `bos_token`, `eos_token` (plus `enable_thinking` and any
`chat_template_kwargs`, as llama-server passes them).

Without a template (or with `--chat-template chatml`) the prompt is ChatML, llama-server's fallback:
    <|im_start|>{role}\\n{content}<|im_end|>\\n ... and, with add_generation_prompt, <|im_start|>assistant\\n

Like llama-server, a rendered prompt that starts with the BOS text loses it when the tokenizer adds BOS itself,
so the prompt never carries two.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment


class TemplateError(ValueError):
    """The messages could not be rendered (the template raised, or the input is not something it accepts)."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters and forces ASCII; chat templates expect plain JSON text
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    parts = []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(p.get("text") or "" for p in content if p.get("type") == "text")
        parts.append(f"<|im_start|>{m.get('role', '')}\n{content or ''}<|im_end|>\n")
    if add_generation_prompt:
        parts.append("<|im_start|>assistant\n")
    return "".join(parts)


_PROBE = "\u2063probe\u2063"  # invisible separator: unlikely in a template, survives rendering


class ChatTemplate:
    """One compiled chat template; render() is thread-safe (jinja templates are immutable once compiled)."""

    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "", add_bos: bool = False):
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.add_bos = add_bos
        self.is_chatml = not source or not source.strip() or source.strip() == "chatml"
        self.source = "chatml" if self.is_chatml else source
        self._template: jinja2.Template | None = None
        self.supports_string_content = True
        self.supports_typed_content = True
        if not self.is_chatml:
            try:
                self._template = _environment().from_string(source)
            except jinja2.TemplateSyntaxError as e:
                raise TemplateError(f"the chat template does not compile: {e.message} (line {e.lineno})") from e
            as_string = self._probe(_PROBE)
            as_parts = self._probe([{"type": "text", "text": _PROBE}])
            self.supports_string_content = as_string is not None and _PROBE in as_string
            # a template that prints the list itself (its Python repr) does not really understand parts
            self.supports_typed_content = as_parts is not None and _PROBE in as_parts and "'type'" not in as_parts

    def _probe(self, content: Any) -> str | None:
        """The template's output for one user message with this content, None if it refuses it."""
        try:
            return self._render_raw([{"role": "user", "content": content}], add_generation_prompt=False, extra={})
        except Exception:  # any failure just means this content form is not supported
            return None

    def _render_raw(self, messages: list[dict], *, add_generation_prompt: bool, extra: dict[str, Any]) -> str:
        if self._template is None:
            return _chatml(messages, add_generation_prompt)
        ctx = {"bos_token": self.bos_token, "eos_token": self.eos_token, "enable_thinking": True}
        ctx.update(extra)
        ctx["messages"] = messages
        ctx["add_generation_prompt"] = add_generation_prompt
        return self._template.render(**ctx)

    def render(
        self,
        messages: list[dict],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Prompt text for these messages; raises TemplateError for input the template refuses."""
        extra = dict(kwargs or {})
        if tools:
            extra["tools"] = tools
        msgs = [self._normalize(m) for m in messages]
        try:
            text = self._render_raw(msgs, add_generation_prompt=add_generation_prompt, extra=extra)
        except TemplateError:
            raise
        except jinja2.TemplateError as e:
            raise TemplateError(f"the chat template failed on these messages: {e}") from e
        except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
            raise TemplateError(f"the chat template failed on these messages: {type(e).__name__}: {e}") from e
        if self.add_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token):]
        return text

    def _normalize(self, message: dict) -> dict:
        """Give the template content in a form it renders: a string, or a list of typed text parts."""
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if part.get("type") != "text":
                    raise TemplateError(
                        f"content parts of type '{part.get('type')}' are not supported: this server has no "
                        "multimodal projector loaded; send text parts only"
                    )
            if self.supports_typed_content:
                return message
            return {**message, "content": "\n".join(p.get("text") or "" for p in content)}
        if isinstance(content, str) and not self.supports_string_content and self.supports_typed_content:
            return {**message, "content": [{"type": "text", "text": content}]}
        return message
