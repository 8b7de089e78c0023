"""Chat templates rendered like Hugging Face: sandboxed jinja2, the HF globals, content forms, ChatML fallback."""

from __future__ import annotations

import json

import pytest

from app.server.templates import ChatTemplate, TemplateError

MSGS = [{"role": "system", "content": "sys"}, {"role": "user", "content": "hello"}]


def test_chatml_fallback():
    t = ChatTemplate(None)
    assert t.is_chatml and t.source == "chatml"
    assert t.render(MSGS) == ("<|im_start|>system\nsys<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n"
                              "<|im_start|>assistant\n")
    assert t.render(MSGS, add_generation_prompt=False).endswith("hello<|im_end|>\n")
    assert ChatTemplate("chatml").is_chatml


def test_hf_environment():
    src = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 5 %}{% break %}{% endif %}"
           "[{{ m.role }}]{{ m.content }}\n{% endfor %}{{ tools | tojson }}|{{ strftime_now('%Y') | length }}"
           "{% if add_generation_prompt %}>{% endif %}{{ eos_token }}")
    t = ChatTemplate(src, bos_token="<B>", eos_token="<E>", add_bos=False)
    out = t.render([{"role": "user", "content": "héllo"}], tools=[{"name": "ünï"}])
    assert out == '<B>[user]héllo\n' + json.dumps([{"name": "ünï"}], ensure_ascii=False) + "|4><E>"


def test_bos_is_stripped_when_the_tokenizer_adds_it():
    src = "{{ bos_token }}{{ messages[0]['content'] }}"
    assert ChatTemplate(src, bos_token="<B>", add_bos=True).render(MSGS[1:]) == "hello"
    assert ChatTemplate(src, bos_token="<B>", add_bos=False).render(MSGS[1:]) == "<B>hello"


def test_raise_exception_and_render_errors():
    t = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(TemplateError, match="roles must alternate"):
        t.render(MSGS)
    t = ChatTemplate("{{ messages[5]['content'] }}")
    with pytest.raises(TemplateError):
        t.render(MSGS)
    with pytest.raises(TemplateError, match="does not compile"):
        ChatTemplate("{% for %}")


def test_sandbox_blocks_unsafe_access():
    t = ChatTemplate("{{ messages.__class__.__mro__ }}")
    with pytest.raises(TemplateError):
        t.render(MSGS)


def test_content_forms_follow_the_template():
    string_only = ChatTemplate("{% for m in messages %}{{ m['content'] }};{% endfor %}")
    assert string_only.supports_string_content and not string_only.supports_typed_content
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert string_only.render(parts) == "a\nb;"  # parts joined for a template that only prints strings

    typed_only = ChatTemplate("{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %};"
                              "{% endfor %}")
    assert typed_only.supports_typed_content and not typed_only.supports_string_content
    assert typed_only.render([{"role": "user", "content": "xyz"}]) == "xyz;"  # wrapped into one text part
    assert typed_only.render(parts) == "ab;"


def test_non_text_parts_are_refused():
    with pytest.raises(TemplateError, match="multimodal"):
        ChatTemplate(None).render([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])


def test_kwargs_and_tool_messages_pass_through():
    src = ("{% for m in messages %}{{ m.role }}:{{ m.content }}{% if m.tool_calls %}"
           "{{ m.tool_calls[0].function.name }}{% endif %}|{% endfor %}{{ enable_thinking }}{{ custom }}")
    msgs = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "1", "tool_call_id": "c"}]
    out = ChatTemplate(src).render(msgs, kwargs={"custom": "!", "enable_thinking": False})
    assert out == "assistant:Nonef|tool:1|False!"


def test_user_message_starts_are_prefix_token_counts():
    from app.server.convert import render_chat, user_message_starts
    from app.server.schemas import ChatCompletionRequest

    tpl = ChatTemplate("chatml")
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "again"}]})
    text = render_chat(tpl, req, True)

    def tokenize(s, add_special, parse_special):  # one token per character: positions are prefix lengths
        return list(s.encode())

    starts = user_message_starts(tpl, req, True, text, tokenize)
    assert len(starts) == 2
    assert text.encode()[starts[0]:].startswith(b"<|im_start|>user\nhi")
    assert text.encode()[starts[1]:].startswith(b"<|im_start|>user\nagain")
