"""Images in (issue 49) on a tiny random LLaVA (tests/vision_models.py): the engine feeds each
picture's encoder features at its placeholder run and gives transformers' `generate` tokens,
alone and batched beside text; reuse compares pictures by content; the chat and Responses
APIs take `image_url` / `input_image` parts, and refuse what they cannot take with a 400
naming the part."""

from __future__ import annotations

import asyncio
import copy
import io
import json

import openai
import pytest
import torch

from bench.vision import BUILDERS, data_url, llava, picture, reference
from server.api import media
from server.api.vision_prompt import Vision, tokens
from server.engine import vision
from server.engine.sampling import SamplingParams
from server.engine.sequence import GenerationRequest
from server.model_loader import LoadedModel, load_model
from tests.device import DEVICE, DTYPE
from tests.inprocess import anthropic_client, openai_client

MAX_TOKENS = 10
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny(tokenizer):
    model, processor = llava(copy.deepcopy(tokenizer), DEVICE, DTYPE)
    return model, processor


@pytest.fixture(scope="module")
def reference_model(tokenizer):
    """A second copy of the same weights that kvserve never touches."""
    return llava(copy.deepcopy(tokenizer), DEVICE, DTYPE)[0]


def user(*parts) -> list[dict]:
    """A one-message conversation in template form: strings are text, pictures images."""
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts]}]


def chat_parts(*parts) -> list[dict]:
    return [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]


def test_key_ids_carry_the_digest_and_are_never_vocabulary_ids():
    a, b = "ab" * 32, "ab" * 31 + "ac"
    assert all(i < 0 for i in vision.key_ids(a, 9))
    assert vision.key_ids(a, 9) != vision.key_ids(b, 9)  # the last chunk differs
    assert vision.key_ids(a, 9)[:4] == vision.key_ids(a, 9)[4:8]


def read(p) -> "media.Image":
    """`p` as a request's image arrives: PNG bytes, decoded and checked."""
    buffer = io.BytesIO()
    p.save(buffer, format="PNG")
    return media.decode(buffer.getvalue(), "x", media.MediaLimits())


@pytest.mark.parametrize("family", sorted(BUILDERS))
def test_each_fed_family_gives_generate_s_tokens_alone_beside_text_and_reused(family, tokenizer):
    """Two pictures of two sizes: the same greedy tokens as `generate` alone, beside a text-only
    request in the same steps, and again on a session that holds the first turn's KV (the
    second turn reuses the pictures and prefills only its new tokens). Idefics3 writes each
    picture as a global view and tiles: several placeholder runs a picture."""
    from bench.architectures import Served
    from tests.engines import run

    assert set(BUILDERS) == vision.FAMILIES  # every fed family is checked here
    model, processor = BUILDERS[family](copy.deepcopy(tokenizer), DEVICE, DTYPE)
    reference_model = BUILDERS[family](copy.deepcopy(tokenizer), DEVICE, DTYPE)[0]
    pictures = [picture(1), picture(2, (30, 60))]
    first = user("Look at ", pictures[0], " and ", pictures[1], " then tell me.")
    want = reference(reference_model, processor, first, pictures, MAX_TOKENS)
    text_want = reference(reference_model, processor, user("Only words here, no pictures at all."), [], MAX_TOKENS)
    vis = Vision(processor, vision.image_token_id(model.config), span=vision.Encoder(model).span)

    def prompt(messages):
        text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokens(vis, text, [read(p) for p in pictures], "messages")

    ids, spans = prompt(first)
    assert all(i < 0 for s in spans for start, n in s.runs for i in ids[start : start + n])
    assert family != "idefics3" or all(len(s.runs) > 1 for s in spans)
    plain = processor.tokenizer.apply_chat_template(user("Only words here, no pictures at all."), add_generation_prompt=True, tokenize=False)
    plain_ids = processor.tokenizer(plain, add_special_tokens=False)["input_ids"]
    served = Served(model, processor.tokenizer)
    try:
        def request(name, prompt_ids, images=(), session=None):
            return GenerationRequest(name, prompt_ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), images=tuple(images),
                                     session_id=session, use_session=session is not None)

        async def both():
            return await asyncio.gather(run(served.engine, request("img", ids, spans)), run(served.engine, request("txt", plain_ids)))

        alone, _ = asyncio.run(run(served.engine, request("a", ids, spans, session="s")))
        (with_image, _), (text_only, _) = asyncio.run(both())
        second = first + [{"role": "assistant", "content": processor.tokenizer.decode(alone, skip_special_tokens=True)},
                          {"role": "user", "content": "And the second one, once more?"}]
        ids2, spans2 = prompt(second)
        again, final = asyncio.run(run(served.engine, request("b", ids2, spans2, session="s")))
    finally:
        served.stop()
    assert alone == want and with_image == want and text_only == text_want
    assert final.cached_tokens > spans2[-1].end  # both pictures' KV reused
    assert again == reference(reference_model, processor, second, pictures, MAX_TOKENS)


