"""Sessions over HTTP: session ids, reporting, isolation between API keys, admin routes."""

import asyncio

import pytest

from tests.server.test_api import MODEL, assert_error_shape

pytestmark = pytest.mark.anyio
KEY_A = {"Authorization": "Bearer key-a"}
KEY_B = {"Authorization": "Bearer key-b"}


def chat(messages, **extra):
    return {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


async def test_two_turns_report_reuse_in_usage_and_headers(app_client):
    async with app_client() as client:
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        first = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="conv-1"))
        assert first.headers["x-cache-reused-tokens"] == "0"
        assert first.headers["x-cache-miss-reason"] == "new_session"
        body = first.json()
        messages += [{"role": "assistant", "content": body["choices"][0]["message"]["content"]}, {"role": "user", "content": "More."}]
        second = await client.post("/v1/chat/completions", json=chat(messages), headers={"X-Session-ID": "conv-1"})
        reused = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert reused > body["usage"]["prompt_tokens"] - 2  # the whole first prompt, and more
        assert second.headers["x-cache-reused-tokens"] == str(reused)
        assert "x-cache-miss-reason" not in second.headers
        # streamed responses carry the same headers, decided before the first byte
        streamed = await client.post("/v1/chat/completions", json=chat(messages, stream=True, prompt_cache_key="conv-1"))
        assert int(streamed.headers["x-cache-reused-tokens"]) == second.json()["usage"]["prompt_tokens"] - 1


async def test_principals_never_share_sessions(app_client):
    async with app_client(api_key=["key-a", "key-b"]) as client:
        messages = [{"role": "user", "content": "A secret conversation."}]
        await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="shared-id"), headers=KEY_A)
        b = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="shared-id"), headers=KEY_B)
        assert b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert b.headers["x-cache-miss-reason"] == "new_session"
        anon_b = await client.post("/v1/chat/completions", json=chat(messages), headers=KEY_B)
        assert anon_b.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # not A's anonymous entries either

        listed_a = (await client.get("/v1/sessions", headers=KEY_A)).json()["data"]
        listed_b = (await client.get("/v1/sessions", headers=KEY_B)).json()["data"]
        assert [s["id"] for s in listed_a] == ["shared-id"]
        assert "shared-id" in [s["id"] for s in listed_b]
        a_entry = listed_a[0]
        assert a_entry["tokens"] > 0 and a_entry["bytes"] > 0 and not a_entry["in_flight"]

        # B deletes its own "shared-id"; A's is untouched
        assert (await client.delete("/v1/sessions/shared-id", headers=KEY_B)).status_code == 204
        assert_error_shape(await client.delete("/v1/sessions/shared-id", headers=KEY_B), 404, "session_not_found")
        assert [s["id"] for s in (await client.get("/v1/sessions", headers=KEY_A)).json()["data"]] == ["shared-id"]
        again = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="shared-id"), headers=KEY_A)
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == again.json()["usage"]["prompt_tokens"] - 1
        assert_error_shape(await client.get("/v1/sessions"), 401, "invalid_api_key")


async def test_deleted_session_starts_over(app_client):
    async with app_client() as client:
        messages = [{"role": "user", "content": "Remember this."}]
        await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="gone"))
        assert (await client.delete("/v1/sessions/gone")).status_code == 204
        after = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="gone"))
        assert after.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert after.headers["x-cache-miss-reason"] == "new_session"


