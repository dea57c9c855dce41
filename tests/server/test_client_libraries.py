"""The client libraries issue 53 was found with, in-process on tiny models: the OpenAI Agents
SDK on its Responses model through a turn that a repeated call ends near the token limit, and
LangChain's aggregate of a thinking model's streamed Responses turn."""

from __future__ import annotations

import pytest

from tests import thinking
from tests.inprocess import openai_client
from tests.server.test_tool_calls import hermes_model, hermes_tokenizer  # noqa: F401 - fixtures

pytestmark = pytest.mark.anyio


async def test_the_agents_sdk_runs_the_call_of_a_turn_a_repeat_ended_near_the_limit(hermes_model):
    """Seed 1 writes the one call twice (31 tokens): at a limit a little above that, the
    Responses turn is `completed` with its call, which the SDK runs, where an `incomplete` one
    made it raise ModelBehaviorError."""
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel

    set_tracing_disabled(True)  # nothing leaves the machine

    @function_tool
    def get_time() -> str:
        """The time now."""
        return "10:42"

    async with openai_client(hermes_model) as (client, _):
        for limit in (31, 32, 40, 47):
            agent = Agent(name="clock", model=OpenAIResponsesModel("tiny-hermes", client), tools=[get_time],
                          tool_use_behavior="stop_on_first_tool",
                          model_settings=ModelSettings(temperature=1, max_tokens=limit, tool_choice="required", extra_body={"seed": 1}))
            result = await Runner.run(agent, "What time is it?")
            assert result.final_output == "10:42", limit
            assert [r.usage.output_tokens for r in result.raw_responses] == [31], limit


async def test_langchains_streamed_responses_aggregate_holds_one_reasoning_block(tokenizer):
    """A thinking turn streamed to LangChain on the Responses API: its chunks add up to one
    reasoning block and one text block, equal to the turn's items (the reasoning item was closed
    only after the answer had streamed, and LangChain then held two reasoning blocks)."""
    from langchain_openai import ChatOpenAI

    model = thinking.tiny_model(thinking.family_tokenizer(tokenizer, "deepseek_r1"))
    async with openai_client(model) as (client, http):
        ask = dict(model="tiny-deepseek_r1", input="What is 2 + 2?", temperature=0, max_output_tokens=20,
                   reasoning={"effort": "high", "summary": "auto"}, extra_body={"max_reasoning_tokens": 5})
        whole = await client.responses.create(**ask)
        llm = ChatOpenAI(model="tiny-deepseek_r1", base_url="http://kvserve/v1", api_key="unused", http_async_client=http,
                         max_retries=0, use_responses_api=True, temperature=0, max_tokens=20, reasoning={"effort": "high", "summary": "auto"},
                         extra_body={"max_reasoning_tokens": 5})
        aggregate = None
        async for chunk in llm.astream("What is 2 + 2?"):
            aggregate = chunk if aggregate is None else aggregate + chunk
    reasoning, message = whole.output
    blocks = aggregate.content_blocks
    assert [b["type"] for b in blocks] == ["reasoning", "text"], blocks
    assert blocks[0]["reasoning"] == reasoning.summary[0].text and blocks[1]["text"] == message.content[0].text
