"""Presenting tools to a chat template: natively where it renders them, else shoal's fallback
prompt in the hermes dialect; and the prompt ids the engine builds from either."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from shoal.engine.input_processor import InputProcessor
from shoal.tool_calls import HERMES, FunctionTool, dialect_for, render

ADD = FunctionTool("add", "Add two numbers", {"type": "object", "properties": {"a": {}}})
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": {"a": 2}}}
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Add things."},
    {"role": "assistant", "content": "", "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "5"},
    {"role": "tool", "tool_call_id": "call_2", "name": "add", "content": "7"},
    {"role": "user", "content": "Thanks."},
]
# A template that renders tools itself, in the hermes dialect (as Qwen2.5's and Qwen3's do).
NATIVE = (
    "{% if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n"
    '{"name": "{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}'
    "\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_fallback_is_plain_text_any_template_takes() -> None:
    messages, tools = render(CONVERSATION, [ADD], HERMES, native=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "user"]
    system = messages[0]["content"]
    assert system.startswith("Be brief.\n\nYou can call these tools.")
    assert '{"name": "add", "description": "Add two numbers"' in system
    assert messages[2]["content"] == "\n".join(
        [HERMES.call_text("add", {"a": 2})] * 2
    )  # both calls, in the dialect the grammar forces
    assert messages[3]["content"] == (
        "<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n</tool_response>"
    )
    assert all(set(m) == {"role", "content"} for m in messages)
    # Without tools, a conversation that used them still reads as text; nothing is added.
    again, _ = render(CONVERSATION[1:], [], HERMES, native=False)
    assert again[0] == CONVERSATION[1]


def test_a_native_template_gets_the_conversation_as_it_is() -> None:
    messages, tools = render(CONVERSATION, [ADD], HERMES, native=True)
    assert messages is CONVERSATION
    assert tools == [ADD.as_openai()]


def _inputs(model: Path, template: str | None = None) -> InputProcessor:
    tok = AutoTokenizer.from_pretrained(model)
    if template is not None:
        tok.chat_template = template
    return InputProcessor(tok, 320, 4096, 1024, 16, seeded=lambda s: None)


def test_prompt_ids_from_either_template(tiny_chat_model: Path) -> None:
    native = _inputs(tiny_chat_model, NATIVE)
    assert dialect_for(native.tokenizer.chat_template) == (HERMES, True)
    messages, tools = render(CONVERSATION, [ADD], HERMES, native=True)
    text = native.tokenizer.decode(native.apply_chat_template(messages, tools))
    assert '"name": "add", "parameters"' in text  # the tools, rendered by the template
    assert text.count('<tool_call>\n{"name": "add", "arguments": {"a": 2}}') == 2

    plain = _inputs(tiny_chat_model)  # a chatml template that knows no tools
    dialect, is_native = dialect_for(plain.tokenizer.chat_template)
    messages, tools = render(CONVERSATION, [ADD], dialect, is_native)
    text = plain.tokenizer.decode(plain.apply_chat_template(messages, tools))
    assert "You can call these tools." in text and "<tool_response>\n7" in text
