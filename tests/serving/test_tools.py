"""Tool calling (serving/tools.py): the call syntax chosen from the chat template, request and
message checks (400s naming the field), the model's reply parsed into OpenAI tool_calls whole and
as streaming deltas (the same result however the text is split), the grammars that hold calls to
the tools' schemas (with the real Qwen2.5 tokenizer), and tools rendered by Qwen2.5's own template."""

from __future__ import annotations

import json
import random

import pytest

from realizar_backend.errors import RequestError
from realizar_backend.serving.tools import (HERMES, LLAMA3_JSON, QWEN_XML, ToolStreamParser, check_tool_messages,
                                            delta_chunks, detect_format, finish_reason, parse_reply,
                                            parse_tool_request)

from support.tool_defs import TOOLS, WEATHER

# the shape of Llama 3.1's template around tools (written for this test, not Meta's text)
LLAMA3_TEMPLATE = ("{% if tools is not none %}{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}"
                   "{% for m in messages %}{% if m.tool_calls %}{% for c in m.tool_calls %}"
                   "{{ '{\"name\": \"' + c.function.name + '\", \"parameters\": ' }}"
                   "{{ c.function.arguments | tojson }}"
                   "{{ '}' }}{% endfor %}{% else %}{{ m.content }}{% endif %}{% endfor %}")
PLAIN_TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def qwen_tok():
    from support.real_models import real_model

    from realizar_backend.formats import open_model
    from realizar_backend.model.tokenizer import Tokenizer
    mf = open_model(real_model("qwen05"))
    return Tokenizer.from_model_file(mf), mf.config.vocab_size


@pytest.fixture(scope="module")
def hermes(qwen_tok):
    return parse_tool_request(TOOLS, "auto", None, qwen_tok[0].chat_template)


def llama3_req(choice="auto"):
    return parse_tool_request(TOOLS, choice, None, LLAMA3_TEMPLATE)


def test_format_comes_from_the_template(qwen_tok, smol_model):
    from realizar_backend.model.tokenizer import Tokenizer
    assert detect_format(qwen_tok[0].chat_template) is HERMES
    assert detect_format(LLAMA3_TEMPLATE) is LLAMA3_JSON
    smol = Tokenizer.from_model_file(smol_model)
    for template in (smol.chat_template, PLAIN_TEMPLATE, None):
        assert detect_format(template) is None
        with pytest.raises(RequestError) as e:
            parse_tool_request(TOOLS, None, None, template)
        assert e.value.status == 400 and e.value.param == "tools" and "no tool support" in e.value.message
        # tool_choice none needs no support: the tools are just not used
        assert parse_tool_request(TOOLS, "none", None, template).template_tools is None


@pytest.mark.parametrize("tools,choice,param", [
    ("get_weather", None, "tools"),
    ([{"type": "retrieval"}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "tools[0].function.name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "description": 3}}], None, "tools[0].function.description"),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
])
def test_bad_tool_requests_name_the_field(qwen_tok, tools, choice, param):
    with pytest.raises(RequestError) as e:
        parse_tool_request(tools, choice, None, qwen_tok[0].chat_template)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(param + ":")


def test_tool_request_choices(qwen_tok):
    t = qwen_tok[0].chat_template
    r = parse_tool_request(TOOLS, None, None, t)
    assert (r.choice, r.named, r.parallel) == ("auto", None, True)
    assert [x["function"]["name"] for x in r.template_tools] == ["get_weather", "calculate"]
    r = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "calculate"}}, False, t)
    assert (r.choice, r.named, r.parallel) == ("function", "calculate", False)
    with pytest.raises(RequestError) as e:
        parse_tool_request(TOOLS, "auto", "yes", t)
    assert e.value.param == "parallel_tool_calls"
    assert parse_tool_request(None, None, None, t) is None and parse_tool_request([], "none", None, t) is None


