"""Agent frameworks and client libraries against a running server: a pass/fail matrix.

    pip install -e '.[clients]'          # in a venv of its own: these are not test dependencies
    kvserve serve &                      # in kvserve's venv
    python -m bench.clients --base-url http://127.0.0.1:8000/v1 [--model NAME]

    # a thinking model's reasoning and tool calls, as the openai SDK, the Agents SDK and LangChain read them
    python -m bench.thinking --save-model deepseek_r1 /tmp/r1 && kvserve serve --model /tmp/r1 --max-reasoning-tokens 16 &
    python -m bench.clients --thinking --model deepseek_r1

Each case runs one client the way its documentation shows (instructor TOOLS and JSON_SCHEMA;
pydantic-ai text, structured output and a tool; litellm plain, streamed, json_schema and tools;
LangChain `with_structured_output` and `bind_tools`; the OpenAI Agents SDK with its chat
completions model, plain and with a tool) and is reported as

* `pass`;
* `server` — the client could not complete the request: an error status, a response it could
  not parse, a structured output that does not validate. These are kvserve's to fix;
* `model` — a well-formed response whose content is not what the prompt asked for (no tool
  call where one was asked for, an empty field, a wrong answer): the served model's limits
  (the default SmolLM2-135M is tiny);
* `missing` — the client library is not installed.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import time
import traceback
from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, Field

CITY_PROMPT = "Describe Paris: its name and its country."
WEATHER_PROMPT = "What is the weather in Paris? Use the get_weather tool."
WEATHER_ANSWER = "18 C and sunny"


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


class ModelMiss(Exception):
    """A well-formed answer with the wrong content: the model's failure, not the server's."""


def expect(condition: bool, what: str) -> None:
    if not condition:
        raise ModelMiss(what)


def check_city(city: City) -> None:
    assert isinstance(city, City), f"not a City: {city!r}"  # the library's own parsing: the server's
    expect(bool(city.name.strip()), "empty name")


def get_weather(city: str) -> str:
    """Current weather in a city."""
    return WEATHER_ANSWER


class Cases:
    def __init__(self, base_url: str, model: str, max_tokens: int) -> None:
        self.base_url, self.model, self.max_tokens = base_url, model, max_tokens

    # ---------------------------------------------------------------- instructor

    def instructor(self, mode_name: str) -> None:
        import instructor
        from openai import OpenAI

        client = instructor.from_openai(OpenAI(base_url=self.base_url, api_key="unused"), mode=getattr(instructor.Mode, mode_name))
        city = client.chat.completions.create(
            model=self.model, response_model=City, max_retries=0, temperature=0, max_tokens=self.max_tokens,
            messages=[{"role": "user", "content": CITY_PROMPT}])
        check_city(city)

    # ---------------------------------------------------------------- pydantic-ai

    def _pydantic_agent(self, **kwargs):
        from pydantic_ai import Agent
        from pydantic_ai.providers.openai import OpenAIProvider

        try:
            from pydantic_ai.models.openai import OpenAIChatModel
        except ImportError:  # pydantic-ai < 1.0
            from pydantic_ai.models.openai import OpenAIModel as OpenAIChatModel
        model = OpenAIChatModel(self.model, provider=OpenAIProvider(base_url=self.base_url, api_key="unused"))
        return Agent(model, model_settings={"temperature": 0, "max_tokens": self.max_tokens}, **kwargs)

    def pydantic_ai_text(self) -> None:
        out = self._pydantic_agent().run_sync("Say hello in one short sentence.").output
        expect(isinstance(out, str) and out.strip() != "", "empty reply")

    def pydantic_ai_structured(self) -> None:
        check_city(self._pydantic_agent(output_type=City).run_sync(CITY_PROMPT).output)

    def pydantic_ai_tool(self) -> None:
        called = []
        agent = self._pydantic_agent()

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """Current weather in a city."""
            called.append(city)
            return WEATHER_ANSWER

        from pydantic_ai.usage import UsageLimits

        try:
            out = agent.run_sync(WEATHER_PROMPT, usage_limits=UsageLimits(request_limit=4)).output
        except Exception as exc:
            if type(exc).__name__ in ("UsageLimitExceeded", "UnexpectedModelBehavior"):
                raise ModelMiss(f"{type(exc).__name__}: {exc}") from None
            raise
        expect(bool(called), "the tool was not called")
        expect(isinstance(out, str), "no final answer")

    # ---------------------------------------------------------------- litellm

    def _litellm(self, **kwargs):
        import litellm

        return litellm.completion(
            model=f"openai/{self.model}", api_base=self.base_url, api_key="unused", temperature=0,
            max_tokens=self.max_tokens, **kwargs)

    def litellm_plain(self) -> None:
        out = self._litellm(messages=[{"role": "user", "content": "Say hello."}])
        expect(bool(out.choices[0].message.content), "empty reply")

    def litellm_streamed(self) -> None:
        chunks = list(self._litellm(messages=[{"role": "user", "content": "Say hello."}], stream=True))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        expect(bool(text), "empty reply")

    def litellm_json_schema(self) -> None:
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": City.model_json_schema(), "strict": True}}
        out = self._litellm(messages=[{"role": "user", "content": CITY_PROMPT}], response_format=fmt)
        check_city(City.model_validate_json(out.choices[0].message.content))

    def litellm_tools(self) -> None:
        tool = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
        out = self._litellm(messages=[{"role": "user", "content": WEATHER_PROMPT}], tools=[tool], tool_choice="required")
        calls = out.choices[0].message.tool_calls
        assert calls, "tool_choice required gave no tool call"
        expect(calls[0].function.name == "get_weather", f"called {calls[0].function.name}")

    # ---------------------------------------------------------------- LangChain

    def _langchain(self):
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(model=self.model, base_url=self.base_url, api_key="unused", temperature=0, max_tokens=self.max_tokens, max_retries=0)

    def langchain_structured(self) -> None:
        check_city(self._langchain().with_structured_output(City).invoke(CITY_PROMPT))

    def langchain_bind_tools(self) -> None:
        from langchain_core.tools import tool

        message = self._langchain().bind_tools([tool(get_weather)]).invoke(WEATHER_PROMPT)
        assert not message.invalid_tool_calls, message.invalid_tool_calls
        expect(bool(message.tool_calls), "no tool call under tool_choice auto")
        expect(message.tool_calls[0]["name"] == "get_weather", f"called {message.tool_calls[0]['name']}")

    # ---------------------------------------------------------------- OpenAI Agents SDK

    def _agents_run(self, tools: list) -> object:
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled
        from openai import AsyncOpenAI

        set_tracing_disabled(True)
        model = OpenAIChatCompletionsModel(model=self.model, openai_client=AsyncOpenAI(base_url=self.base_url, api_key="unused"))
        agent = Agent(name="assistant", instructions="You are a helpful assistant.", model=model, tools=tools,
                      model_settings=ModelSettings(temperature=0, max_tokens=self.max_tokens))
        prompt = WEATHER_PROMPT if tools else "Say hello."
        try:
            return asyncio.run(Runner.run(agent, prompt, max_turns=4))
        except Exception as exc:
            if type(exc).__name__ == "MaxTurnsExceeded":
                raise ModelMiss(f"MaxTurnsExceeded: {exc}") from None
            raise

    def agents_plain(self) -> None:
        result = self._agents_run([])
        expect(bool(str(result.final_output).strip()), "empty reply")

    def agents_tool(self) -> None:
        from agents import function_tool

        called = []

        @function_tool
        def get_weather(city: str) -> str:
            """Current weather in a city."""
            called.append(city)
            return WEATHER_ANSWER

        result = self._agents_run([get_weather])
        expect(bool(called), "the tool was not called")
        expect(result.final_output is not None, "no final answer")


class ThinkingCases(Cases):
    """A thinking model's reasoning and tool calls as each client reads them (a server whose
    model has reasoning markers and a thinking budget: `bench.thinking --save-model`)."""

    def _sdk(self):
        from openai import OpenAI

        return OpenAI(base_url=self.base_url, api_key="unused", max_retries=0)

    def sdk_chat(self) -> None:
        message = self._sdk().chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0, max_tokens=self.max_tokens).choices[0].message
        extra = message.model_extra or {}
        assert extra.get("reasoning_content") and extra.get("reasoning") == extra["reasoning_content"], "no reasoning_content"
        assert "<think>" not in (message.content or "") and "</think>" not in (message.content or ""), "markers in content"

    def sdk_stream(self) -> None:
        stream = self._sdk().chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0, max_tokens=self.max_tokens, stream=True)
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in stream if c.choices)
        assert reasoning, "no reasoning_content deltas"

    def sdk_responses(self) -> None:
        out = self._sdk().responses.create(model=self.model, input="What is 2 + 2?", temperature=0, max_output_tokens=self.max_tokens)
        kinds = [item.type for item in out.output]
        assert kinds[0] == "reasoning" and out.output[0].content[0].text, f"output items {kinds}"
        assert out.usage.output_tokens_details.reasoning_tokens > 0, "no reasoning_tokens"

    def sdk_tool(self) -> None:
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}
        message = self._sdk().chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": WEATHER_PROMPT}], tools=[tool], tool_choice="required",
            temperature=0, max_tokens=self.max_tokens).choices[0].message
        assert (message.model_extra or {}).get("reasoning_content"), "no reasoning before the call"
        assert message.tool_calls and message.tool_calls[0].function.name == "get_weather", "no call"

    def _agents(self, tools: list, responses: bool):
        from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, set_tracing_disabled
        from openai import AsyncOpenAI

        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=self.base_url, api_key="unused")
        kind = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
        model = kind(model=self.model, openai_client=client)
        settings = ModelSettings(temperature=0, max_tokens=self.max_tokens, tool_choice="required" if tools else None)
        # NOTE: the run ends at the tool's result: a random-weight model's text answer after it never ends
        agent = Agent(name="assistant", instructions="You are a helpful assistant.", model=model, tools=tools, model_settings=settings,
                      tool_use_behavior="stop_on_first_tool")
        return asyncio.run(Runner.run(agent, WEATHER_PROMPT if tools else "What is 2 + 2?", max_turns=4))

    def agents_chat(self) -> None:
        result = self._agents([], responses=False)
        kinds = [item.type for item in result.new_items]
        assert "reasoning_item" in kinds, f"items {kinds}"

    def agents_responses_tool(self) -> None:
        from agents import function_tool

        called = []

        @function_tool
        def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
            """Current weather in a city."""
            called.append(city)
            return WEATHER_ANSWER

        # NOTE: a bounded string: a random-weight model's greedy string never closes by itself
        result = self._agents([get_weather], responses=True)
        kinds = [item.type for item in result.new_items]
        assert "reasoning_item" in kinds and called, f"items {kinds}"

    def langchain_responses(self) -> None:
        from langchain_openai import ChatOpenAI

        llm = ChatOpenAI(model=self.model, base_url=self.base_url, api_key="unused", temperature=0, max_tokens=self.max_tokens,
                         max_retries=0, use_responses_api=True, reasoning={"effort": "high", "summary": "auto"})
        message = llm.invoke("What is 2 + 2?")
        blocks = [b for b in message.content_blocks if b["type"] == "reasoning"]
        assert blocks and blocks[0].get("reasoning"), f"blocks {[b['type'] for b in message.content_blocks]}"

    def langchain_tools(self) -> None:
        from langchain_core.tools import StructuredTool

        class Where(BaseModel):
            city: str = Field(max_length=20)  # bounded: a random-weight model's greedy string never closes by itself

        weather = StructuredTool.from_function(get_weather, args_schema=Where)
        message = self._langchain().bind_tools([weather], tool_choice="any").invoke(WEATHER_PROMPT)
        assert not message.invalid_tool_calls, message.invalid_tool_calls
        assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather", "no call"


THINKING_CASES: list[tuple[str, str, str, Callable[[Cases], None]]] = [
    ("openai SDK", "chat: reasoning_content", "openai", ThinkingCases.sdk_chat),
    ("openai SDK", "chat streamed: reasoning deltas", "openai", ThinkingCases.sdk_stream),
    ("openai SDK", "responses: reasoning item", "openai", ThinkingCases.sdk_responses),
    ("openai SDK", "forced call after thinking", "openai", ThinkingCases.sdk_tool),
    ("Agents SDK", "chat completions: reasoning item", "agents", ThinkingCases.agents_chat),
    ("Agents SDK", "responses: reasoning + a tool", "agents", ThinkingCases.agents_responses_tool),
    ("LangChain", "responses API: reasoning block", "langchain_openai", ThinkingCases.langchain_responses),
    ("LangChain", "bind_tools (forced) after thinking", "langchain_openai", ThinkingCases.langchain_tools),
]

CASES: list[tuple[str, str, str, Callable[[Cases], None]]] = [
    # (client, case, module that must be importable, run)
    ("instructor", "TOOLS", "instructor", lambda c: c.instructor("TOOLS")),
    ("instructor", "JSON_SCHEMA", "instructor", lambda c: c.instructor("JSON_SCHEMA")),
    ("pydantic-ai", "text", "pydantic_ai", Cases.pydantic_ai_text),
    ("pydantic-ai", "structured output", "pydantic_ai", Cases.pydantic_ai_structured),
    ("pydantic-ai", "a tool", "pydantic_ai", Cases.pydantic_ai_tool),
    ("litellm", "plain", "litellm", Cases.litellm_plain),
    ("litellm", "streamed", "litellm", Cases.litellm_streamed),
    ("litellm", "json_schema", "litellm", Cases.litellm_json_schema),
    ("litellm", "tools", "litellm", Cases.litellm_tools),
    ("LangChain", "with_structured_output", "langchain_openai", Cases.langchain_structured),
    ("LangChain", "bind_tools", "langchain_openai", Cases.langchain_bind_tools),
    ("Agents SDK", "chat completions model", "agents", Cases.agents_plain),
    ("Agents SDK", "a tool", "agents", Cases.agents_tool),
]


def run_case(cases: Cases, module: str, run: Callable[[Cases], None]) -> tuple[str, str, float]:
    """(verdict, detail, seconds): pass | server | model | missing."""
    if importlib.util.find_spec(module) is None:
        return "missing", f"pip install the {module} package", 0.0
    t0 = time.perf_counter()
    try:
        run(cases)
        return "pass", "", time.perf_counter() - t0
    except ModelMiss as exc:
        return "model", str(exc)[:160], time.perf_counter() - t0
    except Exception as exc:  # anything the client raised: the request failed on the wire
        detail = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:160]
        if traceback.extract_tb(exc.__traceback__)[-1].filename == __file__:  # our own assert on the shape
            detail = "shape: " + detail
        return "server", detail, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--max-tokens", type=int, default=120)
    parser.add_argument("--only", nargs="*", default=(), help="run only these clients (e.g. litellm LangChain)")
    parser.add_argument("--thinking", action="store_true", help="the thinking-model cases (reasoning and tool calls)")
    args = parser.parse_args()
    cases = (ThinkingCases if args.thinking else Cases)(args.base_url, args.model, args.max_tokens)
    rows = []
    for client, case, module, run in THINKING_CASES if args.thinking else CASES:
        if args.only and client not in args.only:
            continue
        verdict, detail, seconds = run_case(cases, module, run)
        rows.append((client, case, verdict, detail))
        print(f"{client:12} {case:24} {verdict:8} {seconds:6.1f} s  {detail}", flush=True)
    print("\n| client | case | result | detail |\n|---|---|---|---|")
    for client, case, verdict, detail in rows:
        print(f"| {client} | {case} | {verdict} | {detail.replace('|', '/')} |")
    counts = {v: sum(r[2] == v for r in rows) for v in ("pass", "server", "model", "missing")}
    print("\n" + ", ".join(f"{n} {v}" for v, n in counts.items()))


if __name__ == "__main__":
    main()
