"""POST /tokenize and /detokenize (vLLM's shape) on the default model: a prompt's ids are the
tokenizer's; a conversation's are what a chat request with the same messages prefills (its
usage counts them); ids come back to the same text; bad bodies are 400s in OpenAI's shape."""

from __future__ import annotations

import pytest

from tests.server.test_api import assert_error_shape

pytestmark = pytest.mark.anyio
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


async def test_a_prompt_is_the_tokenizers_and_comes_back_as_text(app_client, smollm2):
    prompt = "The quick brown fox jumps over the lazy dog."
    async with app_client() as client:
        out = (await client.post("/tokenize", json={"model": smollm2.model_id, "prompt": prompt, "return_token_strs": True})).json()
        assert out["tokens"] == smollm2.tokenizer(prompt)["input_ids"] and out["count"] == len(out["tokens"])
        assert out["max_model_len"] > 0 and out["token_strs"] == smollm2.tokenizer.convert_ids_to_tokens(out["tokens"])
        back = await client.post("/detokenize", json={"tokens": out["tokens"]})
        assert back.status_code == 200 and back.json() == {"prompt": prompt}


async def test_a_conversation_counts_what_chat_prefills(app_client, smollm2):
    """The same messages (and tools) through /tokenize and /v1/chat/completions: the count is
    the chat request's prompt_tokens; without the generation prompt it is shorter, and with the
    last message left open the text ends inside it."""
    async with app_client() as client:
        counts = {}
        for tools in (None, [WEATHER]):
            extra = {"tools": tools} if tools else {}
            counted = (await client.post("/tokenize", json={"messages": ASK, **extra})).json()
            chat = (await client.post("/v1/chat/completions", json={"model": smollm2.model_id, "messages": ASK, "max_tokens": 1,
                                                                    **extra})).json()
            assert counted["count"] == chat["usage"]["prompt_tokens"], tools
            counts[bool(tools)] = counted["count"]
        assert counts[True] > counts[False]  # the tools are in the prompt
        bare = (await client.post("/tokenize", json={"messages": ASK, "add_generation_prompt": False})).json()
        assert bare["count"] < counts[False]
        draft = ASK + [{"role": "assistant", "content": "Deep blue, like"}]
        open_ = (await client.post("/tokenize", json={"messages": draft, "continue_final_message": True})).json()
        assert smollm2.tokenizer.decode(open_["tokens"]).endswith("Deep blue, like")


async def test_bad_bodies_are_400s_and_a_wrong_model_404(app_client, smollm2):
    vocab = len(smollm2.tokenizer)
    async with app_client() as client:
        cases = [
            ("/tokenize", {"prompt": "a", "messages": ASK}, 400, "invalid_request_error"),
            ("/tokenize", {}, 400, "invalid_request_error"),
            ("/tokenize", {"messages": ASK, "add_generation_prompt": True, "continue_final_message": True}, 400, "invalid_request_error"),
            ("/detokenize", {"tokens": [1, vocab + 5]}, 400, "invalid_value"),
            ("/detokenize", {"tokens": []}, 400, "invalid_request_error"),
            ("/tokenize", {"model": "gpt-4o", "prompt": "a"}, 404, "model_not_found"),
        ]
        for path, body, status, code in cases:
            response = await client.post(path, json=body)
            assert response.status_code == status, (path, body, response.text)
            error = response.json()["error"]
            assert code in (error["code"], error["type"]), (path, body, error)
        # what chat itself refuses in a conversation is a 400 here too, never a 500
        huge = {"type": "function", "function": {"name": "f", "description": "x" * 600_000, "parameters": {"type": "object"}}}
        too_big = await client.post("/tokenize", json={"messages": ASK, "tools": [huge]})
        assert_error_shape(too_big, 400)
        assert "tools" in too_big.json()["error"]["message"]
        picture = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
        refused = await client.post("/tokenize", json={"messages": [{"role": "user", "content": [picture]}]})
        assert_error_shape(refused, 400, "images_not_supported")