def test_tool_messages_are_checked():
    good = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                  "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    extra = check_tool_messages(good)
    assert extra[0] == {} and extra[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert extra[2] == {"tool_call_id": "call_1"}
    cases = [
        (2, {"role": "tool", "tool_call_id": "call_9", "content": "x"}, "messages[2].tool_call_id"),
        (2, {"role": "tool", "content": "x"}, "messages[2].tool_call_id"),
        (1, {"role": "assistant", "tool_calls": "call"}, "messages[1].tool_calls"),
        (1, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{}"}}]},
         "messages[1].tool_calls[0].id"),
        (1, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{city"}}]},
         "messages[1].tool_calls[0].function.arguments"),
        (1, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
         "messages[1].tool_calls[0].function.arguments"),
        (1, {"role": "assistant", "tool_calls": [{"id": "c", "function": {"arguments": "{}"}}]},
         "messages[1].tool_calls[0].function"),
    ]
    for i, msg, param in cases:
        msgs = [dict(m) for m in good]
        msgs[i] = msg
        with pytest.raises(RequestError) as e:
            check_tool_messages(msgs)
        assert e.value.status == 400 and e.value.param == param, (msg, e.value.param)


CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_C = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "2 * (3 + 4)"}}\n</tool_call>'
HERMES_CASES = [
    # (reply, content, [(name, arguments)])
    (CALL_W, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (CALL_W + "\n" + CALL_C, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                    ("calculate", '{"expression": "2 * (3 + 4)"}')]),
    ("Let me look that up.\n" + CALL_W, "Let me look that up.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("  It is sunny in Paris.\n", "  It is sunny in Paris.\n", []),
    # cut short (max_tokens): the call and the arguments so far, as OpenAI returns them
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa', None, [("get_weather", '{"city": "Pa')]),
    ('<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', []),
    ('<tool_call>\n{"name": "calculate", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>', None,
     [("calculate", '{"expression": "1+1"}')]),
    ('<tool_call>\n{"arguments": {"expression": "9"}, "name": "calculate"}\n</tool_call>', None,
     [("calculate", '{"expression": "9"}')]),
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "{}"}}', None,          # left open at the end
     [("calculate", '{"expression": "{}"}')]),
    ("A <tool_call>oops</tool_call> B " + CALL_C + "  ", "A <tool_call>oops</tool_call> B",
     [("calculate", '{"expression": "2 * (3 + 4)"}')]),
    (CALL_C + "\n\nDone: 14.\n", "Done: 14.", [("calculate", '{"expression": "2 * (3 + 4)"}')]),
    ('<tool_call>\n{"name": "calculate", "arguments": {"expression": "a\\"}<tool_call>"}}\n</tool_call>', None,
     [("calculate", '{"expression": "a\\"}<tool_call>"}')]),
    # a bare call object (how Qwen2.5-Coder-0.5B answers), alone, two of them, then text
    ('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}', None,
     [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (' {"name": "calculate", "arguments": {"expression": "1"}}\n{"name": "calculate", "arguments": '
     '{"expression": "}"}} \nThat is all.', "That is all.", [("calculate", '{"expression": "1"}'),
                                                          ("calculate", '{"expression": "}"}')]),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"answer": 42} and {"name": "calculate", "arguments": {}}', '{"answer": 42} and {"name": "calculate", '
     '"arguments": {}}', []),
    ("Sure: {\"name\": \"calculate\", \"arguments\": {}}", "Sure: {\"name\": \"calculate\", \"arguments\": {}}", []),
]


def _streamed(req, text, cuts):
    p = ToolStreamParser(req)
    deltas, last = [], 0
    for c in sorted(cuts) + [len(text)]:
        deltas += p.feed(text[last:c])
        last = c
    deltas += p.finish()
    return deltas, p.n_calls


