"""Structured output end to end: a real server, the official openai SDK's own helpers."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"


class Pet(BaseModel):
    kind: Literal["cat", "dog", "bird"]
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=30)


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_parse_returns_the_pydantic_object(client):
    out = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe a pet."}], response_format=Pet, temperature=0, max_tokens=60,
    )
    parsed = out.choices[0].message.parsed
    assert isinstance(parsed, Pet)
    assert out.choices[0].finish_reason == "stop"


def test_json_schema_plain_and_streamed(client):
    schema = Pet.model_json_schema()
    fmt = {"type": "json_schema", "json_schema": {"name": "pet", "schema": schema, "strict": True}}
    messages = [{"role": "user", "content": "Give me a pet as JSON."}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=0, max_tokens=60)
    jsonschema.validate(json.loads(plain.choices[0].message.content), schema)
    text = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, temperature=0, max_tokens=60, stream=True)
        if c.choices
    )
    assert text == plain.choices[0].message.content


def test_tool_calls(client):
    tools = [{
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}}, "required": ["query"], "additionalProperties": False},
        },
    }]
    out = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Look up the capital of France."}], tools=tools, tool_choice="required", temperature=0, max_tokens=60,
        parallel_tool_calls=False,  # SmolLM2 repeats the call until max_tokens when it may make several
    )
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "lookup" and "query" in json.loads(call.function.arguments)
    # the call goes back into the conversation, with the tool's answer
    follow = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=10, tools=tools, tool_choice="none",
        messages=[
            {"role": "user", "content": "Look up the capital of France."},
            {"role": "assistant", "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": "Paris"},
        ],
    )
    assert follow.choices[0].message.content
