"""/v1/responses over HTTP in-process: stored responses, their owners, 400s naming the param."""

import pytest

from tests.server.test_api import MODEL, assert_error_shape, sample, sse_payloads
from tests.server.test_sessions_api import KEY_A, KEY_B

pytestmark = pytest.mark.anyio


def turn(input, **extra):
    return {"model": MODEL, "input": input, "max_output_tokens": 3, "temperature": 0, **extra}


async def test_retrieve_input_items_delete_store_false_and_400s(app_client):
    async with app_client() as client:
        created = (await client.post("/v1/responses", json=turn("Say hello.", metadata={"k": "v"}))).json()
        rid = created["id"]
        assert created["object"] == "response" and created["store"] is True and created["metadata"] == {"k": "v"}
        assert (await client.get(f"/v1/responses/{rid}")).json() == created
        items = (await client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc"})).json()
        assert [(i["type"], i["role"], i["content"]) for i in items["data"]] == [("message", "user", [{"type": "input_text", "text": "Say hello."}])]
        assert items["has_more"] is False and items["first_id"] == items["data"][0]["id"]
        assert_error_shape(await client.get(f"/v1/responses/{rid}/input_items", params={"limit": 0}), 400, param="limit")

        # the response's session is listed, and goes with the last response that used it
        assert rid in [s["id"] for s in (await client.get("/v1/sessions", headers={"X-Session-ID": rid})).json()["data"]]

        # KV gone, items still stored: the continuation recomputes them, same output
        assert (await client.delete(f"/v1/sessions/{rid}", headers={"X-Session-ID": rid})).status_code == 204
        recomputed = await client.post("/v1/responses", json=turn("More.", previous_response_id=rid, store=False))
        assert recomputed.headers["x-cache-miss-reason"] == "new_session"
        reused = (await client.post("/v1/responses", json=turn("More.", previous_response_id=rid, store=False))).json()
        assert reused["usage"]["input_tokens_details"]["cached_tokens"] == reused["usage"]["input_tokens"] - 1
        assert reused["output"][0]["content"] == recomputed.json()["output"][0]["content"]
        deleted = await client.delete(f"/v1/responses/{rid}")
        assert deleted.status_code == 200 and deleted.json() == {"id": rid, "object": "response.deleted", "deleted": True}
        assert (await client.get("/v1/sessions", headers={"X-Session-ID": rid})).json()["data"] == []
        for response in (await client.get(f"/v1/responses/{rid}"), await client.delete(f"/v1/responses/{rid}")):
            error = assert_error_shape(response, 404, "response_not_found", "response_id")
            assert rid in error["message"]
        error = assert_error_shape(await client.post("/v1/responses", json=turn("More.", previous_response_id=rid)), 404, "response_not_found", "previous_response_id")
        assert rid in error["message"]

        unstored = (await client.post("/v1/responses", json=turn("Say hello.", store=False))).json()
        assert unstored["store"] is False and unstored["output"] == [{**created["output"][0], "id": unstored["output"][0]["id"]}]
        assert_error_shape(await client.get(f"/v1/responses/{unstored['id']}"), 404, "response_not_found")
        assert_error_shape(await client.post("/v1/responses", json=turn("More.", previous_response_id=unstored["id"])), 404, param="previous_response_id")

        streamed = sse_payloads((await client.post("/v1/responses", json=turn("Say hello.", stream=True, store=False))).text)
        assert streamed[-1]["type"] == "response.incomplete"  # cut at max_output_tokens
        assert streamed[-1]["response"]["output"][0]["content"][0]["text"] == created["output"][0]["content"][0]["text"]

        metrics = (await client.get("/metrics")).text
        assert sample(metrics, "kvserve_response_store_responses") == 0
        assert 'kvserve_response_store_evictions_total{reason="deleted"} 1.0' in metrics
        finished = sum(sample(metrics, f'kvserve_request_finished_total{{finish_reason="{r}",route="/v1/responses"}}') for r in ("stop", "length"))
        assert finished == 5

        for patch, param in INVALID:  # one app for all: each app costs a warm-up
            assert_error_shape(await client.post("/v1/responses", json=turn("Hi.") | patch), 400, param=param)


async def test_two_keys_cannot_see_each_others_responses(app_client):
    async with app_client(api_key=["key-a", "key-b"]) as client:
        rid = (await client.post("/v1/responses", json=turn("A secret."), headers=KEY_A)).json()["id"]
        for method, path, body in (
            ("GET", f"/v1/responses/{rid}", None),
            ("GET", f"/v1/responses/{rid}/input_items", None),
            ("DELETE", f"/v1/responses/{rid}", None),
            ("POST", "/v1/responses", turn("Tell me.", previous_response_id=rid)),
        ):
            response = await client.request(method, path, json=body, headers=KEY_B)
            assert_error_shape(response, 404, "response_not_found")
        assert (await client.get(f"/v1/responses/{rid}", headers=KEY_A)).json()["id"] == rid
        # the stored conversation's session, whatever X-Session-ID says
        continued = await client.post("/v1/responses", json=turn("Tell me.", previous_response_id=rid), headers=KEY_A | {"X-Session-ID": "elsewhere"})
        assert continued.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
        assert_error_shape(await client.get(f"/v1/responses/{rid}"), 401, "invalid_api_key")


INVALID = [
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),  # a text-only model takes no images
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"name": "f"}]}, "tools[0]"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "json_schema", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 9000}, "max_output_tokens"),
    ({"background": True}, "background"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"temperature": 3}, "temperature"),
    ({"prompt_cache_key": "anon-x"}, "prompt_cache_key"),
]