def _assemble(deltas):
    content, calls = None, {}
    for d in deltas:
        if "content" in d:
            content = (content or "") + d["content"]
        for tc in d.get("tool_calls", []):
            k = tc["index"]
            if "id" in tc:
                assert k not in calls and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[k] = [tc["function"]["name"], ""]
            else:
                assert k in calls, "arguments before the call's header"
            calls[k][1] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[k]) for k in range(len(calls))]


@pytest.mark.parametrize("case", range(len(HERMES_CASES)))
def test_hermes_replies_whole_and_streamed(hermes, case):
    text, content, calls = HERMES_CASES[case]
    got_content, got_calls = parse_reply(text, hermes)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    assert all(c.to_openai()["id"].startswith("call_") for c in got_calls)
    assert all(json.loads(c.arguments) is not None for c in got_calls if c.arguments.endswith("}"))
    assert finish_reason("stop", len(got_calls)) == ("tool_calls" if calls else "stop")
    assert finish_reason("length", len(got_calls)) == "length"
    rng = random.Random(case)
    splits = [[], list(range(1, len(text))), [text.find("<tool_call>") + 3] if "<tool_call>" in text else []]
    splits += [rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))) for _ in range(30)]
    for cuts in splits:
        deltas, n = _streamed(hermes, text, cuts)
        assert _assemble(deltas) == (content, calls), cuts
        assert n == len(calls)


def test_streamed_arguments_arrive_as_they_are_generated(hermes):
    p = ToolStreamParser(hermes)
    head = '<tool_call>\n{"name": "calculate", "arguments": {"expression": "12'
    assert _assemble(p.feed(head)) == (None, [("calculate", '{"expression": "12')])
    assert delta_chunks(p.feed(' + 30"}}\n</tool_call>')) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ' + 30"}'}}]}]
    assert p.finish() == []


def test_stream_chunks_are_shaped_as_openai_sends_them(hermes):
    """A call's header alone in its chunk, its argument pieces joined in the next; content joined."""
    text = "Hi " + CALL_C + "\n" + CALL_C
    chunks = delta_chunks(ToolStreamParser(hermes).feed(text))
    assert [sorted(c) for c in chunks] == [["content"], ["tool_calls"], ["tool_calls"], ["tool_calls"], ["tool_calls"]]
    heads = [c["tool_calls"][0] for c in chunks[1::2]]
    assert [(h["index"], h["function"]["arguments"], h["type"]) for h in heads] == [(0, "", "function"), (1, "", "function")]
    assert all(len(c["tool_calls"]) == 1 and "id" not in c["tool_calls"][0] for c in chunks[2::2])
    assert _assemble(chunks) == ("Hi", [("calculate", '{"expression": "2 * (3 + 4)"}')] * 2)


def test_llama3_json_replies():
    req = llama3_req()
    cases = [('{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}', None,
              [("get_weather", '{"city": "Oslo", "unit": "celsius"}')]),
             ('{"name": "calculate", "parameters": {"expression": "1"}}\n{"name": "calculate", "parameters": '
              '{"expression": "2"}}', None,
              [("calculate", '{"expression": "1"}'), ("calculate", '{"expression": "2"}')]),
             ("Oslo is cold today.", "Oslo is cold today.", []),
             ('{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
             ('  {"a": 1} and more', '  {"a": 1} and more', [])]
    for text, content, calls in cases:
        c, got = parse_reply(text, req)
        assert c == content and [(x.name, x.arguments) for x in got] == calls
        for cuts in ([], list(range(1, len(text))), [2, 5, 17]):
            assert _assemble(_streamed(req, text, cuts)[0]) == (content, calls)


def test_tool_choice_none_parses_nothing(qwen_tok):
    req = parse_tool_request(TOOLS, "none", None, qwen_tok[0].chat_template)
    assert parse_reply(CALL_W, req) == (CALL_W, [])
    assert _assemble(_streamed(req, CALL_W, [5, 20])[0]) == (CALL_W, [])
    assert req.constraint(None) is None


def test_qwen_template_renders_tools_calls_and_results(qwen_tok):
    tok = qwen_tok[0]
    req = parse_tool_request(TOOLS, "auto", None, tok.chat_template)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'}]
    extra = check_tool_messages(messages)
    msgs = [{"role": m["role"], "content": m["content"] or "", **x} for m, x in zip(messages, extra)]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tools=req.template_tools)
    assert '"name": "get_weather"' in text and '"description": "Evaluate an arithmetic expression"' in text
    # the call renders as the model writes it: arguments an object, not a JSON string in a string
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    assert call in text
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in text
    assert text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------ grammars with the real tokenizer