@pytest.mark.parametrize("family", [f for f in sorted(BUILDERS) if f.startswith("qwen")])
def test_m_rope_positions_are_transformers_own_through_chunks_and_paged_decode(family, tokenizer):
    """Qwen2-VL's 3-D rotary: a picture's positions are its grid's, and the text after it goes
    on from the grid's end. kvserve's positions for every window of a prompt (a prefill chunk)
    are those of the model's `get_rope_index`, the shift after the prompt is its rope delta,
    and an engine that cuts both pictures across chunks and decodes on the paged path (the
    shift in the persistent decode buffer) gives `generate`'s tokens."""
    from bench.architectures import Served
    from tests.engines import run

    model, processor = BUILDERS[family](copy.deepcopy(tokenizer), DEVICE, DTYPE)
    reference_model = BUILDERS[family](copy.deepcopy(tokenizer), DEVICE, DTYPE)[0]
    pictures = [picture(21), picture(22, (30, 60))]
    messages = user("See ", pictures[0], " beside ", pictures[1], ", then answer.")
    text = processor.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids, spans = tokens(Vision(processor, vision.image_token_id(model.config), span=vision.Encoder(model).span), text,
                        [read(p) for p in pictures], "messages")
    inputs = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False)
    want, delta = model.model.get_rope_index(inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"])
    assert all(s.shift < 0 for s in spans) and vision.shift(spans, len(ids)) == int(delta)
    for first in range(len(ids)):
        for n in (1, 5, len(ids) - first):
            n = min(n, len(ids) - first)
            got = vision.rope_positions(spans, first, n)
            expected = want[:, 0, first : first + n].tolist()
            if got is None:  # no picture in the window: 1-D, the index plus the shift
                got = [[i + vision.shift(spans, i) for i in range(first, first + n)]] * 3
            assert got == expected, (first, n)
    want = reference(reference_model, processor, messages, pictures, MAX_TOKENS)
    for overlap in (False, True):  # (overlap: each decode step launched from the device's tokens, the first from the prompt's last chunk)
        served = Served(model, processor.tokenizer, max_batch_tokens=5, paged=True, overlap=overlap)
        try:
            request = GenerationRequest("m", ids, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0), images=spans)
            got, _ = asyncio.run(run(served.engine, request))
            hybrid = served.engine.runner.pool.states is not None  # (a recurrent state cannot be taken back: no overlap)
            assert served.engine.runner.paths["overlap"] == ("on" if overlap and not hybrid else "off")
        finally:
            served.stop()
        assert got == want, overlap


