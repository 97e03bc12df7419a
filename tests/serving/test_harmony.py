"""gpt-oss's harmony replies (serving/harmony.py): channels told apart, whole and streamed (the same
result however the text is split), through chat completions' ChatReply and the typed-part reader
the Responses and Messages APIs use; detection from the chat template; the tokenizer keeping the
markers visible and ending replies at <|return|> / <|call|>.

The real gpt-oss-20b tokenizer and chat template come from the twin header
shared/models/gptoss20.head.gz (found above the checkout); those tests are skipped without it."""

from __future__ import annotations

import gzip
import random
from pathlib import Path

import pytest

from realizar_backend.serving.chat import ChatReply, message
from realizar_backend.model.chat_template import is_harmony as is_harmony_template
from realizar_backend.serving.harmony import HarmonyParser
from realizar_backend.serving.plans import Plan
from realizar_backend.serving.reasoning import HARMONY, THINK, detect_reasoning
from realizar_backend.serving.replies import ReplyReader, Reply
from realizar_backend.serving.tools import HARMONY as HARMONY_TOOLS, assemble, detect_format, tool_request

# a template in harmony's shape (written for these tests; the real one is gpt-oss's, below)
MINI = ("{%- if tools %}<|start|>developer<|message|>namespace functions {"
        "{%- for t in tools %} type {{ t.function.name }} = () => any;{% endfor %} }<|end|>{% endif %}"
        "{%- for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
        "<|message|>{{ m.content }}<|end|>{% endfor %}"
        "{%- if add_generation_prompt %}<|start|>assistant{% endif %}")

WEATHER = ("get_weather", "weather of a city", {"type": "object", "properties": {"city": {"type": "string"}}})


def _req(choice="auto"):
    return tool_request([WEATHER], choice, None, True, MINI)


THOUGHT = "<|channel|>analysis<|message|>The user wants 2+2. That is 4.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>The answer is 4."
CALL = ('<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json'
        '<|message|>{"city": "Paris"}')
CALL_RECIPIENT_FIRST = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Oslo"}'

CASES = [
    # (reply, tools?, reasoning, content, calls)
    (THOUGHT + FINAL + "<|return|>", False, "The user wants 2+2. That is 4.", "The answer is 4.", []),
    (THOUGHT + FINAL, False, "The user wants 2+2. That is 4.", "The answer is 4.", []),     # the stop token is not shown
    ("<|channel|>final<|message|>Just the answer.", False, None, "Just the answer.", []),
    (THOUGHT + CALL, True, "The user wants 2+2. That is 4.", None, [("get_weather", '{"city": "Paris"}')]),
    (CALL[len("<|start|>assistant"):] + "<|call|>", True, None, None, [("get_weather", '{"city": "Paris"}')]),
    (THOUGHT + CALL_RECIPIENT_FIRST, True, "The user wants 2+2. That is 4.", None, [("get_weather", '{"city":"Oslo"}')]),
    # the reply starts right after the generation prompt's <|start|>assistant: the recipient comes first
    (' to=functions.get_weather<|channel|>commentary json<|message|>{"city":"Rome"}', True, None, None,
     [("get_weather", '{"city":"Rome"}')]),
    # a call without arguments
    ("<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>", True, None, None,
     [("get_weather", "{}")]),
    # cut short: inside the thought, inside a call's arguments, inside a header
    ("<|channel|>analysis<|message|>Still thinking abo", False, "Still thinking abo", "", []),
    (THOUGHT + CALL[:-5], True, "The user wants 2+2. That is 4.", None, [("get_weather", '{"city": "Pa')]),
    (THOUGHT + "<|start|>assistant<|channel|>fin", False, "The user wants 2+2. That is 4.", "", []),
    # plain text without channels is content, unchanged
    ("Hello there, no channels here.", False, None, "Hello there, no channels here.", []),
    ("a <b> c", False, None, "a <b> c", []),
    # a commentary preamble to the user is content; a call without tools in the request is reasoning
    ("<|channel|>commentary<|message|>Let me check.<|end|>" + FINAL, False, None, "Let me check.The answer is 4.", []),
    (THOUGHT + CALL, False, "The user wants 2+2. That is 4.{\"city\": \"Paris\"}", "", []),
    # a call to a function the request does not have is not a call
    (THOUGHT + CALL.replace("get_weather", "launch"), True, "The user wants 2+2. That is 4.{\"city\": \"Paris\"}",
     "", []),
]


