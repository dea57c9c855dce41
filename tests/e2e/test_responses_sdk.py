"""The Responses API end to end: a real `kvserve serve`, the official openai SDK unmodified
(`responses.create/stream/parse/retrieve/delete`, `input_items.list`)."""

from __future__ import annotations

import json

import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from bench.common import launch
from tests.conftest import test_cache_dir as cache_dir

MODEL = "SmolLM2-135M-Instruct"
GREEDY = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}
INSTRUCTIONS = "You answer briefly. " + " ".join(f"Fact {k}: item {k} is {k * 7 % 13} metres long." for k in range(4))
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": False},
    "strict": True,
}


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def items(response) -> list[dict]:
    """A response's output, as input items of a later request."""
    return [item.model_dump(exclude_none=True) for item in response.output]


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def test_three_turns_reuse_the_session_and_equal_the_whole_history(client):
    questions = ["Which item is longest?", "And the shortest?", "How long is item 2?"]
    turns, history = [], []
    for question in questions:
        previous = turns[-1].id if turns else None
        turns.append(client.responses.create(input=question, instructions=INSTRUCTIONS, previous_response_id=previous, **GREEDY))
        history += [user(question), *items(turns[-1])]
    cached = [t.usage.input_tokens_details.cached_tokens for t in turns]
    assert cached[0] == 0 < turns[0].usage.input_tokens <= cached[1] < turns[1].usage.input_tokens <= cached[2], cached
    whole = client.responses.create(input=history[:-1], instructions=INSTRUCTIONS, store=False, **GREEDY)
    assert whole.usage.input_tokens_details.cached_tokens == 0  # a fresh prefill of the same prompt
    assert whole.usage.input_tokens == turns[2].usage.input_tokens
    assert whole.output_text == turns[2].output_text and whole.output_text

    page = client.responses.input_items.list(turns[1].id)
    assert [(i.type, i.role, i.content[0].text) for i in page.data] == [("message", "user", questions[1])]
    assert client.responses.retrieve(turns[2].id).output_text == turns[2].output_text
    client.responses.delete(turns[2].id)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.retrieve(turns[2].id)
    assert err.value.code == "response_not_found"
    # the earlier turns are self-contained: deleting the last one breaks nothing
    again = client.responses.create(input=questions[2], instructions=INSTRUCTIONS, previous_response_id=turns[1].id, **GREEDY)
    assert again.output_text == turns[2].output_text


def test_stream_event_order_and_text_equal_the_non_streamed_result(client):
    question = "What is 2+2? Answer with a number only."
    plain = client.responses.create(input=question, store=False, **GREEDY | {"max_output_tokens": 12})
    assert plain.status == "completed"
    with client.responses.stream(input=question, **GREEDY | {"max_output_tokens": 12}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == plain.output_text == final.output_text
    assert final.usage.output_tokens == plain.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == plain.output_text


class City(BaseModel):
    name: str
    population: int


def test_structured_output_and_parse(client):
    parsed = client.responses.parse(input="Name a big city and its population.", text_format=City, **GREEDY | {"max_output_tokens": 30})
    assert isinstance(parsed.output_parsed, City), parsed.output_text
    loose = client.responses.create(input="A JSON object about a cat.", text={"format": {"type": "json_object"}}, store=False, **GREEDY | {"max_output_tokens": 10})
    assert loose.status == "incomplete" or isinstance(json.loads(loose.output_text), dict)


def test_function_call_round_trip(client):
    ask = {"input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 30,
           "parallel_tool_calls": False}
    with client.responses.stream(**GREEDY | ask) as stream:
        kinds = [e.type for e in stream]
        first = stream.get_final_response()
    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.parsed_arguments == json.loads(call.arguments)
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp_c": 18}'}
    second = client.responses.create(input=[result], previous_response_id=first.id, tools=[WEATHER], **GREEDY)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
    whole = client.responses.create(input=[user(ask["input"]), *items(first), result], tools=[WEATHER], store=False, **GREEDY)
    assert [o.model_dump(exclude={"id", "call_id"}) for o in whole.output] == [o.model_dump(exclude={"id", "call_id"}) for o in second.output]


def test_a_continued_response_after_a_restart_with_the_disk_tier(tmp_path):
    flags = ("--cache-dir", str(cache_dir()), "--kv-disk-dir", str(tmp_path / "kv"))
    with launch(tmp_path, *flags) as server:
        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        first = client.responses.create(input="Which item is longest?", instructions=INSTRUCTIONS, **GREEDY)
    with launch(tmp_path, *flags) as server:
        client = OpenAI(base_url=server.base_url, api_key="none", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        raw = client.responses.with_raw_response.create(input="And the shortest?", instructions=INSTRUCTIONS, previous_response_id=first.id, **GREEDY)
        second = raw.parse()
        assert raw.headers["x-cache-miss-reason"] == "restored_disk"
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        history = [user("Which item is longest?"), *items(first), user("And the shortest?")]
        whole = client.responses.create(input=history, instructions=INSTRUCTIONS, store=False, **GREEDY)
        assert whole.output_text == second.output_text