@pytest.mark.parametrize("path", ["rows", "paged", "paged-kernel"])
def test_a_gemma3_picture_attends_to_itself_whole(tokenizer, path):
    """Gemma 3's picture attends to itself whole (transformers' token_type_ids blocks): the KV
    kvserve leaves in the pool, prefilled in chunks of 3 (each ending outside a picture: a
    4-token picture is taken whole), is transformers' own with the blocks, and measurably not
    the causal one (a random model's greedy tokens barely feel the difference; its second
    layer's keys at the pictures do). On the row path, the paged path's gathered bucket, and
    the paged attention kernel (a query's reach: server/engine/paged_kernel.py)."""
    from cache_manager import kv
    from server.engine import paged_kernel
    from server.engine.model_runner import ModelRunner

    if path == "paged-kernel" and not paged_kernel.runs_triton(DEVICE):
        pytest.skip(f"no Triton kernel on {DEVICE} (no Triton, or no interpreter)")
    from server.engine.scheduler import Plan, ScheduledRow
    from server.engine.sequence import Sequence

    model, processor = BUILDERS["gemma3"](copy.deepcopy(tokenizer), DEVICE, DTYPE)
    pictures = [picture(51), picture(52, (30, 60))]
    text = processor.tokenizer.apply_chat_template(user("Look at ", pictures[0], " and ", pictures[1], " then tell me."),
                                                   add_generation_prompt=True, tokenize=False)
    encoder = vision.Encoder(model)
    ids, spans = tokens(Vision(processor, encoder.placeholder, span=encoder.span), text, [read(p) for p in pictures], "messages")
    assert all(s.whole for s in spans)
    inputs = processor(text=[text], images=pictures, return_tensors="pt", add_special_tokens=False).to(DEVICE)
    with torch.inference_mode():
        blocks = model(**inputs, use_cache=True).past_key_values.layers[1].keys
        causal = model(**{k: v for k, v in inputs.items() if k != "token_type_ids"}, use_cache=True).past_key_values.layers[1].keys
    pool = kv.Pool(model.config, kv.bytes_for(model.config, 4 * len(ids), model.dtype), DEVICE, model.dtype)
    runner = ModelRunner(model, pool, paged=path != "rows", cuda_graphs=False, packed=None, overlap=False, encoder=encoder,
                         attention_kernel=path == "paged-kernel")
    seq = Sequence(GenerationRequest("g", ids, SamplingParams(max_tokens=1), images=spans), processor.tokenizer, DEVICE)
    seq.cache = pool.allocate(len(ids))
    chunks = []
    while seq.n_computed < len(ids):
        chunks.append(seq.fit(min(3, len(ids) - seq.n_computed)))
        runner.run(Plan([ScheduledRow(seq, chunks[-1])]))
    assert 4 in chunks  # a picture taken whole past the chunk size
    assert runner.paths["paged_attention"] == {"rows": "n/a", "paged": "gather", "paged-kernel": "kernel"}[path]
    got = kv.read(seq.cache, 1, 0, len(ids))[0].float()
    scale = float(blocks.abs().max())
    assert float((got - blocks.float()).abs().max()) <= (1e-4 if DTYPE == torch.float32 else 0.05) * scale
    # a reused prefix that ends inside a picture (its KV computed whole): the rest of the picture
    # is computed in one chunk, seeing the cached part and itself whole
    kv.crop(seq.cache, spans[1].start + 2)
    while seq.n_computed < len(ids):
        runner.run(Plan([ScheduledRow(seq, seq.fit(min(1, len(ids) - seq.n_computed)))]))
    got = kv.read(seq.cache, 1, 0, len(ids))[0].float()
    assert float((got - blocks.float()).abs().max()) <= (1e-4 if DTYPE == torch.float32 else 0.05) * scale
    if DTYPE == torch.float32:  # the test can tell the two apart (by ~25x its tolerance here)
        assert float((causal - blocks).abs().max()) > 1e-3 * scale


def test_exact_mode_serves_gemma3_as_text(tokenizer):
    """Exact mode's attention spans do not reach across a picture that attends to itself whole:
    there Gemma 3 gets no encoder (its images are a 400, `refuse_images`); other families keep theirs."""
    from bench.architectures import Served

    for family, fed in (("gemma3", False), ("llava", True)):
        model, processor = BUILDERS[family](copy.deepcopy(tokenizer), DEVICE, DTYPE)
        served = Served(model, processor.tokenizer, exact=True)
        try:
            assert (served.engine.runner.encoder is not None) == fed
        finally:
            served.stop()


@pytest.fixture(scope="module")
def served_llava(tiny):
    model, processor = tiny
    return LoadedModel(model, processor.tokenizer, "tiny-llava", DEVICE, DTYPE, 2048, processor=processor)