@pytest.fixture(scope="module")
def guidance(qwen_tok):
    from realizar_backend.engine.guidance import Guidance
    return Guidance(*qwen_tok)


def _walk(guidance, constraint, text):
    """Feed text's tokens through a Guide; returns (how many were allowed, the guide)."""
    from realizar_backend.backends.sampling import allowed_tokens
    g = guidance.guide(constraint)
    ids = guidance.tokenizer.encode(text, add_special_tokens=False)
    for k, t in enumerate(ids):
        if not allowed_tokens(g.compute_mask(), guidance.vocab_size)[t]:
            return k, g
        assert g.consume(t)
    return len(ids), g


def _stop_allowed(guidance, g):
    from realizar_backend.backends.sampling import allowed_tokens
    allowed = allowed_tokens(g.compute_mask(), guidance.vocab_size)
    return all(allowed[i] for i in guidance.tokenizer.stop_ids)


def test_hermes_grammars(qwen_tok, guidance):
    t = qwen_tok[0].chat_template
    n_ids = lambda s: len(guidance.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    req = parse_tool_request(TOOLS, "required", None, t)
    c = req.constraint(guidance)
    for reply in (CALL_W, CALL_W + "\n" + CALL_C):
        n, g = _walk(guidance, c, reply)
        assert n == n_ids(reply) and _stop_allowed(guidance, g)
    bare = '{"name": "calculate", "arguments": {"expression": "6 * 7"}}'
    n, g = _walk(guidance, c, bare)                                     # one bare call, then the end
    assert n == n_ids(bare) and g.finished
    assert _walk(guidance, c, "It is sunny.")[0] == 0                   # required: no free text
    bad_enum = CALL_W.replace("celsius", "kelvin")
    assert _walk(guidance, c, bad_enum)[0] < n_ids(bad_enum)
    unknown = CALL_W.replace("get_weather", "get_time")
    assert _walk(guidance, c, unknown)[0] < n_ids(unknown)
    # one call only: named function, or parallel_tool_calls false
    for req in (parse_tool_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, t),
                parse_tool_request(TOOLS, "required", False, t)):
        n, g = _walk(guidance, req.constraint(guidance), CALL_W)
        assert n == n_ids(CALL_W) and g.finished
    named = parse_tool_request(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None, t)
    assert _walk(guidance, named.constraint(guidance), CALL_C)[0] < n_ids(CALL_C)
    # auto: text, or text then calls, and a call is held to the schema
    auto = parse_tool_request(TOOLS, "auto", None, t).constraint(guidance)
    for reply in ("It is sunny in Paris.", "Let me check.\n" + CALL_W, CALL_W + "\n" + CALL_C, bare):
        n, g = _walk(guidance, auto, reply)
        assert n == n_ids(reply) and _stop_allowed(guidance, g)
    assert _walk(guidance, auto, bad_enum)[0] < n_ids(bad_enum)
    for wrong in ('{"answer": 42}', bare.replace("expression", "formula")):   # a reply starting with { is a call
        assert _walk(guidance, auto, wrong)[0] < n_ids(wrong)


def test_bad_parameter_schema_is_a_400(qwen_tok, guidance):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"not": {"type": "string"}}}}}}
    req = parse_tool_request([tool], "required", None, qwen_tok[0].chat_template)
    with pytest.raises(RequestError) as e:
        guidance.compile(req.constraint(guidance))
    assert e.value.status == 400 and e.value.param == "tools" and "not" in e.value.message



