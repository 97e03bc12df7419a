"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False) renders them,
in a jinja2 sandbox, and bad conversations or missing templates fail with typed errors."""

from __future__ import annotations

import dataclasses
from datetime import datetime

import pytest

from realizar_backend.errors import RequestError, UnsupportedModelError
from realizar_backend.model.tokenizer import Tokenizer
from tokenizer_corpus import CONVERSATIONS, model_file, ours, reference

TEMPLATED = ["smol135", "qwen05", "qwen15"]   # gemma270's GGUF carries no chat template

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city <b>now</b> & later",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "Zürich, 東京"}},
                   "required": ["city"]}}}]
TOOL_CHAT = [
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
    {"role": "tool", "content": "{\"temp\": 21}"},
    {"role": "tool", "content": "sunny"},
    {"role": "assistant", "content": "21 °C and sunny."},
]

# Custom templates exercising the environment: trim/lstrip blocks, loop controls, namespace,
# tojson (no HTML escaping, indent), the special-token variables, dict(), strftime_now.
CUSTOM = [
    "{% for m in messages %}\n  {% if m.role == 'system' %}{% continue %}{% endif %}\n"
    "[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}\n{% if add_generation_prompt %}>>{% endif %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}"
    "{{ ns.n }}|{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}",
    "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}{{ pad_token }}{{ unk_token }}",
    "{% set d = dict(a=1, b='<&>') %}{{ d | tojson }}{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}",
    "{%- for m in messages -%}\n    {{- m.content | trim -}}\n    {%- if loop.index > 2 %}{% break %}{% endif %}"
    "\n    {%- if not loop.last %}, {% endif -%}\n{%- endfor %}",
]


def _with_template(tok_name: str, template: str) -> Tokenizer:
    mf = model_file(tok_name)
    return Tokenizer.from_model_file(dataclasses.replace(
        mf, metadata=dict(mf.metadata, **{"tokenizer.chat_template": template})))


# ---------------------------------------------------------------- fast
def test_smol_renders_chatml(smol_model):
    tok = Tokenizer.from_model_file(smol_model)
    out = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out.startswith("<|im_start|>system\n") and out.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert not tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=False) \
        .endswith("assistant\n")


def test_no_template_is_unsupported(smol_model):
    md = {k: v for k, v in smol_model.metadata.items() if k != "tokenizer.chat_template"}
    tok = Tokenizer.from_model_file(dataclasses.replace(smol_model, metadata=md))
    assert not tok.has_chat_template
    with pytest.raises(UnsupportedModelError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_is_a_request_error():
    tok = _with_template("smol135", "{% if messages[0].role != 'user' %}"
                                    "{{ raise_exception('Conversation roles must start with user') }}{% endif %}ok")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(RequestError, match="must start with user") as e:
        tok.apply_chat_template([{"role": "assistant", "content": "x"}])
    assert e.value.param == "messages" and e.value.status == 400


def test_sandbox_blocks_python_internals():
    tok = _with_template("smol135", "{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(RequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = _with_template("smol135", "{% set ns = namespace() %}{% set ns._x = 1 %}")
    with pytest.raises(RequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    tok = _with_template("smol135", "{{ messages.append(1) }}")   # immutable sandbox
    with pytest.raises(RequestError):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_bad_messages_are_request_errors(smol_model):
    tok = Tokenizer.from_model_file(smol_model)
    with pytest.raises(RequestError):
        tok.apply_chat_template([])
    with pytest.raises(RequestError):
        tok.apply_chat_template(["not a dict"])
    with pytest.raises(RequestError):   # the template adds role + content: None content is dropped
        tok.apply_chat_template([{"role": "user"}])


def test_broken_template_is_unsupported():
    for template in ("{% for m in messages %}", "{% break %}"):   # jinja2 syntax error; Python syntax error
        with pytest.raises(UnsupportedModelError, match="chat template"):
            _with_template("smol135", template).apply_chat_template([{"role": "user", "content": "x"}])


def test_strftime_now():
    tok = _with_template("smol135", "{{ strftime_now('%Y') }}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == str(datetime.now().year)


def test_generation_tag_renders_its_body():
    tok = _with_template("smol135", "{% for m in messages %}{% generation %}<{{ m.content }}>{% endgeneration %}{% endfor %}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"


# ---------------------------------------------------------------- slow: against transformers
@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATED)
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_template_equals_transformers(name, conv, gen):
    tok, ref = ours(name), reference(name)
    msgs = CONVERSATIONS[conv]
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
    assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


@pytest.mark.slow
@pytest.mark.parametrize("name", TEMPLATED)
def test_chat_prompt_ids_equal_transformers(name):
    """The ids of the rendered prompt, encoded as transformers does for tokenize=True."""
    tok, ref = ours(name), reference(name)
    for msgs in CONVERSATIONS:
        want = ref.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert tok.encode(tok.apply_chat_template(msgs), add_special_tokens=False) == list(want)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["qwen05"])
def test_tools_equal_transformers(name):
    tok, ref = ours(name), reference(name)
    for gen in (True, False):
        want = ref.apply_chat_template(TOOL_CHAT, tools=TOOLS, tokenize=False, add_generation_prompt=gen)
        assert tok.apply_chat_template(TOOL_CHAT, add_generation_prompt=gen, tools=TOOLS) == want
    assert "<b>now</b> & later" in tok.apply_chat_template(TOOL_CHAT, tools=TOOLS)   # tojson does not escape HTML


@pytest.mark.slow
@pytest.mark.parametrize("template", range(len(CUSTOM)))
def test_custom_templates_equal_transformers(template):
    tok, ref = _with_template("smol135", CUSTOM[template]), reference("smol135")
    for msgs in CONVERSATIONS:
        for gen in (True, False):
            want = ref.apply_chat_template(msgs, chat_template=CUSTOM[template], tokenize=False, add_generation_prompt=gen)
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == want


@pytest.mark.slow
def test_gemma_has_no_template():
    tok = ours("gemma270")
    assert not tok.has_chat_template and reference("gemma270").chat_template is None
    with pytest.raises(UnsupportedModelError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