async def test_chat_with_images_matches_generate_and_reuse_compares_pictures(served_llava, reference_model):
    processor = served_llava.processor
    a, b = picture(3), picture(4)
    want = reference(reference_model, processor, user("Describe ", a, " briefly."), [a], MAX_TOKENS)
    async with openai_client(served_llava) as (client, http):
        def ask(image, session):
            return http.post("/v1/chat/completions", json={
                "model": "tiny-llava", "max_tokens": MAX_TOKENS, "temperature": 0, "prompt_cache_key": session,
                "messages": [{"role": "user", "content": chat_parts("Describe ", image, " briefly.")}]})

        first = (await ask(a, "p")).json()
        assert processor.tokenizer(first["choices"][0]["message"]["content"], add_special_tokens=False)["input_ids"] == want \
            or first["choices"][0]["message"]["content"] == processor.tokenizer.decode(want, skip_special_tokens=True)
        start = len(processor.tokenizer(processor.tokenizer.apply_chat_template(user("Describe "), tokenize=False)
                                        .rsplit("<|im_end|>", 1)[0], add_special_tokens=False)["input_ids"])
        other = (await ask(b, "p")).json()  # the same text, another picture: nothing from the picture on is reused
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] <= start
        await ask(a, "q")
        again = (await ask(a, "q")).json()  # the same picture again: its run is reused
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > start + 16
        assert again["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
        metrics = (await http.get("/metrics")).text
        assert "kvserve_images_total 4.0" in metrics and "kvserve_image_tokens_total 64.0" in metrics


async def test_responses_take_input_image_and_refuse_file_ids(served_llava):
    async with openai_client(served_llava) as (client, http):
        image = {"type": "input_image", "image_url": data_url(picture(5))}
        ok = await client.responses.create(model="tiny-llava", max_output_tokens=4, temperature=0,
                                           input=[{"role": "user", "content": [{"type": "input_text", "text": "What is it?"}, image]}])
        assert ok.usage.input_tokens > 16
        # the stored turn keeps its image: the next turn continues the conversation that holds it
        follow = await client.responses.create(model="tiny-llava", max_output_tokens=4, temperature=0, previous_response_id=ok.id,
                                               input="And the colours?")
        assert follow.usage.input_tokens > ok.usage.input_tokens + 4 and follow.usage.input_tokens_details.cached_tokens > 16
        items = (await http.get(f"/v1/responses/{ok.id}/input_items")).json()["data"]
        assert any(part["type"] == "input_image" for item in items for part in item.get("content", []))
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model="tiny-llava", max_output_tokens=4, input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "file_id": "file-1"}]}])
        assert "file_id" in refused.value.body["message"]
        with pytest.raises(openai.BadRequestError) as bad:
            await client.responses.create(model="tiny-llava", max_output_tokens=4, input=[
                {"role": "user", "content": [{"type": "input_text", "text": "Hi"}, {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
        assert bad.value.body["param"] == "input[0].content[1]", bad.value.body


async def test_messages_take_image_blocks_as_chat_takes_image_parts(served_llava):
    """An Anthropic image block (base64 source) is the chat's image part: the same greedy text and
    prompt; a tool_result's image too; a bad picture is a 400 in Anthropic's shape naming its block."""
    a = data_url(picture(3))
    media_type, data = a.removeprefix("data:").split(";base64,")
    block = {"type": "image", "source": {"type": "base64", "media_type": media_type, "data": data}}
    async with anthropic_client(served_llava) as (client, http):
        chat = (await http.post("/v1/chat/completions", json={"model": "tiny-llava", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "image_url", "image_url": {"url": a}}]}]})).json()
        message = await client.messages.create(model="tiny-llava", max_tokens=MAX_TOKENS, extra_body={"temperature": 0}, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe "}, block]}])
        assert message.content[0].text == chat["choices"][0]["message"]["content"]
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
        looked = await client.messages.create(model="tiny-llava", max_tokens=2, tools=[{"name": "look", "input_schema": {"type": "object"}}], messages=[
            {"role": "user", "content": "Look."}, {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "look", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [block]}]}])
        assert looked.usage.input_tokens + looked.usage.cache_read_input_tokens > 16
        broken = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
        refused = await http.post("/v1/messages", json={"model": "tiny-llava", "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, broken]}]})
        assert refused.status_code == 400 and refused.json()["type"] == "error"
        assert "messages[0].content[1]" in refused.json()["error"]["message"], refused.text


async def test_bad_images_are_400s_naming_the_part_and_the_server_keeps_serving(served_llava):
    async with openai_client(served_llava, max_images_per_request=1) as (client, http):
        def body(*parts):
            return {"model": "tiny-llava", "max_tokens": 2, "messages": [{"role": "user", "content": list(parts)}]}

        text = {"type": "text", "text": "Hi "}
        cases = [
            (body(text, {"type": "image_url", "image_url": {"url": "data:image/png;base64,not-base64!"}}), "messages[0].content[1]"),
            (body(text, {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}), "messages[0].content[1]"),
            (body({"type": "image_url", "image_url": {"url": data_url(picture(1))}},
                  {"type": "image_url", "image_url": {"url": data_url(picture(2))}}), "messages[0].content[1]"),
        ]
        for case, param in cases:
            response = await http.post("/v1/chat/completions", json=case)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param, response.text
        fine = await http.post("/v1/chat/completions", json=body(text, {"type": "image_url", "image_url": {"url": data_url(picture(1))}}))
        assert fine.status_code == 200, fine.text


async def test_a_photo_larger_than_the_text_body_limit_is_taken(served_llava, smollm2):
    """An inline photo of a few MB is bigger than --max-body-bytes (4 MiB, sized for text): a
    vision-language model's limit has room for --max-request-image-bytes of base64 images,
    a text-only model's stays as it was."""
    photo = data_url(picture(41, (1400, 1000)))  # random pixels: PNG does not shrink them
    body = {"max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hi "}, {"type": "image_url", "image_url": {"url": photo}}]}]}
    assert len(photo) > 4 * 2**20
    async with openai_client(served_llava) as (client, http):
        taken = await http.post("/v1/chat/completions", json={"model": "tiny-llava", **body})
        assert taken.status_code == 200, taken.text[:300]
    async with openai_client(smollm2) as (client, http):
        refused = await http.post("/v1/chat/completions", json={"model": smollm2.model_id, **body})
        assert refused.status_code == 413 and refused.json()["error"]["code"] == "request_too_large"


