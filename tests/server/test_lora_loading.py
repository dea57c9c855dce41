"""LoRA adapters loaded and unloaded at run time over HTTP (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter, vLLM's names and bodies), more adapters than device slots swapped in
turn, and each adapter's sessions across a restart with the disk tier. A tiny random llama and
PEFT adapters with random (non-zero) weights, built here; the official openai client."""

from __future__ import annotations

import asyncio
import copy
import os

import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file

from tests.server.test_families import generate, prompt_of, tiny
from tests.server.test_lora_api import BASE_ID, TARGETS, assert_same_tokens, complete, loaded
from tests.inprocess import openai_client

KEY = "sk-lora-admin"


def save_adapter(root, name: str, seed: int, base=None, r: int = 8, targets=TARGETS):
    """A PEFT adapter of `base` (default: tiny()) saved as root/name; (its path, the PEFT model)."""
    torch.manual_seed(seed)
    peft_model = get_peft_model(copy.deepcopy(base if base is not None else tiny()), LoraConfig(
        r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False)).eval()
    path = root / name
    peft_model.save_pretrained(path)
    return path, peft_model


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory):
    """--lora-dir with good adapters a, b and c, and one bad adapter of each kind."""
    root = tmp_path_factory.mktemp("lora_dir")
    models = {name: save_adapter(root, name, seed)[1] for seed, name in enumerate(("a", "b", "c"), start=1)}
    save_adapter(root, "other_base", 4, base=tiny(hidden_size=96))
    save_adapter(root, "rank32", 5, r=32)
    path, _ = save_adapter(root, "no_such_layer", 6)
    weights = path / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    for key in [k for k in tensors if ".q_proj." in k]:
        tensors[key.replace(".q_proj.", ".w_qkv.")] = tensors.pop(key)
    save_file(tensors, str(weights))
    path, _ = save_adapter(root, "corrupt", 7)
    (path / "adapter_model.safetensors").write_bytes(b"\0" * 100)
    (root / "empty").mkdir()
    outside = tmp_path_factory.mktemp("elsewhere")
    save_adapter(outside, "x", 8)
    os.symlink(outside / "x", root / "link_out")
    return root, models, outside / "x"


def serving(tokenizer, lora_dir, **settings):
    return openai_client(loaded(tokenizer), enable_lora_loading=True, lora_dir=str(lora_dir[0]), kv_budget_bytes=2**26,
                         api_key=[KEY], **settings)


async def post(http, path: str, body: dict, key: str | None = KEY):
    return await http.post(path, json=body, headers={"Authorization": f"Bearer {key}"} if key else {})


async def metric(http, name: str, **labels) -> float:
    text = (await http.get("/metrics", headers={"Authorization": f"Bearer {KEY}"})).text
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


@pytest.mark.anyio
async def test_the_routes_are_closed_without_enable_lora_loading(tokenizer, lora_dir):
    async with openai_client(loaded(tokenizer), kv_budget_bytes=2**26) as (_, http):
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            response = await http.post(path, json={"lora_name": "a", "lora_path": str(lora_dir[0] / "a")})
            assert response.status_code == 404 and "error" in response.json()
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"]] == [BASE_ID]


