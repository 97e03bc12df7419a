"""The reasoning parser (serving/reasoning.py): a thought told apart from the answer, whole and
streamed (the same result however the text is split), detected from the chat template."""

from __future__ import annotations

import random

import pytest

from realizar_backend.serving.reasoning import (THINK, ReasoningStreamParser, detect_reasoning,
                                                split_reasoning)

# the shapes of thinking templates (written for these tests): Qwen3's generation prompt closes an
# empty thought when thinking is off; Qwen3.5's opens one unless it is off
QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}<think>\n"
              "{{ m.reasoning_content }}\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
QWEN35_LIKE = QWEN3_LIKE.replace("</think>\n\n{% endif %}{% endif %}",
                                 "</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
PLAIN = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


def streamed(text: str, cuts: list[int], inside=False, ends=()) -> tuple[str | None, str]:
    p = ReasoningStreamParser(THINK, inside, ends)
    r, c, last = [], [], 0
    for cut in [*cuts, len(text)]:
        a, b = p.feed(text[last:cut])
        r.append(a)
        c.append(b)
        last = cut
    a, b = p.finish()
    return ("".join(r) + a if p.saw_reasoning else None), "".join(c) + b


CASES = [
    # (reply, inside, ends, reasoning, content)
    ("<think>\nLet me add: 2 + 2 = 4.\n</think>\n\nThe answer is 4.", False, (),
     "Let me add: 2 + 2 = 4.", "The answer is 4."),
    ("  <think>a</think>b", False, (), "a", "b"),
    ("The answer is 4.", False, (), None, "The answer is 4."),
    ("  plain text <think>not a thought</think>", False, (), None, "  plain text <think>not a thought</think>"),
    ("<think>cut short, never closed", False, (), "cut short, never closed", ""),
    ("<think>\n\n</think>\n\nempty thought", False, (), "", "empty thought"),
    ("<thi", False, (), None, "<thi"),
    ("   ", False, (), None, "   "),
    # the prompt opened the thought
    ("I should greet.\n</think>\n\nHello!", True, (), "I should greet.", "Hello!"),
    ("still thinking <th", True, (), "still thinking <th", ""),
    ("", True, (), "", ""),
    # a tool call ends the thought without a close tag, and stays in the content
    ("I need the weather.\n<tool_call>\n{\"name\": \"w\"}\n</tool_call>", True, ("<tool_call>",),
     "I need the weather.", "<tool_call>\n{\"name\": \"w\"}\n</tool_call>"),
    ("<think>x</think>\n<tool_call>{}</tool_call>", False, ("<tool_call>",), "x", "<tool_call>{}</tool_call>"),
    ("a <b> c </think> d", True, ("<tool_call>",), "a <b> c", "d"),
]


@pytest.mark.parametrize("text,inside,ends,reasoning,content", CASES)
def test_whole_and_streamed_replies(text, inside, ends, reasoning, content):
    assert split_reasoning(THINK, text, inside, ends) == (reasoning, content)
    rng = random.Random(text)
    splits = [list(range(1, len(text)))]                                  # a character at a time
    splits += [sorted(rng.sample(range(1, len(text)), k)) for k in (1, 2, 5) for _ in range(20)
               if len(text) > k]
    for cuts in splits:
        assert streamed(text, cuts, inside, ends) == (reasoning, content), cuts


def test_streamed_thought_arrives_as_it_is_generated():
    p = ReasoningStreamParser(THINK)
    assert p.feed("<think>\nFirst") == ("First", "")
    assert p.in_reasoning
    assert p.feed(" step.") == (" step.", "")
    # a tail that may be the close tag waits; whitespace waits for more of the thought
    assert p.feed("\n</thi") == ("", "")
    assert p.feed("nk>\n\nDone") == ("", "Done")
    assert not p.in_reasoning
    assert p.feed(".") == ("", ".")
    assert p.finish() == ("", "")


def test_format_and_prompt_state_come_from_the_template():
    from realizar_backend.model.chat_template import TemplateLimits, TemplateRenderer

    assert detect_reasoning(QWEN3_LIKE) is THINK and detect_reasoning(QWEN35_LIKE) is THINK
    assert detect_reasoning(PLAIN) is None and detect_reasoning(None) is None
    renderer = TemplateRenderer(TemplateLimits(10, 1 << 20, 1024, 1))
    try:
        history = [{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
                   {"role": "user", "content": "2+2?"}]

        def opened(template, **kw):
            text = renderer.render(template, {"messages": history, "add_generation_prompt": True, **kw})
            return THINK.opened_by(text)

        # a closed thought in the history does not leave the model inside one
        assert not opened(QWEN3_LIKE)
        assert not opened(QWEN3_LIKE, enable_thinking=False)
        assert opened(QWEN35_LIKE)
        assert not opened(QWEN35_LIKE, enable_thinking=False)
    finally:
        renderer.close()


def test_tool_calls_inside_or_after_a_thought_parse():
    """A chat reply through both parsers (serving/chat.py): the thought, then calls in Qwen3.5's
    XML syntax, whether the thought closed first or the call began inside it; whole and streamed."""
    from realizar_backend.serving.chat import ChatReply, message
    from realizar_backend.serving.plans import Plan
    from realizar_backend.serving.tools import parse_tool_request
    from support.thinking_model import THINKING_TEMPLATE

    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    cases = [("<think>\nThe user wants weather.\n</think>\n\n" + call, False),
             ("The user wants weather.\n" + call, True),                 # the call began inside the thought
             ("The user wants weather.\n</think>\n\n" + call, True)]
    for text, inside in cases:
        plan = Plan([], 0, False, False, False, tools=parse_tool_request(tools, "auto", None, THINKING_TEMPLATE),
                    reasoning=THINK, thinking_inside=inside)
        msg, reason = message(plan, text, "stop")
        assert reason == "tool_calls" and msg["content"] is None
        assert msg["reasoning_content"] == msg["reasoning"] == "The user wants weather."
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
            [("get_weather", '{"city": "Oslo"}')]
        for step in (1, 3, 7):
            reply = ChatReply(plan)
            deltas = [d for k in range(0, len(text), step) for d in reply.feed(text[k:k + step])]
            deltas += reply.feed("", final=True)
            assert "".join(d.get("reasoning", "") for d in deltas) == "The user wants weather."
            args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
            assert args == '{"city": "Oslo"}' and not any(d.get("content") for d in deltas)