# ------------------------------------------------------------------ more call syntaxes and schemas

TIMER = {"type": "function", "function": {"name": "set_timer", "parameters": {
    "type": "object", "properties": {"minutes": {"type": "integer"}, "label": {"type": "string"},
                                     "loud": {"type": "boolean"}, "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["minutes"]}}}
XML_W = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
         "</parameter>\n</function>\n</tool_call>")
XML_T = ("<tool_call>\n<function=set_timer>\n<parameter=minutes>\n5\n</parameter>\n<parameter=label>\ntea\nand "
         "cake\n</parameter>\n<parameter=loud>\nTrue\n</parameter>\n<parameter=tags>\n[\"a\", \"b\"]\n</parameter>\n"
         "</function>\n</tool_call>")
XML_CASES = [
    (XML_W, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ("Let me check.\n\n" + XML_W + "\n" + XML_T, "Let me check.",
     [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
      ("set_timer", '{"minutes": 5, "label": "tea\\nand cake", "loud": true, "tags": ["a", "b"]}')]),
    ("<tool_call>\n<function=set_timer>\n</function>\n</tool_call>", None, [("set_timer", "{}")]),
    ("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar", None, [("get_weather", "{}")]),   # cut short
    ("<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", []),
    ('{"name": "get_weather"}', '{"name": "get_weather"}', []),      # JSON is not this format's call
]


@pytest.fixture(scope="module")
def xml_req():
    from support.thinking_model import THINKING_TEMPLATE
    assert detect_format(THINKING_TEMPLATE) is QWEN_XML
    return parse_tool_request(TOOLS + [TIMER], "auto", None, THINKING_TEMPLATE)


@pytest.mark.parametrize("case", range(len(XML_CASES)))
def test_qwen_xml_replies_whole_and_streamed(xml_req, case):
    text, content, calls = XML_CASES[case]
    got_content, got_calls = parse_reply(text, xml_req)
    assert got_content == content and [(c.name, c.arguments) for c in got_calls] == calls
    rng = random.Random(case)
    for cuts in [[], list(range(1, len(text)))] + [rng.sample(range(1, len(text)), 6) for _ in range(30)]:
        assert _assemble(_streamed(xml_req, text, cuts)[0]) == (content, calls), cuts


def test_qwen_xml_arguments_stream_a_parameter_at_a_time(xml_req):
    p = ToolStreamParser(xml_req)
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa"
    assert _assemble(p.feed(head)) == (None, [("get_weather", "")])
    assert delta_chunks(p.feed("ris\n</parameter>\n<param")) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Paris"'}}]}]
    assert delta_chunks(p.feed("eter=unit>\ncelsius\n</parameter>\n</function>\n</tool_call>")) == [
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "unit": "celsius"}'}}]}]


def test_qwen_xml_grammar(guidance, xml_req):
    from support.thinking_model import THINKING_TEMPLATE
    n_ids = lambda s: len(guidance.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    forced = parse_tool_request(TOOLS + [TIMER], "required", None, THINKING_TEMPLATE).constraint(guidance)
    for reply in (XML_W, XML_W + "\n" + XML_T.replace("True", "true")):
        n, g = _walk(guidance, forced, reply)
        assert n == n_ids(reply) and _stop_allowed(guidance, g)
    assert _walk(guidance, forced, "Sunny.")[0] == 0
    for wrong in (XML_W.replace("celsius", "kelvin"),                  # not in the enum
                  XML_T.replace("\n5\n", "\nfive\n"),                  # not an integer
                  XML_W.replace("<parameter=city>\nParis\n</parameter>\n", "")):      # a required one left out
        assert _walk(guidance, forced, wrong)[0] < n_ids(wrong)
    auto = xml_req.constraint(guidance)
    for reply in ("Sunny in Paris.", "Let me check.\n" + XML_W):
        n, g = _walk(guidance, auto, reply)
        assert n == n_ids(reply) and _stop_allowed(guidance, g)


def test_a_fenced_json_call_parses(hermes):
    fenced = '```json\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n```'
    cases = [(fenced, None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
             ("Here:\n" + fenced + "\n", "Here:", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
             ('```json\n{"result": 3}\n```', '```json\n{"result": 3}\n```', []),
             ("```python\nprint(1)\n```", "```python\nprint(1)\n```", [])]
    for text, content, calls in cases:
        c, got = parse_reply(text, hermes)
        assert c == content and [(x.name, x.arguments) for x in got] == calls
        for cuts in ([], list(range(1, len(text))), [3, 9, 20]):
            assert _assemble(_streamed(hermes, text, cuts)[0]) == (content, calls)
    # a fenced block that cannot be a call streams as content before it closes
    p = ToolStreamParser(hermes)
    assert "".join(d.get("content", "") for d in p.feed('```json\n{"result": 3,')) == '```json\n{"result": 3,'


def test_schemas_with_defs_and_refs(qwen_tok, guidance):
    """$defs (and definitions) of a function's parameters are found although the call nests them."""
    address = {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
               "required": ["city", "zip"], "additionalProperties": False}
    ship = {"type": "function", "function": {"name": "ship", "parameters": {
        "type": "object", "$defs": {"Address": address},
        "properties": {"to": {"$ref": "#/$defs/Address"}, "back": {"$ref": "#/definitions/Old"}},
        "definitions": {"Old": address}, "required": ["to"], "additionalProperties": False}}}
    for choice in ("required", "auto"):
        req = parse_tool_request(TOOLS + [ship], choice, None, qwen_tok[0].chat_template)
        c = req.constraint(guidance)
        guidance.compile(c)                          # was a 400: "Pointer '/$defs/Address' does not exist"
        good = ('<tool_call>\n{"name": "ship", "arguments": {"to": {"city": "Rome", "zip": "00100"}}}\n'
                '</tool_call>')
        n, g = _walk(guidance, c, good)
        assert n == len(guidance.tokenizer.encode(good, add_special_tokens=False))
        bad_call = good.replace(', "zip": "00100"', "")
        assert _walk(guidance, c, bad_call)[0] < len(guidance.tokenizer.encode(bad_call, add_special_tokens=False))


def test_an_empty_arguments_string_is_an_empty_object():
    msgs = [{"role": "user", "content": "time?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "now", "arguments": ""}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "noon"}]
    assert check_tool_messages(msgs)[1]["tool_calls"][0]["function"]["arguments"] == "{}"


def test_a_thinking_model_may_think_before_its_calls(guidance, xml_req, hermes):
    """With the model's reasoning format, every tool grammar lets a thought come first (here the
    tags are spelled out: Qwen2.5's vocabulary has no <think> token), then holds the calls as before."""
    from realizar_backend.serving.reasoning import THINK
    from support.thinking_model import THINKING_TEMPLATE
    n_ids = lambda s: len(guidance.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
    thought = "<think>\nThe user wants Paris.\n</think>\n\n"
    for template, call in ((THINKING_TEMPLATE, XML_W), (None, CALL_W)):
        t = template or guidance.tokenizer.chat_template
        for choice in ("required", "auto"):
            c = parse_tool_request(TOOLS + [TIMER] if template else TOOLS, choice, None, t).constraint(guidance, THINK)
            for reply in (thought + call, "The user wants Paris.\n</think>\n" + call, call):
                n, g = _walk(guidance, c, reply)
                assert n == n_ids(reply) and _stop_allowed(guidance, g), (choice, reply)
            if choice == "required":
                assert _walk(guidance, c, thought + "Sunny.")[0] < n_ids(thought + "Sunny.")
                bad = thought + call.replace("Paris", "Paris</think>") if template is None else None
                assert bad is None or _walk(guidance, c, bad)[0] <= n_ids(bad)
