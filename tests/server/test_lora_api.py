"""LoRA adapters over HTTP (--lora NAME=PATH): each adapter is a model of its own in `/v1/models`
and in a request's `model` field, gives the tokens of PEFT's own `generate`, and keeps its
sessions apart from the base model's and every other adapter's. A tiny random llama and PEFT
adapters with random (non-zero) weights, built here."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch
from peft import LoraConfig, get_peft_model
from pydantic import ValidationError

from server import exits
from server.model_loader import LoadedModel
from server.settings import Settings
from tests.device import DEVICE, DTYPE
from tests.equivalence import NEAR_TIE
from tests.inprocess import openai_client
from tests.server.test_families import generate, prompt_of, tiny

BASE_ID = "tiny-llama"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 10


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """name -> (its PEFT directory, the PEFT model it was saved from)."""
    base = tiny()
    out = {}
    for seed, name in enumerate(("a", "b"), start=1):
        torch.manual_seed(seed)
        config = LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS, init_lora_weights=False)
        peft_model = get_peft_model(copy.deepcopy(base), config).eval()
        path = tmp_path_factory.mktemp("lora") / name
        peft_model.save_pretrained(path)
        out[name] = (str(path), peft_model)
    return out


def loaded(tokenizer) -> LoadedModel:
    return LoadedModel(model=tiny(), tokenizer=tokenizer, model_id=BASE_ID, device=DEVICE, dtype=DTYPE, max_context=2048)


def serving(tokenizer, adapters, **settings):
    return openai_client(loaded(tokenizer), lora=[f"{name}={path}" for name, (path, _) in adapters.items()],
                         kv_budget_bytes=2**26, **settings)


def assert_same_tokens(model, tokenizer, prompt: list[int], got: list[str], want: list[int]) -> None:
    """The served tokens (each token's text) are `want`'s, or the first step where they differ
    is a near-tie of `model` (tests/equivalence.py)."""
    texts = [tokenizer.decode([t]) for t in want]
    if got == texts:
        return
    i = next(k for k, (a, b) in enumerate(zip(got, texts)) if a != b)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + want[:i]], device=DEVICE)).logits[0, -1]
    top = torch.topk(logits.float(), 2).values
    assert float(top[0] - top[1]) < NEAR_TIE, f"step {i}: {got} != {texts}"


async def complete(client, model: str, prompt: list[int]):
    out = await client.completions.create(model=model, prompt=prompt, max_tokens=STEPS, temperature=0, logprobs=0)
    assert out.choices[0].finish_reason == "length"
    return out.choices[0].logprobs.tokens


@pytest.mark.anyio
async def test_each_adapter_is_listed_and_gives_peft_s_own_tokens(tokenizer, adapters):
    """Adapters, the base and a mix of them in one batch each give the tokens their own model
    generates (PEFT's `generate` for an adapter); an adapter changes the output."""
    prompt = prompt_of(12)
    wants = {name: generate(peft_model, prompt, STEPS) for name, (_, peft_model) in adapters.items()}
    base_model = tiny()
    wants[BASE_ID] = generate(base_model, prompt, STEPS)
    assert wants["a"] != wants[BASE_ID] and wants["b"] != wants[BASE_ID] and wants["a"] != wants["b"]
    async with serving(tokenizer, adapters) as (client, http):
        cards = (await http.get("/v1/models")).json()["data"]
        assert [c["id"] for c in cards] == [BASE_ID, "a", "b"]
        for card in cards[1:]:
            assert card["parent"] == BASE_ID and card["root"] == adapters[card["id"]][0] and card["max_model_len"] == 2048
            assert card["object"] == "model" and card["owned_by"] == "kvserve"
        single = (await http.get("/v1/models/a")).json()
        assert single == cards[1]

        for name in ("a", BASE_ID, "b"):
            got = await complete(client, name, prompt)
            model = adapters[name][1] if name in adapters else base_model
            assert_same_tokens(model, tokenizer, prompt, got, wants[name])

        # every row of one step gets its own adapter (or none)
        names = ["a", "b", BASE_ID, "b", "a"]
        gots = await asyncio.gather(*(complete(client, name, prompt) for name in names))
        for name, got in zip(names, gots):
            model = adapters[name][1] if name in adapters else base_model
            assert_same_tokens(model, tokenizer, prompt, got, wants[name])


@pytest.mark.anyio
async def test_an_unknown_model_is_404_in_the_openai_shape(tokenizer, adapters):
    async with serving(tokenizer, adapters) as (_, http):
        for path, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                           ("/v1/completions", {"prompt": "Hi"})):
            response = await http.post(path, json={"model": "c", "max_tokens": 2, **body})
            assert response.status_code == 404
            error = response.json()["error"]
            assert error["code"] == "model_not_found" and error["param"] == "model" and "'c'" in error["message"]
        assert (await http.get("/v1/models/c")).status_code == 404


@pytest.mark.anyio
async def test_adapters_never_reuse_each_other_s_sessions(tokenizer, adapters):
    """One session id on two adapters and the base: three caches. The second adapter's (and the
    base's) first turn reuses nothing of the first's; a second turn on the same adapter reuses
    its own first turn."""
    session = {"X-Session-ID": "shared"}
    messages = [{"role": "user", "content": "Tell me about the sea."}]

    async def turn(client, model, messages):
        out = await client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0,
                                                   extra_headers=session)
        return out, out.usage.prompt_tokens_details.cached_tokens

    async with serving(tokenizer, adapters) as (client, http):
        first_a, cached = await turn(client, "a", messages)
        assert cached == 0
        _, cached = await turn(client, "b", messages)
        assert cached == 0
        _, cached = await turn(client, BASE_ID, messages)
        assert cached == 0
        again = messages + [{"role": "assistant", "content": first_a.choices[0].message.content},
                            {"role": "user", "content": "And the sky?"}]
        _, cached = await turn(client, "a", again)
        assert cached >= first_a.usage.prompt_tokens


