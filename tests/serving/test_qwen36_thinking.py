"""Thinking mode with Qwen3.6's real tokenizer and chat template (from the twin header
shared/models/qwen36.head.gz, a gzipped head of the real Qwen3.6-27B GGUF; the module is skipped
without it), on the CPU:

- the tokenizer splits text as Qwen3.5's tokenizer.json does (its `qwen35` pre-tokenizer keeps
  combining marks with their letters), and `<think>` / `</think>` are single tokens kept in text;
- the template's generation prompt opens a thought (`<think>\\n`) unless `enable_thinking` is false,
  when it writes an empty, closed one; the reasoning format is read from that template;
- replies recorded as the real tokenizer's tokens, detokenized one token at a time, come back as
  chat's reasoning_content apart from content (whole and streamed) and as the reasoning and text
  parts that /v1/responses and /v1/messages are built from; with thinking off no reasoning appears.
The same end to end, through a real server: tests/serving/test_qwen36_server.py.
"""

from __future__ import annotations

import gzip
import logging
import unicodedata

import pytest

from realizar_backend.serving.chat import ChatReply, message
from realizar_backend.serving.plans import Plan
from realizar_backend.serving.reasoning import THINK, detect_reasoning
from realizar_backend.serving.replies import Reply, ReplyReader

from support.qwen35_model import qwen36_head

USER = [{"role": "user", "content": "What is two plus two?"}]
THOUGHT = "The user asks for 2 + 2.\nThat is 4."
ANSWER = "The answer is **4**."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    src = qwen36_head()
    if src is None:
        pytest.skip("shared/models/qwen36.head.gz is not here")
    from realizar_backend.model.tokenizer import Tokenizer
    from support import gguf_kv
    head = tmp_path_factory.mktemp("qwen36") / "qwen36.head"
    head.write_bytes(gzip.decompress(src.read_bytes()))
    md = {kv.key: kv.value for kv in gguf_kv.read(head).kvs}
    logger = logging.getLogger("realizar_backend.model.tokenizer")
    seen: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        t = Tokenizer._from_gguf(head, md)
    finally:
        logger.removeHandler(handler)
    assert not seen, seen                  # the `qwen35` pre-tokenizer is known: no fallback
    return t


def test_the_moe_carries_the_same_tokenizer_and_template(tmp_path):
    """Qwen3.6-35B-A3B's head has the 27B's tokenizer and template: these tests cover both."""
    from support.gguf_kv import tokenizer_kvs
    moe = qwen36_head("qwen36moe")
    if moe is None or qwen36_head() is None:
        pytest.skip("shared/models/qwen36moe.head.gz is not here")
    dense, sparse = ({kv.key: kv.value for kv in tokenizer_kvs(src, tmp_path)} for src in (qwen36_head(), moe))
    assert "tokenizer.chat_template" in dense and dense == sparse


def test_real_tokenizer_keeps_marks_with_letters_and_think_tags_whole(tok):
    # Devanagari vowel signs are combining marks: Qwen3.5's split keeps them with the letter before
    # them, so no token of a word starts with one (Qwen2's split would start a piece at each sign)
    for word in ("हिन्दी", "पाठ", "किताब"):
        pieces = [tok.decode([i]) for i in tok.encode(word, add_special_tokens=False)]
        assert "".join(pieces) == word
        assert not any(unicodedata.category(p[0]).startswith("M") for p in pieces), pieces
    # a bracket before letters starts their piece, as Qwen splits (GPT-2's split leaves it alone)
    pieces = [tok.decode([i]) for i in tok.encode("(word) x", add_special_tokens=False)]
    assert pieces[0].startswith("(") and pieces[0][1:].isalpha(), pieces
    for tag in ("<think>", "</think>"):
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == tag            # one token, kept in decoded text


