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
        # keyless: the caller presents the session's id to delete it
        assert (await client.delete("/v1/sessions/gone", headers={"X-Session-ID": "gone"})).status_code == 204
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
        busy = {"X-Session-ID": "busy"}  # keyless: admin routes see the presented session only
        for _ in range(500):  # until the first request holds the session
            sessions = (await client.get("/v1/sessions", headers=busy)).json()["data"]
            if any(s["id"] == "busy" and s["in_flight"] for s in sessions):
                break
            await asyncio.sleep(0.02)
        second = await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key="busy"))
        assert_error_shape(second, 409, "session_busy")
        listed = (await client.get("/v1/sessions", headers=busy)).json()["data"]
        assert [s["in_flight"] for s in listed if s["id"] == "busy"] == [True]
        assert_error_shape(await client.delete("/v1/sessions/busy", headers=busy), 409, "session_busy")
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


PER_TOKEN = 2 * 30 * 3 * 64 * 4  # SmolLM2 fp32: KV bytes of one token
BLOCK = 16 * PER_TOKEN  # the pool's unit


async def test_byte_budget_evicts_idle_sessions_and_refuses_what_cannot_fit(app_client):
    # one "Hi" turn (about 35 tokens with max_tokens: 3 blocks) fits, two do not
    async with app_client(kv_budget_bytes=5 * BLOCK, max_model_len=5 * 16) as client:  # the context the budget holds
        short = [{"role": "user", "content": "Hi"}]
        await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="a"))
        await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="b"))  # evicts a
        back = await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="a"))
        assert back.status_code == 200 and back.headers["x-cache-miss-reason"] == "evicted"
        assert [s["id"] for s in (await client.get("/v1/sessions", headers={"X-Session-ID": "a"})).json()["data"]] == ["a"]
        too_big = await client.post("/v1/chat/completions", json=chat(short, prompt_cache_key="c", max_tokens=400))
        assert_error_shape(too_big, 400, "context_length_exceeded")
        text = (await client.get("/metrics")).text
        assert metric(text, 'kvserve_session_evictions_total{reason="evicted"}') == 2
        assert metric(text, "kvserve_kv_cache_bytes_budget") == 5 * BLOCK
        [only] = (await client.get("/v1/sessions", headers={"X-Session-ID": "a"})).json()["data"]
        assert metric(text, "kvserve_kv_cache_bytes_used") == -(-only["tokens"] // 16) * BLOCK
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
        [session] = (await client.get("/v1/sessions", headers={"X-Session-ID": "g"})).json()["data"]
        # the idle session holds the blocks its tokens use, nothing of the turn's reservation
        assert metric(text, "kvserve_kv_cache_bytes_used") == -(-session["tokens"] // 16) * BLOCK


async def test_session_ids_with_slashes_can_be_deleted(app_client):
    """Item 5: any id the API accepts (1-256 characters, `/` included) can be deleted."""
    async with app_client(api_key=["key-a"]) as client:
        messages = [{"role": "user", "content": "Hi"}]
        for sid in ("team/alice", "a/b/c", "100% done?"):
            assert (await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key=sid), headers=KEY_A)).status_code == 200
        assert {"team/alice", "a/b/c", "100% done?"} <= {s["id"] for s in (await client.get("/v1/sessions", headers=KEY_A)).json()["data"]}
        assert (await client.delete("/v1/sessions/team%2Falice", headers=KEY_A)).status_code == 204
        assert (await client.delete("/v1/sessions/a/b/c", headers=KEY_A)).status_code == 204
        assert (await client.delete("/v1/sessions/100%25%20done%3F", headers=KEY_A)).status_code == 204
        assert_error_shape(await client.delete("/v1/sessions/team%2Falice", headers=KEY_A), 404, "session_not_found")
        assert {"team/alice", "a/b/c", "100% done?"}.isdisjoint(s["id"] for s in (await client.get("/v1/sessions", headers=KEY_A)).json()["data"])


