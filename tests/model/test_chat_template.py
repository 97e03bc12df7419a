"""Chat templates render exactly as transformers' apply_chat_template(tokenize=False) renders them,
in a jinja2 sandbox in worker processes with limits; bad conversations, missing templates and
runaway templates fail with typed errors (at load when the template is broken for every request)."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime

import psutil
import pytest

from realizar_backend.errors import ModelFormatError, RequestError, UnsupportedModelError
from realizar_backend.model.chat_template import MAX_TEMPLATE_CHARS, TemplateLimits, TemplateRenderer
from realizar_backend.model.tokenizer import Tokenizer
from support.hostile_templates import TRAP_CODES, trapped
from support.tokenizer_corpus import CONVERSATIONS, model_file, ours, reference

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


def _with_template(tok_name: str, template: str, limits: TemplateLimits | None = None) -> Tokenizer:
    mf = model_file(tok_name)
    return Tokenizer.from_model_file(dataclasses.replace(
        mf, metadata=dict(mf.metadata, **{"tokenizer.chat_template": template})), limits)


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
    # each escape tried when the message asks for it (the load's trial conversation does not)
    for escape in ("{{ messages.__class__.__mro__[1].__subclasses__() }}",
                   "{% set ns = namespace() %}{% set ns._x = 1 %}",
                   "{{ messages.append(1) }}"):                        # immutable sandbox
        tok = _with_template("smol135", "{% if messages[0].content == 'x' %}" + escape + "{% endif %}ok")
        assert tok.apply_chat_template([{"role": "user", "content": "y"}]) == "ok"
        with pytest.raises(RequestError):
            tok.apply_chat_template([{"role": "user", "content": "x"}])
        # and one that tries on every conversation never loads
        with pytest.raises(ModelFormatError, match="fails on every conversation"):
            _with_template("smol135", escape)


def test_bad_messages_are_request_errors(smol_model):
    tok = Tokenizer.from_model_file(smol_model)
    with pytest.raises(RequestError):
        tok.apply_chat_template([])
    with pytest.raises(RequestError):
        tok.apply_chat_template(["not a dict"])
    with pytest.raises(RequestError):   # the template adds role + content: None content is dropped
        tok.apply_chat_template([{"role": "user"}])


def test_broken_template_fails_the_load():
    # jinja2 syntax error; Python syntax error (a break outside a loop); a template over the size limit
    for template in ("{% for m in messages %}", "{% break %}", "x" * (MAX_TEMPLATE_CHARS + 1)):
        with pytest.raises(ModelFormatError, match="'tokenizer.chat_template'") as e:
            _with_template("smol135", template)
        assert str(model_file("smol135").path) in str(e.value)


# What a hostile model file can do to one request (the loader's trial render does not trip it).
TRAPPED = trapped("<{{ m.role }}>{{ m.content }}")
LIMITS = TemplateLimits(timeout_s=1.0, max_chars=1 << 20, memory_mb=512, workers=2)


def test_runaway_templates_are_stopped_per_request():
    tok = _with_template("smol135", TRAPPED, LIMITS)
    rss0 = _rss_mb()
    for content, code in TRAP_CODES.items():
        t0 = time.monotonic()
        with pytest.raises(RequestError) as e:
            tok.apply_chat_template([{"role": "user", "content": content}])
        assert (e.value.status, e.value.param, e.value.code) == (400, "messages", code), (content, e.value)
        # the time limit, plus the start of a fresh worker after a kill, on a loaded machine
        assert time.monotonic() - t0 < LIMITS.timeout_s + 20, content
        # and the next render is served at once, by the same or a fresh worker
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
    assert _rss_mb() - rss0 < 200, "the runaway renders grew this process"


def test_a_runaway_render_does_not_hold_up_the_others():
    limits = dataclasses.replace(LIMITS, timeout_s=6.0)
    tok = _with_template("smol135", TRAPPED, limits)
    with ThreadPoolExecutor(1) as pool:
        slow = pool.submit(tok.apply_chat_template, [{"role": "user", "content": "loop"}])
        time.sleep(0.2)
        for _ in range(20):
            assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "<user>hi"
        assert not slow.done(), "the good renders waited for the runaway one"
        with pytest.raises(RequestError, match="did not finish within 6 s"):
            slow.result()


def test_a_template_that_runs_away_at_load_fails_the_load():
    for template in ("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
                     "{{ 'x' * 2000000 }}"):
        with pytest.raises(ModelFormatError, match="'tokenizer.chat_template': the chat template"):
            _with_template("smol135", template, LIMITS)


def test_a_template_that_refuses_the_trial_still_loads():
    tok = _with_template("smol135", "{% if messages | length > 1 %}{{ raise_exception('one message only') }}"
                                    "{% endif %}{{ messages[0].content }}")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "x"


@pytest.mark.parametrize("workers", [1, 2])
def test_the_worker_started_during_the_build_serves_the_check(workers):
    # the load starts a render worker before it builds the vocabulary; the trial render and the
    # requests use it, and the pool never runs more workers than its limit (limits of their own:
    # a renderer of its own)
    limits = TemplateLimits(timeout_s=4.5, max_chars=1 << 20, memory_mb=511, workers=workers)
    tok = _with_template("smol135", "<{{ messages[0].content }}>", limits)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<x>"
    pool = tok._renderer.pool
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(pool.pids()) < workers:
        time.sleep(0.05)                 # the other workers start on a thread after the check
    pids = pool.pids()
    assert len(set(pids)) == len(pids) == workers
    assert all(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE for pid in pids)
    assert tok.apply_chat_template([{"role": "user", "content": "y"}]) == "<y>"


def test_renders_arriving_while_a_worker_starts_all_complete():
    # renders that come while prestart() brings its worker up wait for it or take a free slot;
    # none is left waiting, and no more workers run than the limit
    limits = TemplateLimits(timeout_s=4.5, max_chars=1 << 20, memory_mb=509, workers=2)
    pool = TemplateRenderer(limits)
    try:
        pool.prestart()
        with ThreadPoolExecutor(4) as ex:
            outs = list(ex.map(lambda i: pool.render("<{{ n }}>", {"n": i}), range(8)))
        assert outs == [f"<{i}>" for i in range(8)]
        assert len(pool.pool.pids()) <= 2
    finally:
        pool.close()


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


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


def test_a_template_that_recurses_on_every_conversation_fails_the_load():
    # a macro that calls itself for ever is a runaway, as a loop past the time limit is
    with pytest.raises(ModelFormatError, match="'tokenizer.chat_template': the chat template recursed too deeply"):
        _with_template("smol135", "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", LIMITS)


def test_a_template_that_fails_on_every_trial_conversation_fails_the_load():
    with pytest.raises(ModelFormatError, match="fails on every conversation tried at load"):
        _with_template("smol135", "{{ raise_exception('no chat today') }}", LIMITS)