@pytest.mark.anyio
async def test_load_serve_refuse_and_unload_at_run_time(tokenizer, lora_dir):
    """A load makes the adapter a model of its own giving PEFT's tokens; every bad load is
    refused with its reason while the loaded adapter and its session go on untouched; an
    unload ends it and drops its sessions."""
    root, models, outside = lora_dir
    prompt = prompt_of(12)
    want = generate(models["a"], prompt, 10)
    async with serving(tokenizer, lora_dir, max_loras=2, max_cpu_loras=2, max_lora_rank=16) as (client, http):
        assert (await post(http, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"}, key=None)).status_code == 401
        document = (await http.get("/openapi.json", headers={"Authorization": f"Bearer {KEY}"})).json()  # the routes are described
        assert set(document["paths"]["/v1/load_lora_adapter"]["post"]["responses"]) == {"200", "400", "401", "409", "503", "507"}
        loaded_a = await post(http, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"})  # relative to --lora-dir
        assert loaded_a.status_code == 200 and loaded_a.text == "Success: LoRA adapter 'a' added successfully."
        cards = (await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).json()["data"]
        assert [(c["id"], c.get("parent")) for c in cards] == [(BASE_ID, None), ("a", BASE_ID)]
        assert_same_tokens(models["a"], tokenizer, prompt, await complete(client.with_options(api_key=KEY), "a", prompt), want)

        chat = client.with_options(api_key=KEY)
        session = {"X-Session-ID": "s1"}
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        first = await chat.chat.completions.create(model="a", messages=messages, max_tokens=4, temperature=0, extra_headers=session)

        refusals = [
            ({"lora_name": "a", "lora_path": "b"}, 409, "lora_name_clash"),
            ({"lora_name": BASE_ID, "lora_path": "b"}, 409, "lora_name_clash"),
            ({"lora_name": "bad name", "lora_path": "b"}, 400, "lora_name"),
            ({"lora_name": "o", "lora_path": str(outside)}, 400, "lora_path"),
            ({"lora_name": "o", "lora_path": "../elsewhere/x"}, 400, "lora_path"),
            ({"lora_name": "o", "lora_path": "link_out"}, 400, "lora_path"),
            ({"lora_name": "o", "lora_path": "other_base"}, 400, "lora_shapes"),
            ({"lora_name": "o", "lora_path": "rank32"}, 400, "lora_rank"),
            ({"lora_name": "o", "lora_path": "no_such_layer"}, 400, "lora_targets"),
            ({"lora_name": "o", "lora_path": "corrupt"}, 400, "lora_corrupt"),
            ({"lora_name": "o", "lora_path": "empty"}, 400, "lora_not_found"),
            ({"lora_name": "o", "lora_path": "missing"}, 400, "lora_not_found"),
        ]
        for body, status, code in refusals:
            response = await post(http, "/v1/load_lora_adapter", body)
            assert response.status_code == status, (body, response.text)
            assert response.json()["error"]["code"] == code, (body, response.json())
        assert (await post(http, "/v1/load_lora_adapter", {"lora_name": "b", "lora_path": "b"})).status_code == 200
        full = await post(http, "/v1/load_lora_adapter", {"lora_name": "c", "lora_path": str(root / "c")})  # --max-cpu-loras 2
        assert full.status_code == 507 and full.json()["error"]["code"] == "lora_too_many"
        assert await metric(http, "kvserve_lora_loads_total", action="load", result="shapes") == 1

        # the refusals changed nothing: a's session goes on, reused
        again = messages + [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "And the sky?"}]
        second = await chat.chat.completions.create(model="a", messages=again, max_tokens=4, temperature=0, extra_headers=session)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
        listed = (await http.get("/v1/sessions", headers={"Authorization": f"Bearer {KEY}"})).json()["data"]
        assert [(s["id"], s["model"]) for s in listed if not s["anonymous"]] == [("s1", "a")]  # and the completion's anonymous prefix

        unloaded = await post(http, "/v1/unload_lora_adapter", {"lora_name": "a"})
        assert unloaded.status_code == 200 and unloaded.text == "Success: LoRA adapter 'a' removed successfully."
        assert (await post(http, "/v1/unload_lora_adapter", {"lora_name": "a"})).status_code == 404
        gone = await http.post("/v1/completions", json={"model": "a", "prompt": "Hi", "max_tokens": 2}, headers={"Authorization": f"Bearer {KEY}"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "model_not_found"
        assert (await http.get("/v1/sessions", headers={"Authorization": f"Bearer {KEY}"})).json()["data"] == []  # anonymous ones too
        assert [m["id"] for m in (await http.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"})).json()["data"]] == [BASE_ID, "b"]

        # loaded again from the same files: the dropped session is gone (nothing reused)
        assert (await post(http, "/v1/load_lora_adapter", {"lora_name": "a", "lora_path": "a"})).status_code == 200
        third = await chat.chat.completions.create(model="a", messages=again, max_tokens=4, temperature=0, extra_headers=session)
        assert third.usage.prompt_tokens_details.cached_tokens == 0
        assert third.choices[0].message.content == second.choices[0].message.content


@pytest.mark.anyio
async def test_more_adapters_than_device_slots_take_turns_and_keep_their_tokens(tokenizer, lora_dir):
    """--max-loras 1: three adapters and the base, mixed concurrently; each gives PEFT's tokens,
    the slot is swapped, and the llm-d gauge names the adapters."""
    root, models, _ = lora_dir
    prompt = prompt_of(10, 3)
    wants = {name: generate(models[name], prompt, 10) for name in ("a", "b", "c")}
    wants[BASE_ID] = generate(tiny(), prompt, 10)
    adapters = [f"{name}={root / name}" for name in ("a", "b", "c")]
    async with openai_client(loaded(tokenizer), lora=adapters, max_loras=1, kv_budget_bytes=2**26) as (client, http):
        names = ["a", "b", BASE_ID, "c", "a", "b"]
        gots = await asyncio.gather(*(complete(client, name, prompt) for name in names))
        for name, got in zip(names, gots):
            assert_same_tokens(models.get(name) or tiny(), tokenizer, prompt, got, wants[name])
        assert await metric(http, "kvserve_lora_swaps_total") >= 2
        assert await metric(http, "kvserve_lora_slots") == 1 and await metric(http, "kvserve_lora_adapters_loaded") == 3
        assert await metric(http, "kvserve_lora_requests_total", adapter="a") == 2
        text = (await http.get("/metrics")).text
        assert 'vllm:lora_requests_info{max_lora="1"' in text


@pytest.mark.anyio
async def test_a_restart_with_the_disk_tier_restores_each_adapter_s_sessions(tokenizer, lora_dir, tmp_path):
    """The same session id on two adapters: two files on disk; after a restart each adapter's
    next turn reuses its own history, restored from disk."""
    root, _, _ = lora_dir
    settings = dict(lora=[f"a={root / 'a'}", f"b={root / 'b'}"], kv_budget_bytes=2**26, kv_disk_dir=str(tmp_path))
    session = {"X-Session-ID": "shared"}
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    firsts = {}
    async with openai_client(loaded(tokenizer), **settings) as (client, _):
        for name in ("a", "b"):
            firsts[name] = await client.chat.completions.create(model=name, messages=messages, max_tokens=4, temperature=0, extra_headers=session)
    assert len(list(tmp_path.glob("*.kv"))) == 2
    async with openai_client(loaded(tokenizer), **settings) as (client, http):
        listed = (await http.get("/v1/sessions", headers=session)).json()["data"]
        assert sorted((s["model"], s["tier"]) for s in listed) == [("a", "disk"), ("b", "disk")]
        for name in ("a", "b"):
            again = messages + [{"role": "assistant", "content": firsts[name].choices[0].message.content},
                                {"role": "user", "content": "And the sky?"}]
            raw = await client.chat.completions.with_raw_response.create(model=name, messages=again, max_tokens=4, temperature=0, extra_headers=session)
            out = raw.parse()
            assert raw.headers.get("x-cache-miss-reason") == "restored_disk", name
            assert out.usage.prompt_tokens_details.cached_tokens >= firsts[name].usage.prompt_tokens