async def test_tokenize_counts_a_conversations_pictures_as_chat_prefills_them(served_llava):
    """/tokenize on messages with a picture: the count is the chat request's prompt_tokens, the
    picture's positions the model's placeholder token (never the content key ids)."""
    messages = [{"role": "user", "content": chat_parts("What is in ", picture(61), "?")}]
    async with openai_client(served_llava) as (client, http):
        counted = (await http.post("/tokenize", json={"messages": messages})).json()
        chat = await client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=1)
    placeholder = vision.image_token_id(served_llava.model.config)
    assert counted["count"] == chat.usage.prompt_tokens and counted["tokens"].count(placeholder) == 16
    assert min(counted["tokens"]) >= 0


async def test_a_text_only_model_refuses_images_by_name(smollm2):
    async with openai_client(smollm2) as (client, http):
        response = await http.post("/v1/chat/completions", json={"model": smollm2.model_id, "max_tokens": 2, "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": data_url(picture(1))}}]}]})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "images_not_supported" and error["param"] == "messages[0].content[1]"


def test_a_vision_checkpoint_loads_with_its_processor(tiny, tmp_path):
    model, processor = tiny
    model.save_pretrained(tmp_path)
    processor.save_pretrained(tmp_path)
    loaded = load_model(str(tmp_path), cache_dir=tmp_path / "cache", device=DEVICE.type, dtype=str(DTYPE).removeprefix("torch."))
    assert type(loaded.model).__name__ == "LlavaForConditionalGeneration" and loaded.processor is not None
    assert vision.sees_images(loaded.model) and loaded.tokenizer.chat_template