def test_a_bad_adapter_fails_the_load_naming_it_and_the_reason(tokenizer):
    """An adapter that cannot be read is a start-up error (exit status 2: a flag to change)
    naming the adapter and why; the server never turns ready."""
    from server.startup import create_app
    from tests.device import SETTINGS
    from tests.inprocess import ready_once_loaded

    app = create_app(Settings(**SETTINGS, lora=["bad=/nonexistent"], kv_budget_bytes=2**26), loaded=loaded(tokenizer))
    ready = asyncio.run(ready_once_loaded(app))
    assert ready.status_code == 503
    error = app.state.kv.load_error
    assert "--lora bad=/nonexistent" in error and "not-found" in error, error
    assert app.state.kv.exit_status == exits.SETTINGS


@pytest.mark.parametrize("entry", ["a", "=/p", "a/b=/p", "a b=/p", "a="])
def test_a_lora_flag_must_be_name_equals_path(entry):
    with pytest.raises(ValidationError, match="--lora"):
        Settings(lora=[entry])


def test_lora_flags_repeat_and_the_env_var_splits_on_commas(monkeypatch):
    from server.cli import build_parser, settings_from_args

    args = build_parser().parse_args(["serve", "--lora", "a=/x", "--lora", "b=/y=z", "--max-loras", "2", "--max-lora-rank", "16"])
    settings = settings_from_args(args)
    assert settings.lora_adapters() == [("a", "/x"), ("b", "/y=z")]
    assert (settings.max_loras, settings.max_lora_rank) == (2, 16)
    monkeypatch.setenv("KVSERVE_LORA", "a=/x, b=/y")
    assert Settings().lora_adapters() == [("a", "/x"), ("b", "/y")]
    assert Settings(lora=["a=/x", "b=/y"], max_loras=1).lora_capacity == 32  # the second waits in host memory
    with pytest.raises(ValidationError, match="--max-cpu-loras"):
        Settings(lora=["a=/x", "b=/y"], max_loras=1, max_cpu_loras=1)
    with pytest.raises(ValidationError, match="--lora-dir"):
        Settings(enable_lora_loading=True)
    with pytest.raises(ValidationError, match="given twice"):
        Settings(lora=["a=/x", "a=/y"])


@pytest.mark.anyio
async def test_structured_output_and_tool_calls_hold_on_an_adapter(tokenizer, adapters):
    """The grammar masks an adapter's logits as it does the base's: a json_schema answer parses
    and validates, a forced tool call's arguments parse, on adapters and the base at once."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer", "minimum": 1, "maximum": 30}},
              "required": ["city", "days"], "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": schema}}
    messages = [{"role": "user", "content": "Plan a trip."}]
    async with serving(tokenizer, adapters) as (client, _):
        async def structured(model):
            out = await client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0,
                                                       response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": schema}})
            return out.choices[0]

        async def forced(model):
            out = await client.chat.completions.create(model=model, messages=messages, max_tokens=60, temperature=0, tools=[tool],
                                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
            return out.choices[0]

        answers = await asyncio.gather(*(structured(m) for m in ("a", "b", BASE_ID)), *(forced(m) for m in ("a", "b")))
    for choice in answers[:3]:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), schema)
    for choice in answers[3:]:
        [call] = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), schema)
    assert answers[0].message.content != answers[2].message.content or answers[1].message.content != answers[2].message.content