def _run(text: str, cuts: list[int], tools: bool):
    p = HarmonyParser(_req() if tools else None)
    out, last = [], 0
    for cut in [*cuts, len(text)]:
        out += p.feed(text[last:cut])
        last = cut
    out += p.finish()
    for d in out:       # no marker ever reaches the user
        for v in (d.get("content", ""), d.get("reasoning", "")):
            assert "<|" not in v, d
    reasoning = "".join(d["reasoning"] for d in out if "reasoning" in d) if p.saw_reasoning else None
    content, calls = assemble([d for d in out if "reasoning" not in d])
    return reasoning, content, [(c.name, c.arguments) for c in calls], p.n_calls


@pytest.mark.parametrize("text,tools,reasoning,content,calls", CASES)
def test_whole_and_streamed_replies(text, tools, reasoning, content, calls):
    assert _run(text, [], tools) == (reasoning, content, calls, len(calls))
    rng = random.Random(text)
    splits = [list(range(1, len(text)))]                                  # a character at a time
    splits += [[k] for k in range(1, len(text))]                          # cut once, at every position
    splits += [sorted(rng.sample(range(1, len(text)), k)) for k in (2, 5) for _ in range(10) if len(text) > k]
    for cuts in splits:
        assert _run(text, cuts, tools) == (reasoning, content, calls, len(calls)), cuts