async def test_a_family_whose_images_are_not_fed_yet_is_served_as_text_and_refuses_images(tokenizer, monkeypatch):
    """The gate (`vision.FAMILIES`): a vision-language family not checked against `generate`
    gets no encoder, so its images are a 400 rather than features fed the wrong way."""
    monkeypatch.setattr(vision, "FAMILIES", frozenset())
    model, processor = llava(copy.deepcopy(tokenizer), DEVICE, DTYPE)
    assert not vision.sees_images(model)
    loaded = LoadedModel(model, processor.tokenizer, "unchecked-vlm", DEVICE, DTYPE, 2048, processor=processor)
    async with openai_client(loaded) as (client, http):
        refused = await http.post("/v1/chat/completions", json={"model": "unchecked-vlm", "max_tokens": 2, "messages": [
            {"role": "user", "content": chat_parts("Hi ", picture(1))}]})
        assert refused.status_code == 400 and refused.json()["error"]["code"] == "images_not_supported"
        text = await client.chat.completions.create(model="unchecked-vlm", max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
        assert text.usage.completion_tokens == 2


async def test_a_restart_keeps_a_session_s_pictures(served_llava, tmp_path):
    """The disk tier carries the pictures' key ids: after a restart the session's picture is
    reused, and another picture in its place is not."""
    a, b = picture(6), picture(7)

    def turn(image, question: str) -> dict:
        return {"model": "tiny-llava", "max_tokens": 3, "temperature": 0, "prompt_cache_key": "album",
                "messages": [{"role": "user", "content": chat_parts("See ", image, question)}]}

    async with openai_client(served_llava):
        pass  # NOTE: a first engine repacks the shared model in place, which changes its fingerprint once
    async with openai_client(served_llava, kv_disk_dir=str(tmp_path)) as (client, http):
        assert (await http.post("/v1/chat/completions", json=turn(a, " now."))).status_code == 200
    async with openai_client(served_llava, kv_disk_dir=str(tmp_path)) as (client, http):
        same = (await http.post("/v1/chat/completions", json=turn(a, " now, again."))).json()
        assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 16, same["usage"]
        other = (await http.post("/v1/chat/completions", json=turn(b, " now, again."))).json()
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < 8, other["usage"]


def test_a_vision_family_not_fed_and_not_a_causal_lm_is_refused_by_name_at_load(tokenizer, tmp_path):
    from transformers import Mistral3Config

    from server.engine.unsupported import UnsupportedModel

    config = Mistral3Config(text_config={"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                                         "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 1000},
                            vision_config={"model_type": "pixtral", "hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                                           "intermediate_size": 64})
    config.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModel) as refused:
        load_model(str(tmp_path), cache_dir=tmp_path / "cache", device="cpu", dtype="float32")
    assert refused.value.feature == "vision-family" and "mistral3" in str(refused.value)


def test_a_qwen_vl_checkpoint_loads_with_its_processor_or_is_refused_naming_torchvision(tokenizer, tmp_path):
    """Qwen2-VL's processors hold a video processor, which needs torchvision even for images:
    where it imports the checkpoint is served with its images; where not, the load is refused
    by name, saying what is missing (not a traceback)."""
    import importlib.util

    from server.engine.unsupported import UnsupportedModel

    model, processor = BUILDERS["qwen2_5_vl"](copy.deepcopy(tokenizer), DEVICE, DTYPE)
    model.save_pretrained(tmp_path)
    processor.tokenizer.save_pretrained(tmp_path)
    processor.image_processor.save_pretrained(tmp_path)
    load = lambda: load_model(str(tmp_path), cache_dir=tmp_path / "cache", device=DEVICE.type, dtype=str(DTYPE).removeprefix("torch."))  # noqa: E731
    if importlib.util.find_spec("torchvision") is None:
        with pytest.raises(UnsupportedModel) as refused:
            load()
        assert refused.value.feature == "vision-processor" and "torchvision" in str(refused.value)
        return
    loaded = load()
    assert type(loaded.model).__name__ == "Qwen2_5_VLForConditionalGeneration" and vision.sees_images(loaded.model)


def test_a_qwen3_5_checkpoint_without_its_processor_is_served_as_text(tokenizer, tmp_path, caplog):
    """Qwen3.5 is a causal LM to transformers as well: where its processor cannot be built (no
    torchvision here, or none saved) it is served as text with a warning saying why, as it
    was before its images were fed, rather than refused."""
    model, processor = BUILDERS["qwen3_5"](copy.deepcopy(tokenizer), DEVICE, DTYPE)
    model.save_pretrained(tmp_path)
    processor.tokenizer.save_pretrained(tmp_path)  # no image processor: AutoProcessor cannot build one
    loaded = load_model(str(tmp_path), cache_dir=tmp_path / "cache", device=DEVICE.type, dtype=str(DTYPE).removeprefix("torch."))
    assert loaded.processor is None and not vision.sees_images(loaded.model)
    assert "serving qwen3_5 as text, without images" in caplog.text


async def test_images_stream_and_take_structured_output(served_llava):
    """A streamed turn with an image under a JSON schema: valid JSON, the same tokens whole or streamed."""
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}}, "required": ["colour"],
              "additionalProperties": False}
    body = {"model": "tiny-llava", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}},
            "messages": [{"role": "user", "content": chat_parts("Which colour is ", picture(8), "?")}]}
    async with openai_client(served_llava) as (client, http):
        whole = await client.chat.completions.create(**body)
        chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    text = whole.choices[0].message.content
    assert set(json.loads(text)) == {"colour"}
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text