async def test_bad_session_ids_and_busy_sessions(app_client):
    messages = [{"role": "user", "content": "Count slowly to one hundred."}]
    async with app_client(reject_busy_sessions=True) as client:
        assert_error_shape(await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="anon-123")), 400, param="prompt_cache_key")
        assert_error_shape(await client.post("/v1/chat/completions", json=chat(messages), headers={"X-Session-ID": "x" * 300}), 400, param="X-Session-ID")
        long = chat(messages, prompt_cache_key="busy", max_tokens=60, logit_bias={"2": -100})
        first = asyncio.create_task(client.post("/v1/chat/completions", json=long))
        for _ in range(500):  # until the first request holds the session
            sessions = (await client.get("/v1/sessions")).json()["data"]
            if any(s["id"] == "busy" and s["in_flight"] for s in sessions):
                break
            await asyncio.sleep(0.02)
        second = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="busy"))
        assert_error_shape(second, 409, "session_busy")
        listed = (await client.get("/v1/sessions")).json()["data"]
        assert [s["in_flight"] for s in listed if s["id"] == "busy"] == [True]
        assert_error_shape(await client.delete("/v1/sessions/busy"), 409, "session_busy")
        assert (await first).status_code == 200


async def test_reuse_can_be_switched_off(app_client):
    async with app_client(session_reuse=False) as client:
        messages = [{"role": "user", "content": "Same prompt twice."}]
        for _ in range(2):
            r = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="k"))
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert r.headers["x-cache-miss-reason"] == "no_session"
        metrics = (await client.get("/metrics")).text
        assert "kvserve_kv_cache_bytes_used 0.0" in metrics


def metric(text: str, sample: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(sample + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


async def test_byte_budget_evicts_idle_sessions_and_refuses_what_cannot_fit(app_client):
    one_bucket = 256 * 2 * 30 * 3 * 64 * 4  # SmolLM2 fp32: a 256-token cache
    async with app_client(kv_budget_bytes=int(one_bucket * 1.5)) as client:
        short = [{"role": "user", "content": "Hi"}]
        await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="a"))
        await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="b"))  # evicts a
        back = await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="a"))
        assert back.status_code == 200 and back.headers["x-cache-miss-reason"] == "evicted"
        assert [s["id"] for s in (await client.get("/v1/sessions")).json()["data"]] == ["a"]
        too_big = await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="c", max_tokens=400))
        assert_error_shape(too_big, 400, "kv_budget_exceeded")
        text = (await client.get("/metrics")).text
        assert metric(text, 'kvserve_session_evictions_total{reason="evicted"}') == 2
        assert metric(text, "kvserve_kv_cache_bytes_budget") == int(one_bucket * 1.5)
        assert metric(text, "kvserve_kv_cache_bytes_used") == one_bucket
        assert metric(text, "kvserve_sessions_resident") == 1
        assert metric(text, 'kvserve_prefix_cache_misses_total{reason="evicted"}') == 1
        # the server keeps serving
        assert (await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="a"))).status_code == 200


async def test_growth_is_counted(app_client):
    async with app_client() as client:
        messages = [{"role": "user", "content": "Hi"}]
        first = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="g"))
        messages += [{"role": "assistant", "content": first.json()["choices"][0]["message"]["content"]},
                     {"role": "user", "content": "word " * 300}]
        second = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="g"))
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        text = (await client.get("/metrics")).text
        assert metric(text, "kvserve_kv_cache_grows_total") == 1
        assert metric(text, "kvserve_kv_cache_bytes_used") == 512 * 2 * 30 * 3 * 64 * 4


async def test_a_failed_grow_leaves_the_session_usable(app_client):
    one_bucket = 256 * 2 * 30 * 3 * 64 * 4
    async with app_client(kv_budget_bytes=int(one_bucket * 1.5)) as client:
        first = [{"role": "user", "content": "Remember the word lighthouse."}]
        ok = await client.post("/v1/chat/completions", json=chat(first, prompt_cache_key="s"))
        history = first + [{"role": "assistant", "content": ok.json()["choices"][0]["message"]["content"]}]
        # an edited history that needs a 512-token cache: the crop happens, the grow fails
        too_big = [{"role": "user", "content": "word " * 300}]
        assert_error_shape(await client.post("/v1/chat/completions", json=chat(too_big, prompt_cache_key="s")), 400, "kv_budget_exceeded")
        # the session still serves, from what its cache really holds
        again = history + [{"role": "user", "content": "What was the word?"}]
        r = await client.post("/v1/chat/completions", json=chat(again, prompt_cache_key="s"))
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
