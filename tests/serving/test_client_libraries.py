"""The client libraries agents and apps are built with, unchanged, against a real `bentoml serve`
of Qwen2.5-Coder-0.5B on the CPU (support.server's shared one): instructor (TOOLS and JSON_SCHEMA
modes), pydantic-ai (an agent with a tool and a nested output type), langchain-openai (bind_tools,
with_structured_output) and litellm (tools, response_format).

The model is small, so every call is one the server constrains (a forced function, a JSON schema):
the shapes are certain and the tests check them, the parsed objects' types and fields. The calls
run together (the engine batches them), once for the module, and each test reads its own result.
(langchain's use_responses_api needs /v1/responses: another route's tests cover it.)
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from pydantic import BaseModel, Field

from support.server import QWEN_MODEL, shared_qwen_server

pytestmark = [pytest.mark.server, pytest.mark.slow]

PROMPT = "Ada is 36 years old and lives in London, UK."


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Person(BaseModel):
    name: str = Field(max_length=20)
    age: int = Field(ge=0, le=120)
    home: Address


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}


def _instructor(server, mode_name):
    import instructor
    import openai
    mode = getattr(instructor.Mode, mode_name)
    client = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key,
                                                  max_retries=0), mode=mode)
    return client.chat.completions.create(model=QWEN_MODEL, response_model=Person, max_retries=0, max_tokens=80,
                                          temperature=0, messages=[{"role": "user", "content": PROMPT}])


def _pydantic_ai(server):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(QWEN_MODEL, provider=OpenAIProvider(base_url=server.url + "/v1", api_key=server.api_key))
    agent = Agent(model, output_type=Person, model_settings={"temperature": 0, "max_tokens": 100})
    asked: list[str] = []

    @agent.tool_plain
    def lookup_age(name: str) -> int:
        """The age of a person, by name."""
        asked.append(name)
        return 36

    result = agent.run_sync("Ada lives in London, UK. Look up her age, then describe her.")
    return result, asked


def _langchain(server, kind):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=QWEN_MODEL, base_url=server.url + "/v1", api_key=server.api_key, temperature=0,
                     max_tokens=80, max_retries=0)
    if kind == "structured":
        return llm.with_structured_output(Person, method="json_schema").invoke(PROMPT)

    @tool
    def get_weather(city: str) -> str:
        """Current weather in a city."""
        return "sunny"

    return llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")


def _litellm(server, kind):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")     # its price list without the network
    import litellm

    common = dict(model="openai/" + QWEN_MODEL, api_base=server.url + "/v1", api_key=server.api_key,
                  temperature=0, max_tokens=80)
    if kind == "structured":
        return litellm.completion(messages=[{"role": "user", "content": PROMPT}], response_format=Person, **common)
    return litellm.completion(messages=[{"role": "user", "content": "What is the weather in Paris?"}],
                              tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "get_weather"}},
                              **common)


CALLS = {
    "instructor_tools": lambda s: _instructor(s, "TOOLS"),
    "instructor_json_schema": lambda s: _instructor(s, "JSON_SCHEMA"),
    "pydantic_ai": _pydantic_ai,
    "langchain_tools": lambda s: _langchain(s, "tools"),
    "langchain_structured": lambda s: _langchain(s, "structured"),
    "litellm_tools": lambda s: _litellm(s, "tools"),
    "litellm_structured": lambda s: _litellm(s, "structured"),
}


@pytest.fixture(scope="module")
def results():
    server = shared_qwen_server()
    with ThreadPoolExecutor(len(CALLS)) as pool:
        futures = {name: pool.submit(call, server) for name, call in CALLS.items()}
    out = {}
    for name, f in futures.items():
        try:
            out[name] = f.result()
        except Exception as e:  # each test reports its own library's failure
            out[name] = e
    return out


def result(results, name):
    value = results[name]
    if isinstance(value, Exception):
        raise value
    return value


def _is_ada(p) -> None:
    assert isinstance(p, Person) and isinstance(p.home, Address)
    assert p.name == "Ada" and p.age == 36 and p.home.city == "London"


@pytest.mark.parametrize("mode", ["tools", "json_schema"])
def test_instructor(results, mode):
    _is_ada(result(results, "instructor_" + mode))


def test_pydantic_ai_agent_with_a_tool_and_a_nested_output(results):
    run, asked = result(results, "pydantic_ai")
    assert asked and set(asked) == {"Ada"}                    # the tool was called, with its argument
    _is_ada(run.output)                                       # the age came from the tool
    tools_called = [p.tool_name for m in run.all_messages() for p in m.parts if type(p).__name__ == "ToolCallPart"]
    assert tools_called[-1] == "final_result" and "lookup_age" in tools_called


def test_langchain_openai(results):
    msg = result(results, "langchain_tools")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"} and isinstance(call["args"]["city"], str)
    assert call["id"]
    _is_ada(result(results, "langchain_structured"))


def test_litellm(results):
    r = result(results, "litellm_tools")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
    assert r.choices[0].finish_reason == "tool_calls"
    r = result(results, "litellm_structured")
    _is_ada(Person.model_validate_json(r.choices[0].message.content))
    assert r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0