def test_arguments_stream_as_they_are_generated():
    p = HarmonyParser(_req())
    assert p.feed("<|channel|>analysis<|message|>Weather?") == [{"reasoning_content": "Weather?", "reasoning": "Weather?"}]
    assert p.feed("<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|mess") == []
    head = p.feed("age|>")
    assert head[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert p.feed('{"city": ') == [{"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}]
    assert p.feed('"Paris"}') == [{"tool_calls": [{"index": 0, "function": {"arguments": ' "Paris"}'}}]}]
    assert p.finish() == [] and p.n_calls == 1


def test_detection_comes_from_the_template():
    assert detect_reasoning(MINI) is HARMONY and detect_format(MINI) is HARMONY_TOOLS
    assert is_harmony_template(MINI) and not is_harmony_template("<think></think>")
    assert detect_reasoning("<think>{{ x }}</think>") is THINK
    # tool_choice auto leaves the reply free (its calls are parsed); a forced choice is a grammar
    assert _req("auto").constraint(None) is None


def _plan(tools: bool) -> Plan:
    return Plan([], 0, False, False, False, tools=_req() if tools else None, reasoning=HARMONY)


def test_chat_message_and_deltas():
    msg, reason = message(_plan(False), THOUGHT + FINAL, "stop")
    assert reason == "stop"
    assert msg["reasoning_content"] == msg["reasoning"] == "The user wants 2+2. That is 4."
    assert msg["content"] == "The answer is 4." and "tool_calls" not in msg
    msg, reason = message(_plan(True), THOUGHT + CALL, "stop")      # the engine stopped at <|call|>
    assert reason == "tool_calls" and msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_weather", '{"city": "Paris"}')]
    text = THOUGHT + CALL
    for step in (1, 4, 9):
        reply = ChatReply(_plan(True))
        deltas = [d for k in range(0, len(text), step) for d in reply.feed(text[k:k + step])]
        deltas += reply.feed("", final=True)
        assert reply.n_calls == 1
        assert "".join(d.get("reasoning", "") for d in deltas) == "The user wants 2+2. That is 4."
        assert not any(d.get("content") for d in deltas)


def test_typed_parts_for_responses_and_messages():
    """The Responses API's items and the Messages API's blocks come from ReplyReader's events."""
    for text, kinds in ((THOUGHT + FINAL, ["reasoning", "text"]), (THOUGHT + CALL, ["reasoning", "call"])):
        for step in (len(text), 1, 5):
            r = ReplyReader(_plan(True))
            reply = Reply()
            for k in range(0, len(text), step):
                reply.add(r.feed(text[k:k + step]))
            reply.add(r.finish())
            assert [p.kind for p in reply.parts] == kinds
            if kinds[1] == "call":
                assert reply.parts[1].name == "get_weather" and reply.parts[1].text == '{"city": "Paris"}'
                assert r.calls == 1
            else:
                assert reply.parts[1].text == "The answer is 4."


# ------------------------------------------------------------------ the real gpt-oss tokenizer and template

def _twin_head() -> Path | None:
    for parent in Path(__file__).resolve().parents:
        p = parent / "shared" / "models" / "gptoss20.head.gz"
        if p.is_file():
            return p
    return None


@pytest.fixture(scope="module")
def gptoss_tokenizer(tmp_path_factory):
    src = _twin_head()
    if src is None:
        pytest.skip("shared/models/gptoss20.head.gz is not here")
    from realizar_backend.model.tokenizer import Tokenizer
    from support import gguf_kv
    head = tmp_path_factory.mktemp("gptoss") / "gptoss20.head"
    head.write_bytes(gzip.decompress(src.read_bytes()))
    md = {kv.key: kv.value for kv in gguf_kv.read(head).kvs}
    return Tokenizer._from_gguf(head, md)


def test_real_tokenizer_shows_markers_and_stops_at_return_and_call(gptoss_tokenizer):
    tok = gptoss_tokenizer
    assert detect_reasoning(tok.chat_template) is HARMONY and detect_format(tok.chat_template) is HARMONY_TOOLS
    text = THOUGHT + FINAL
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text                        # the markers are kept in decoded text
    d = tok.detokenizer(tok.encode("<|start|>assistant", add_special_tokens=False))
    assert "".join(d.add(i) for i in ids) + d.flush() == text
    assert tok.decode(tok.encode("<|endoftext|>hi", add_special_tokens=False)) == "hi"   # others still skipped
    pieces = {tok.id_to_piece(i) for i in tok.stop_ids}
    assert {"<|return|>", "<|call|>"} <= pieces and "<|end|>" not in pieces


def test_real_template_takes_reasoning_effort_and_tools(gptoss_tokenizer):
    from realizar_backend.model.chat_template import TemplateLimits, TemplateRenderer
    tok = gptoss_tokenizer
    renderer = TemplateRenderer(TemplateLimits(10, 1 << 22, 4096, 1))
    try:
        msgs = [{"role": "user", "content": "Weather in Paris?"}]
        tools = [{"type": "function", "function": {"name": WEATHER[0], "description": WEATHER[1],
                                                   "parameters": WEATHER[2]}}]
        prompt = renderer.render(tok.chat_template, {**tok.special_tokens, "messages": msgs, "tools": tools,
                                                     "add_generation_prompt": True, "reasoning_effort": "high"})
        assert "Reasoning: high" in prompt and "get_weather" in prompt
        assert prompt.endswith("<|start|>assistant")
    finally:
        renderer.close()


def test_forced_call_grammar(gptoss_tokenizer):
    """tool_choice required / a named function: an optional thought, then one call of the tools'
    schemas (tool_grammars.harmony_grammar), walked token by token with the real tokenizer."""
    from realizar_backend.backends.sampling import allowed_tokens
    from realizar_backend.engine.guidance import Guidance
    tok = gptoss_tokenizer
    guidance = Guidance(tok, tok.vocab_size)
    tools = [WEATHER, ("set_mode", None, {"type": "object", "properties": {"mode": {"enum": ["fast", "slow"]}},
                                          "required": ["mode"]})]

    def walk(constraint, text):
        g = guidance.guide(constraint)
        ids = tok.encode(text, add_special_tokens=False)
        for k, t in enumerate(ids):
            if not allowed_tokens(g.compute_mask(), guidance.vocab_size)[t]:
                return k, len(ids), g
            assert g.consume(t)
        return len(ids), len(ids), g

    required = tool_request(tools, "required", None, True, tok.chat_template).constraint(guidance)
    call = '<|channel|>commentary to=functions.set_mode <|constrain|>json<|message|>{"mode": "fast"}'
    for reply in (call, THOUGHT + "<|start|>assistant" + call):
        done, n, g = walk(required, reply)
        assert done == n and g.finished, reply
    for wrong in (FINAL[len("<|start|>assistant"):], call.replace("fast", "medium"), call.replace("set_mode", "launch")):
        done, n, _ = walk(required, wrong)
        assert done < n, wrong
    named = tool_request(tools, "function", "get_weather", True, tok.chat_template).constraint(guidance)
    assert walk(named, call)[0] < walk(named, call)[1]
    assert tool_request(tools, "auto", None, True, tok.chat_template).constraint(guidance) is None