async def test_a_failed_stream_ends_with_response_failed(app_client):
    """A request that runs past its deadline after the stream began: response.failed with the
    error, and nothing is stored."""
    # NOTE: a schema of 400+ numbers cannot complete within the deadline on any machine this runs
    # on (the model alone could end a free reply early, and the test would depend on its speed)
    many = {"type": "object", "required": ["n"],
            "properties": {"n": {"type": "array", "items": {"type": "integer"}, "minItems": 400}}}
    async with app_client(request_timeout_s=1.5) as client:
        body = turn("Count from one to five hundred.", stream=True, max_output_tokens=1000,
                    text={"format": {"type": "json_schema", "name": "numbers", "schema": many}})
        response = await client.post("/v1/responses", json=body)
        events = sse_payloads(response.text)
        assert [e["type"] for e in events][:2] == ["response.created", "response.in_progress"]
        assert [e["sequence_number"] for e in events] == list(range(len(events)))
        assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
        error = events[-1]["response"]["error"]  # one of OpenAI's codes; kvserve's own in the message
        assert error["code"] == "server_error" and error["message"].endswith("(timeout)"), error
        assert_error_shape(await client.get(f"/v1/responses/{events[0]['response']['id']}"), 404)


async def test_a_response_larger_than_the_store_is_not_stored_and_says_so(app_client):
    async with app_client(response_store_bytes=1) as client:
        response = (await client.post("/v1/responses", json=turn("Hi.", max_output_tokens=1))).json()
        assert response["store"] is False and response["status"] == "incomplete"
        assert_error_shape(await client.get(f"/v1/responses/{response['id']}"), 404, "response_not_found")
        # nothing continues in a session named after it either
        assert (await client.get("/v1/sessions", headers={"X-Session-ID": response["id"]})).json()["data"] == []


async def test_a_response_and_its_streamed_events_parse_as_the_sdk_s_typed_models(app_client):
    """The openai SDK's own pydantic models, validated (not `construct`ed as its client does):
    a missing required field fails here (issue 53: `cache_write_tokens`)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    async with app_client() as client:
        whole = (await client.post("/v1/responses", json=turn("Say hello.", store=False))).json()
        streamed = await client.post("/v1/responses", json=turn("Say hello.", store=False, stream=True))
    Response.model_validate(whole)
    events = [TypeAdapter(ResponseStreamEvent).validate_python(e) for e in sse_payloads(streamed.text) if e != "[DONE]"]
    assert events[-1].type == "response.incomplete"  # max_output_tokens 3
    assert events[-1].response.usage.input_tokens_details.cache_write_tokens == 0

