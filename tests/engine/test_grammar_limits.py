"""A request's grammar is measured before anything compiles it, then compiled and tried in a worker
process that can be abandoned: a grammar that would crash the process (a deep chain of references),
stall it (a compile of minutes) or fail at the first token, or that allows no text at all, is a
400 at the request. Real llguidance over SmolLM2's vocabulary; the worker processes are real too.
The huge inputs are built here (and in support/grammars.py), never stored."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from realizar_backend.engine import grammar_limits as gl
from realizar_backend.engine.grammar_check import Cancelled, CheckFailed, GrammarChecker
from realizar_backend.engine.guidance import Constraint, Guidance, grammar_source
from realizar_backend.errors import RequestError
from realizar_backend.model.tokenizer import Tokenizer
from support.grammars import SLOW, defs_chain, lark_chain, object_of


# the attacks of each class: (kind, spec) -> the code of their 400
TOO_LARGE = {
    "lark-chain-5000": ("lark", lark_chain(5000)),
    "lark-chain-1500": ("lark", lark_chain(1500)),          # within the rule count, past the chain
    "defs-chain-5000": ("json_schema", defs_chain(5000)),
    "regex-a1000000": ("regex", "a{1000000}"),
    "regex-nested-repeats": ("regex", "(a{1000}){1000}"),
    "regex-3.5mb": ("regex", "a" * 3_500_000),
    "lark-literal-3.5mb": ("lark", 'start: "' + "a" * 3_500_000 + '"'),
    "optional-properties-10000": ("json_schema", object_of(10_000)),
    "choices-100000": ("choice", [f"choice {i}" for i in range(100_000)]),
    "lark-alternatives-100000": ("lark", "start: " + " | ".join(f'"w{i}"' for i in range(100_000))),
    "pattern-in-schema": ("json_schema", {"type": "string", "pattern": "[a-z]{100000}"}),
    "regex-in-lark": ("lark", "start: /x{70000}/"),
    "pattern-in-lark-json": ("lark", 'start: %json {"type": "string", "pattern": "(ab{300}){300}"}'),
}
UNSATISFIABLE = {
    "empty-class": ("regex", r"[^\s\S]"),
    "ref-root": ("json_schema", {"$ref": "#"}),
    "ref-cycle": ("json_schema", {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                                  "$ref": "#/$defs/a"}),
}
FIRST_TOKEN_LIMITS = {
    "required-self": ("json_schema", {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}),
    "endless-nesting": ("lark", 'start: x\nx: "(" x ")"'),
}
# near the limits, and ordinary: these compile
GOOD = {
    "lark-chain-900": ("lark", lark_chain(900)),
    "defs-chain-900": ("json_schema", defs_chain(900)),
    "properties-1000": ("json_schema", object_of(1000, required=True)),
    "regex-a60000": ("regex", "a{60000}"),
    "regex-repeats": ("regex", "(a{100}){100}"),
    "choices-1000": ("choice", [f"choice {i}" for i in range(1000)]),
    "recursive-schema": ("json_schema", {"type": "object", "properties": {"name": {"type": "string"}, "children": {
        "type": "array", "items": {"$ref": "#"}, "maxItems": 3}}, "required": ["name"]}),
    "expression-grammar": ("lark", 'start: expr\nexpr: expr "+" term | term\nterm : NUMBER | "(" expr ")"\n'
                                   'NUMBER: /[0-9]{1,9}/'),
    "gbnf": ("lark", 'root ::= "yes" | "no" | word\nword ::= [a-z]+'),
}


@pytest.fixture(scope="module")
def tokenizer(smol_model):
    return Tokenizer.from_model_file(smol_model)


@pytest.fixture(scope="module")
def guidance(tokenizer, smol_model):
    g = Guidance(tokenizer, smol_model.config.vocab_size, check_timeout_s=30.0)
    g.checker.check('start: "warm"')          # a started worker: the cases below time only their own check
    return g


@pytest.mark.parametrize("name", TOO_LARGE)
def test_oversized_grammars_are_refused_before_any_compile(tokenizer, smol_model, name):
    # no check workers, and llguidance never sees these: the deep chains would end this process
    g = Guidance(tokenizer, smol_model.config.vocab_size)
    kind, spec = TOO_LARGE[name]
    with pytest.raises(RequestError) as e:
        g.compile(Constraint(kind, spec, param="guided_x"))
    assert (e.value.status, e.value.code, e.value.param) == (400, "grammar_too_large", "guided_x"), e.value.message
    assert "at most" in e.value.message


@pytest.mark.parametrize("name", UNSATISFIABLE)
def test_grammars_that_allow_no_text_are_refused(guidance, name):
    kind, spec = UNSATISFIABLE[name]
    with pytest.raises(RequestError) as e:
        guidance.compile(Constraint(kind, spec))
    assert (e.value.status, e.value.code) == (400, "grammar_unsatisfiable"), e.value.message


@pytest.mark.parametrize("name", FIRST_TOKEN_LIMITS)
def test_grammars_that_fail_at_their_start_are_refused(guidance, name):
    kind, spec = FIRST_TOKEN_LIMITS[name]
    with pytest.raises(RequestError) as e:
        guidance.compile(Constraint(kind, spec))
    assert (e.value.status, e.value.code) == (400, "grammar_too_complex"), e.value.message


@pytest.mark.parametrize("name", GOOD)
def test_grammars_within_the_limits_compile_and_guide(guidance, name):
    kind, spec = GOOD[name]
    c = Constraint(kind, spec)
    guidance.compile(c)
    guide = guidance.guide(c)
    assert guide.compute_mask().any() and not guide.error
    guidance.release(guide)


def test_a_grammar_that_crashes_the_compiler_costs_only_its_worker(tokenizer, smol_model, guidance):
    # past the limits on purpose (its text straight to the checker): the compiler's recursion
    # overflows the worker's stack, and the worker's exit is this grammar's 400
    checker = guidance.checker
    with pytest.raises(CheckFailed) as e:
        checker.check(grammar_source(Constraint("lark", lark_chain(20_000))))
    assert e.value.kind == "complex" and "exited" in e.value.message
    checker.check(grammar_source(Constraint("regex", "[0-9]+")))       # a fresh worker serves the next


def test_a_slow_compile_is_given_up_at_the_time_limit(guidance):
    checker = GrammarChecker(guidance.checker.vocab, timeout_s=1.0, workers=1)
    try:
        checker.check(grammar_source(Constraint("regex", "[0-9]+")))    # started: the limit counts the compile
        t0 = time.monotonic()
        with pytest.raises(CheckFailed) as e:
            checker.check(grammar_source(Constraint("json_schema", SLOW)))
        assert e.value.kind == "complex" and "longer than 1 s" in e.value.message
        assert time.monotonic() - t0 < 10, "the check went on past its time limit"
        checker.check(grammar_source(Constraint("regex", "[0-9]+")))
    finally:
        checker.close()


def test_a_cancelled_check_stops_its_compile(guidance):
    checker = GrammarChecker(guidance.checker.vocab, timeout_s=120.0, workers=1)
    try:
        checker.check(grammar_source(Constraint("regex", "[0-9]+")))
        (worker,) = checker.pool.pids()
        cancel = threading.Event()
        threading.Timer(0.5, cancel.set).start()
        t0 = time.monotonic()
        with pytest.raises(Cancelled):
            checker.check(grammar_source(Constraint("json_schema", SLOW)), cancel)
        assert time.monotonic() - t0 < 10
        assert not psutil.pid_exists(worker), "the compile goes on after its caller left"
    finally:
        checker.close()


def test_the_limits_measure_what_they_name():
    assert gl.regex_expansion(r"\d{3}-\d{4}") == 8
    assert gl.regex_expansion("(ab|c){10}x") == 21
    assert gl.regex_expansion("[a{]{5}") == 5
    assert gl.regex_expansion("(a{10}){10}|b") == 100
    # a cycle counts each of its rules once; chains add up
    assert gl.longest_chain(["a", "b", "c", "d"], {"a": ["b"], "b": ["c", "a"], "c": ["d"], "d": []}.get) == 4
    assert gl.longest_chain(range(10), lambda i: [i + 1] if i < 9 else []) == 10


def test_a_burst_of_one_new_grammar_is_checked_once(tokenizer, smol_model):
    g = Guidance(tokenizer, smol_model.config.vocab_size, check_timeout_s=30.0)
    checks = []
    checker = g.checker                   # the process's checker of this vocabulary: counted, then as it was
    checker.check = lambda grammar, cancel=None: (checks.append(grammar), type(checker).check(checker, grammar,
                                                                                               cancel))[1]
    try:
        c = Constraint("json_schema", object_of(200, required=True))
        with ThreadPoolExecutor(8) as pool:
            grammars = list(pool.map(lambda _: g.compile(c), range(8)))
    finally:
        del checker.check
    assert len(set(grammars)) == 1 and len(checks) == 1