async def test_keyless_admin_sees_only_the_presented_session(app_client):
    """Item 6: without API keys every caller shares one principal, so GET and DELETE reach only
    the session named by the caller's X-Session-ID."""
    async with app_client() as client:
        messages = [{"role": "user", "content": "Hi"}]
        for sid in ("alice-7f3a", "bob-91c2"):
            await client.post("/v1/chat/completions", json=chat(messages, prompt_cache_key=sid))
        assert (await client.get("/v1/sessions")).json()["data"] == []
        listed = (await client.get("/v1/sessions", headers={"X-Session-ID": "alice-7f3a"})).json()["data"]
        assert [s["id"] for s in listed] == ["alice-7f3a"]
        # bob cannot delete alice's session, with or without presenting his own
        for headers in ({}, {"X-Session-ID": "bob-91c2"}):
            refused = await client.delete("/v1/sessions/alice-7f3a", headers=headers)
            assert_error_shape(refused, 404, "session_not_found")
            assert "X-Session-ID" in refused.json()["error"]["message"]
        assert (await client.delete("/v1/sessions/alice-7f3a", headers={"X-Session-ID": "alice-7f3a"})).status_code == 204
        assert (await client.get("/v1/sessions", headers={"X-Session-ID": "alice-7f3a"})).json()["data"] == []
        assert [s["id"] for s in (await client.get("/v1/sessions", headers={"X-Session-ID": "bob-91c2"})).json()["data"]] == ["bob-91c2"]


SECRET = "The vault code is 4 8 1 5 1 6 2 3 4 2 9 7. Never tell anyone."


def probe(guess: str) -> list[dict]:
    return [{"role": "user", "content": f"Note for later. The vault code is {guess}"}]


async def test_keyless_prompts_are_not_probed_through_cached_tokens(app_client):
    """Item 6: keyless, anonymous reuse is off by default: a guess learns nothing."""
    async with app_client() as client:
        secret = [{"role": "user", "content": "Note for later. " + SECRET}]
        await client.post("/v1/chat/completions", json=chat(secret))
        for guess in ("4 8 1 5", "4 8 1 6", "9"):
            r = await client.post("/v1/chat/completions", json=chat(probe(guess)))
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert r.headers["x-cache-reused-tokens"] == "0" and r.headers["x-cache-miss-reason"] == "no_session"
        assert (await client.get("/v1/sessions")).json()["data"] == []  # nothing kept for anonymous requests
    async with app_client(anonymous_reuse=True) as client:  # explicitly on: reuse works keyless too
        await client.post("/v1/chat/completions", json=chat(secret))
        again = await client.post("/v1/chat/completions", json=chat(secret))
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 32


async def test_anonymous_reuse_reports_whole_blocks_of_32(app_client, tokenizer):
    """Item 6, with keys: guesses that agree with another request's prompt on different numbers
    of leading tokens report the same, whole-block cached_tokens; named sessions are exact."""
    from cache_manager.prefix import common_prefix_len

    def ids(messages):
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    secret = [{"role": "user", "content": "Note for later. " + SECRET}]
    secret_ids = ids(secret)
    guesses = ["4 8 1 5 1 6 0", "4 8 1 5 1 6 2 3 0", "4 8 1 5 1 6 2 3 4 2 0"]
    exact = [common_prefix_len(secret_ids, ids(probe(g))) for g in guesses]
    assert len(set(exact)) == 3 and len({n // 32 for n in exact}) == 1, exact  # same block, different digits
    async with app_client(api_key=["key-a"]) as client:
        reported = []
        for guess in guesses:
            await client.post("/v1/chat/completions", json=chat(secret), headers=KEY_A)  # the other request
            r = await client.post("/v1/chat/completions", json=chat(probe(guess)), headers=KEY_A)
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert r.headers["x-cache-reused-tokens"] == str(cached)
            reported.append(cached)
        assert reported == [exact[0] // 32 * 32] * 3 and reported[0] > 0
        # the block-aligned reuse still gives the output of a fresh prefill
        fresh = await client.post("/v1/chat/completions", json=chat(probe(guesses[0]), prompt_cache_key="fresh"), headers=KEY_A)
        await client.post("/v1/chat/completions", json=chat(secret), headers=KEY_A)
        reused = await client.post("/v1/chat/completions", json=chat(probe(guesses[0])), headers=KEY_A)
        assert reused.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == reported[0]
        assert reused.json()["choices"][0]["message"]["content"] == fresh.json()["choices"][0]["message"]["content"]
        # a named session is the caller's own history: exact counts
        await client.post("/v1/chat/completions", json=chat(secret, prompt_cache_key="mine"), headers=KEY_A)
        named = await client.post("/v1/chat/completions", json=chat(probe(guesses[1]), prompt_cache_key="mine"), headers=KEY_A)
        assert named.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == exact[1]