def test_a_tiled_picture_is_looked_up_and_encoded_once_for_all_its_runs(tokenizer):
    """Idefics3's picture lies in several placeholder runs; a step covering them all asks the
    encoder (here with no cache to keep it) once per picture, not once per run."""
    from server.metrics import Metrics

    model, processor = BUILDERS["idefics3"](copy.deepcopy(tokenizer), DEVICE, DTYPE)
    pictures = [picture(13), picture(14, (30, 60))]
    text = processor.tokenizer.apply_chat_template(user("A ", pictures[0], " and ", pictures[1]), add_generation_prompt=True, tokenize=False)
    ids, spans = tokens(Vision(processor, vision.image_token_id(model.config)), text, [read(p) for p in pictures], "messages")
    assert all(len(span.runs) > 1 for span in spans)
    metrics = Metrics()
    rows = vision.Encoder(model, budget_bytes=0, metrics=metrics).rows(spans, 0, len(ids))
    assert sum(f.shape[1] for _, f in rows) == sum(span.length for span in spans)
    sample = metrics.registry.get_sample_value
    assert sample("kvserve_vision_encoder_seconds_count") == 2
    assert sample("kvserve_vision_encoder_cache_lookups_total", {"result": "miss"}) == 2


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def thinking_llava(tokenizer):
    """A tiny LLaVA that thinks and calls tools as Qwen3 does (tests/thinking.py's markers and
    template, the template taught to render image parts and tool results holding them)."""
    from tests import thinking

    model, processor = llava(thinking.family_tokenizer(tokenizer, "qwen3"), DEVICE, DTYPE)
    # the messages loop's content: text parts and an image token per image part (the first
    # `set content` reads the last query's text, which stays a string's)
    content = "{%- set content = m.content if m.content is string else '' -%}"
    template = thinking.QWEN3_TEMPLATE.strip()
    at = template.rindex(content)
    parts = "{%- set content = m.content if m.content is string else (m.content | map(attribute='text', default='<image>') | join('')) -%}"
    template = template[:at] + parts + template[at + len(content):]
    processor.tokenizer.chat_template = processor.chat_template = template
    model.generation_config.eos_token_id = thinking.end_of_turn_ids(processor.tokenizer)
    return LoadedModel(model, processor.tokenizer, "tiny-thinking-llava", DEVICE, DTYPE, 2048, processor=processor)


async def test_images_with_thinking_a_forced_tool_call_and_a_tool_result_holding_an_image(thinking_llava):
    """A picture in the question: the model thinks (the budget ends it), then calls the tool
    (forced); the call's result comes back as a tool message holding a second picture, on the
    same session: the next turn reuses the first's KV, picture included, and counts both
    pictures' tokens."""
    ask = [{"role": "user", "content": chat_parts("What is the weather where ", picture(31), " was taken?")}]
    async with openai_client(thinking_llava) as (client, http):
        first = await client.chat.completions.create(
            model="tiny-thinking-llava", messages=ask, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
            temperature=0, max_tokens=80, prompt_cache_key="trip", extra_body={"max_reasoning_tokens": 4})
        choice = first.choices[0]
        reasoning = (choice.message.model_extra or {}).get("reasoning_content")
        assert reasoning and "<tool_call>" not in reasoning
        assert first.usage.completion_tokens_details.reasoning_tokens == 4 + 2  # <think> (opened before the grammar), 4, </think>
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert set(json.loads(call.function.arguments)) == {"city"}
        result = [{"type": "text", "text": "Sunny; the sky looks like "}, {"type": "image_url", "image_url": {"url": data_url(picture(32))}}]
        follow = ask + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                        {"role": "tool", "tool_call_id": call.id, "content": result}]
        second = await client.chat.completions.create(model="tiny-thinking-llava", messages=follow, tools=[WEATHER], temperature=0,
                                                      max_tokens=6, prompt_cache_key="trip", extra_body={"max_reasoning_tokens": 2})
        picture_tokens = 16  # the tiny shape's placeholders a picture
        assert second.usage.prompt_tokens > first.usage.prompt_tokens + picture_tokens
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
