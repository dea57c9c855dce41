"""Every bad input a clear 4xx: the reproducers of the hardening issue, one table row each, with
the exact status, `code`, `param` and the key words of the message, then a normal request.

Out of our hands (not tested here): uvicorn answers a malformed request line or header with its
own plain-text 400 before the app sees anything.
"""

from __future__ import annotations

import json
from typing import NamedTuple

import pytest

from server.api.errors import anthropic_path
from tests.server.test_api import HELLO, MODEL, assert_error_shape

pytestmark = pytest.mark.anyio
KEY = "sk-a"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


def chat(**fields) -> dict:
    return {"json": {"model": MODEL, "messages": HELLO, "max_tokens": 2, **fields}}


def completion(**fields) -> dict:
    return {"json": {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields}}


def history(*messages) -> dict:
    """A chat with tools whose earlier turns are `messages`."""
    return chat(tools=TOOLS, messages=[*HELLO, *messages])


class Case(NamedTuple):
    method: str
    path: str
    request: dict
    status: int
    code: str | None
    param: str | None
    words: tuple[str, ...]


CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
CASES = {
    # 1. malformed history entries: 400 naming the part, never a 500
    "tool_call_function_not_object": Case(
        "POST", CHAT, history({"role": "assistant", "tool_calls": [{"function": "oops"}]}),
        400, "invalid_value", "messages[1].tool_calls[0].function", ("JSON object",)),
    "tool_call_without_name": Case(
        "POST", CHAT, history({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}),
        400, "invalid_value", "messages[1].tool_calls[0].function.name", ("required",)),
    "tool_calls_on_a_user_message": Case(
        "POST", CHAT, history({"role": "user", "content": "x", "tool_calls": []}),
        400, "invalid_value", "messages[1].tool_calls", ("only assistant",)),
    "tool_message_without_tool_call_id": Case(
        "POST", CHAT, history({"role": "tool", "content": "Paris"}),
        400, "invalid_value", "messages[1].tool_call_id", ("required", "tool")),
    "user_message_without_content": Case(
        "POST", CHAT, history({"role": "user"}),
        400, "invalid_value", "messages[1].content", ("required", "user")),
    "image_content_part": Case(  # the default model is text-only
        "POST", CHAT, chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        400, "images_not_supported", "messages[0].content[0]", ("takes no images",)),
    # 7. no trailing-slash redirect (and so no Location from the Host header): a 404
    "trailing_slash_post": Case(
        "POST", CHAT + "/", {**chat(), "headers": {"Host": "evil.example.com"}},
        404, "not_found", None, ("no route",)),
    "trailing_slash_get": Case(
        "GET", "/health/", {"headers": {"Host": "evil.example.com"}}, 404, "not_found", None, ("no route",)),
    # 9. messages that name the field and the rule
    "empty_body": Case(
        "POST", CHAT, {"content": b"", "headers": {"content-type": "application/json"}},
        400, "invalid_request", None, ("request body is empty",)),
    "null_body": Case(
        "POST", CHAT, {"content": b"null", "headers": {"content-type": "application/json"}},
        400, "invalid_request", None, ("must be a JSON object",)),
    "text_plain_body": Case(
        "POST", CHAT, {"content": json.dumps(chat()["json"]).encode(), "headers": {"content-type": "text/plain"}},
        415, "unsupported_media_type", None, ("Content-Type must be application/json", "text/plain")),
    "five_stop_strings": Case(
        "POST", CHAT, chat(stop=["a", "b", "c", "d", "e"]), 400, "invalid_value", "stop", ("stop:", "at most 4 stop sequences")),
    "65_prompts": Case(
        "POST", COMPLETIONS, completion(prompt=["a"] * 65), 400, "invalid_value", "prompt", ("prompt:", "at most 64 prompts per request")),
    "mixed_prompt_list": Case(
        "POST", COMPLETIONS, completion(prompt=["a", [1, 2]]), 400, "invalid_value", "prompt", ("only strings",)),
    "logit_bias_unicode_digit_completions": Case(
        "POST", COMPLETIONS, completion(logit_bias={"²": 1}), 400, "invalid_value", "logit_bias",
        ("logit_bias:", "keys must be token ids (integers as strings)", "'²'")),
    "logit_bias_unicode_digit_chat": Case(
        "POST", CHAT, chat(logit_bias={"²": 1}), 400, "invalid_value", "logit_bias", ("keys must be token ids", "'²'")),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
async def test_bad_input_is_a_clear_4xx(app_client, case):
    async with app_client(api_key=[KEY]) as client:
        client.headers["Authorization"] = f"Bearer {KEY}"
        response = await client.request(case.method, case.path, **case.request)
        error = assert_error_shape(response, case.status, case.code, case.param)
        assert error["param"] == case.param
        for words in case.words:
            assert words in error["message"], error
        assert "location" not in response.headers
        await assert_still_serving(client)


async def assert_still_serving(client) -> None:
    ok = await client.post(CHAT, **chat())
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
async def test_auth_scheme_is_case_insensitive(app_client, scheme):
    """8. RFC 9110: the scheme is case-insensitive; the key itself is not."""
    async with app_client(api_key=[KEY]) as client:
        assert (await client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY}"})).status_code == 200
        wrong = await client.get("/v1/models", headers={"Authorization": f"{scheme} {KEY.upper()}"})
        assert_error_shape(wrong, 401, "invalid_api_key")
        assert_error_shape(await client.get("/v1/models", headers={"Authorization": f"Basic {KEY}"}), 401, "invalid_api_key")


async def test_head_answers_as_get_without_a_body(app_client):
    """7. HEAD on a GET route: GET's status and headers, no body; on a POST route: 405."""
    async with app_client() as client:
        for path in ("/health", "/v1/models", "/metrics"):
            get, head = await client.get(path), await client.head(path)
            assert head.status_code == get.status_code == 200
            assert head.content == b""
            assert head.headers["content-type"] == get.headers["content-type"]
        head = await client.head(CHAT)
        assert head.status_code == 405 and head.content == b""
        assert head.headers["content-type"] == "application/json"
        await assert_still_serving(client)


async def test_openapi_documents_what_the_server_answers(app_client):
    """11. 400 (not 422) in the error shape, DELETE is 204, 401/404/429 where they apply."""
    async with app_client() as client:
        doc = (await client.get("/openapi.json")).json()
    for path, methods in doc["paths"].items():
        shape = "AnthropicErrorResponse" if anthropic_path(path) else "ErrorResponse"  # the Messages API's own
        for method, operation in methods.items():
            responses = operation["responses"]
            assert "422" not in responses, (method, path)
            for status, response in responses.items():
                if int(status) >= 400:
                    assert response["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{shape}"}, (method, path, status)
    messages = doc["paths"]["/v1/messages"]["post"]["responses"]
    assert "529" in messages and "429" not in messages and "503" not in messages  # Anthropic's overloaded_error
    assert "HTTPValidationError" not in doc["components"]["schemas"]
    delete = doc["paths"]["/v1/sessions/{session_id}"]["delete"]["responses"]
    assert set(delete) == {"204", "401", "404", "409", "503"} and "content" not in delete["204"]
    chat_responses = doc["paths"][CHAT]["post"]["responses"]
    assert {"400", "401", "404", "413", "415", "429"} <= set(chat_responses)
    assert set(chat_responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