def test_template_opens_the_thought_or_writes_it_closed(tok):
    assert detect_reasoning(tok.chat_template) is THINK
    on = tok.apply_chat_template(USER, add_generation_prompt=True)
    on_explicit = tok.apply_chat_template(USER, add_generation_prompt=True, enable_thinking=True)
    off = tok.apply_chat_template(USER, add_generation_prompt=True, enable_thinking=False)
    turn = "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n"
    assert on == on_explicit == turn + "<think>\n"
    assert off == turn + "<think>\n\n</think>\n\n"
    assert THINK.opened_by(on) and not THINK.opened_by(off)
    # a past turn's thought is rendered in its think block (the last turn after the user's query)
    past = USER + [{"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
                   {"role": "user", "content": "And three plus three?"}]
    assert "Two and two make four." not in tok.apply_chat_template(past)      # before the last query: dropped
    cont = USER + [{"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."}]
    rendered = tok.apply_chat_template(cont, add_generation_prompt=False)
    assert "<think>\nTwo and two make four.\n</think>\n\n4<|im_end|>" in rendered


def _plan(inside: bool) -> Plan:
    return Plan([], 0, False, False, False, reasoning=THINK, thinking_inside=inside)


def _recorded(tok, text: str, prompt: str) -> list[str]:
    """`text` as the model would write it: the real tokenizer's tokens, decoded one at a time
    after the prompt (the server's detokenizer), as the streamed text deltas."""
    d = tok.detokenizer(tok.encode(prompt, add_special_tokens=False))
    deltas = [d.add(i) for i in tok.encode(text, add_special_tokens=False)]
    return [*deltas, d.flush()]


def _chat(plan: Plan, deltas: list[str]) -> tuple[dict, list[dict]]:
    reply = ChatReply(plan)
    out = [x for delta in deltas for x in reply.feed(delta)] + reply.feed("", final=True)
    whole, _ = message(plan, "".join(deltas), "stop")
    return whole, out


def _parts(plan: Plan, deltas: list[str]) -> list[tuple[str, str]]:
    reader, reply = ReplyReader(plan), Reply()
    for delta in deltas:
        reply.add(reader.feed(delta))
    reply.add(reader.finish())
    return [(p.kind, p.text) for p in reply.parts]


def test_recorded_replies_with_thinking_on(tok):
    prompt = tok.apply_chat_template(USER)
    plan = _plan(THINK.opened_by(prompt))
    deltas = _recorded(tok, THOUGHT + "\n</think>\n\n" + ANSWER, prompt)
    assert len(deltas) > 10
    whole, streamed = _chat(plan, deltas)
    assert whole["reasoning_content"] == whole["reasoning"] == THOUGHT and whole["content"] == ANSWER
    assert "".join(d.get("reasoning_content", "") for d in streamed) == THOUGHT
    assert "".join(d.get("content", "") for d in streamed) == ANSWER
    kinds = [k for d in streamed for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds == sorted(kinds, key=lambda k: k == "content")        # the thought, then the answer
    assert _parts(plan, deltas) == [("reasoning", THOUGHT), ("text", ANSWER)]   # responses / messages
    # cut short inside the thought: all reasoning, no content
    cut = _recorded(tok, THOUGHT, prompt)
    whole, _ = _chat(plan, cut)
    assert whole["reasoning_content"] == THOUGHT and not whole["content"]
    assert _parts(plan, cut) == [("reasoning", THOUGHT)]


def test_recorded_replies_with_thinking_off(tok):
    prompt = tok.apply_chat_template(USER, enable_thinking=False)
    plan = _plan(THINK.opened_by(prompt))
    deltas = _recorded(tok, ANSWER, prompt)
    whole, streamed = _chat(plan, deltas)
    # the message of a model that thinks keeps its reasoning fields, null (as vLLM's); no delta has one
    assert whole["reasoning_content"] is None and whole["reasoning"] is None and whole["content"] == ANSWER
    assert not any("reasoning_content" in d or "reasoning" in d for d in streamed)
    assert "".join(d.get("content", "") for d in streamed) == ANSWER
    assert _parts(plan, deltas) == [("text", ANSWER)]
    # a model that opens a thought of its own anyway: read as one
    deltas = _recorded(tok, "<think>\n" + THOUGHT + "\n</think>\n\n" + ANSWER, prompt)
    whole, _ = _chat(plan, deltas)
    assert whole["reasoning_content"] == THOUGHT and whole["content"] == ANSWER


SET_MODE = ("set_mode", "Sets the mode.", {"type": "object", "properties": {
    "mode": {"enum": ["fast", "slow"]}, "loud": {"type": "boolean"}}, "required": ["mode", "loud"]})
CALL = "<tool_call>\n<function=set_mode>\n<parameter=mode>\nfast\n</parameter>\n" \
       "<parameter=loud>\ntrue\n</parameter>\n</function>\n</tool_call>"


def test_a_thought_then_a_call_in_the_real_template_syntax(tok):
    """Tools on the real template: its XML call syntax is read from it; a recorded thought and call
    come back as reasoning and a tool call (whole and streamed); tool_choice required's grammar,
    walked token by token with the real tokenizer, lets the thought come first and then the call."""
    from realizar_backend.backends.sampling import allowed_tokens
    from realizar_backend.engine.guidance import Guidance
    from realizar_backend.serving.tools import QWEN_XML, detect_format, tool_request

    assert detect_format(tok.chat_template) is QWEN_XML
    req = tool_request([SET_MODE], "required", None, False, tok.chat_template)
    prompt = tok.apply_chat_template(USER, tools=req.template_tools)
    assert "set_mode" in prompt and THINK.opened_by(prompt)
    plan = Plan([], 0, False, False, False, tools=req, reasoning=THINK, thinking_inside=True)
    deltas = _recorded(tok, THOUGHT + "\n</think>\n\n" + CALL, prompt)
    whole, reason = message(plan, "".join(deltas), "stop")
    assert reason == "tool_calls" and whole["reasoning_content"] == THOUGHT and whole["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == \
        [("set_mode", '{"mode": "fast", "loud": true}')]
    parts = _parts(plan, deltas)
    assert [k for k, _ in parts] == ["reasoning", "call"] and parts[0][1] == THOUGHT

    guidance = Guidance(tok, tok.vocab_size)
    constraint = req.constraint(guidance, THINK)

    def walk(text: str) -> bool:
        g = guidance.guide(constraint)
        for t in tok.encode(text, add_special_tokens=False):
            if not allowed_tokens(g.compute_mask(), guidance.vocab_size)[t] or not g.consume(t):
                return False
        return g.finished
    assert walk(THOUGHT + "\n</think>\n\n" + CALL) and walk("</think>\n\n" + CALL)
    assert not walk(THOUGHT + "\n</think>\n\n" + ANSWER)                 # required: no answer instead
    assert not walk(THOUGHT + "\n</think>\n\n" + CALL.replace("fast", "medium"))
