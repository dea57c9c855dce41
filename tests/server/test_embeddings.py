"""POST /v1/embeddings (--task embed) on tiny random-weight checkpoints (bench/embeddings.py):
vectors equal to sentence-transformers' `encode` on the same checkpoint (a BERT with mean pooling
and Normalize behind a real `kvserve serve` process, read through the official openai client in
float and base64; a BERT with CLS pooling and a Qwen3 decoder with last-token pooling in-process),
token-id inputs, Matryoshka `dimensions`, the pooling engine's batching, every malformed body a
400 in OpenAI's shape, and the task split (a generating server refuses pooling routes and an
embedding server the generation routes, each with a 400 saying how to start it)."""

from __future__ import annotations

import asyncio
import contextlib
import base64
import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
import torch
from openai import OpenAI

from bench.common import launch
from bench.embeddings import save, sentences
from server.engine.pooling import EmbedHead, Pooler, PoolingInput
from server.engine.pooling_spec import PoolingSpec
from server.model_loader import load_model
from tests.conftest import test_cache_dir as cache_dir
from tests.device import DEVICE, DTYPE_NAME, SERVE_FLAGS
from tests.inprocess import openai_client, served
from tests.server.test_api import assert_error_shape

TOLERANCE = 1e-5  # float32 on CPU; sentence-transformers pads and batches differently
TEXTS = sentences(24, seed=1)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("embedders")
    return {kind: save(kind, root / kind) for kind in ("bert-mean", "bert-cls", "qwen3-embed")}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    """`kvserve serve` on the mean-pooling BERT, its task left to `auto` (modules.json: embed)."""
    with launch(tmp_path_factory.mktemp("server"), "--model", str(checkpoints["bert-mean"]), "--cache-dir", str(cache_dir()),
                *SERVE_FLAGS, "--max-batch-tokens", "2048") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def reference(directory, kind: str, texts: list[str]) -> torch.Tensor:
    """sentence-transformers' vectors: the checkpoint's own modules, or (no modules.json)
    Qwen3-Embedding's last token + Normalize."""
    from sentence_transformers import SentenceTransformer

    try:  # sentence-transformers >= 5.7 (`sentence_transformers.models` before)
        from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    except ImportError:
        from sentence_transformers.models import Normalize, Pooling, Transformer

    if kind == "qwen3-embed":
        transformer = Transformer(str(directory))
        width = (getattr(transformer, "get_embedding_dimension", None) or transformer.get_word_embedding_dimension)()
        model = SentenceTransformer(modules=[transformer, Pooling(width, "lasttoken"), Normalize()], device=str(DEVICE))
    else:
        model = SentenceTransformer(str(directory), device=str(DEVICE))
    return model.encode(texts, batch_size=5, convert_to_tensor=True).float().cpu()


def test_vectors_equal_sentence_transformers_encode(client, checkpoints):
    """24 sentences in 4 concurrent requests of 6, through the SDK: each vector is encode's;
    base64 (little-endian float32) decodes to the same floats; usage counts the tokens."""
    expected = reference(checkpoints["bert-mean"], "bert-mean", TEXTS)
    chunks = [TEXTS[i:i + 6] for i in range(0, len(TEXTS), 6)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda chunk: client.embeddings.create(model="bert-mean", input=chunk), chunks))
    got = torch.tensor([d.embedding for a in answers for d in a.data])
    assert got.shape == expected.shape == (24, 32)
    assert (got - expected).abs().max().item() < TOLERANCE
    assert torch.allclose(got.norm(dim=-1), torch.ones(24), atol=1e-5)  # the Normalize module
    answer = answers[0]
    assert answer.object == "list" and answer.model == "bert-mean" and [d.index for d in answer.data] == list(range(6))
    assert all(d.object == "embedding" for d in answer.data)
    from transformers import AutoTokenizer

    tokens = sum(len(ids) for ids in AutoTokenizer.from_pretrained(checkpoints["bert-mean"])(chunks[0])["input_ids"])
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == tokens
    # the same request alone (so the same batch) in each format: the same float32 bits. NOTE: the
    # SDK asks for base64 when no format is given, and decodes it itself; given one, it does not
    floats = torch.tensor([d.embedding for d in client.embeddings.create(model="bert-mean", input=TEXTS[:2], encoding_format="float").data])
    decoded_by_sdk = torch.tensor([d.embedding for d in client.embeddings.create(model="bert-mean", input=TEXTS[:2]).data])
    given = client.embeddings.create(model="bert-mean", input=TEXTS[:2], encoding_format="base64").data
    decoded = torch.tensor(np.stack([np.frombuffer(base64.b64decode(d.embedding), dtype="<f4") for d in given]))
    assert torch.equal(decoded, floats) and torch.equal(decoded_by_sdk, floats)
    raw = httpx.post(f"{client.base_url}embeddings", json={"input": TEXTS[0]}).json()  # float is the wire default
    assert isinstance(raw["data"][0]["embedding"], list)


def test_token_ids_embed_as_their_text(client, checkpoints):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(checkpoints["bert-mean"])(TEXTS[:3])["input_ids"]
    by_text = [d.embedding for d in client.embeddings.create(model="bert-mean", input=TEXTS[:3]).data]
    one = client.embeddings.create(model="bert-mean", input=ids[0]).data
    many = client.embeddings.create(model="bert-mean", input=ids).data
    assert len(one) == 1 and torch.allclose(torch.tensor(one[0].embedding), torch.tensor(by_text[0]), atol=1e-6)
    assert torch.allclose(torch.tensor([d.embedding for d in many]), torch.tensor(by_text), atol=1e-6)


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["bert-cls", "qwen3-embed"])
async def test_cls_and_last_token_pooling_equal_sentence_transformers(checkpoints, kind):
    """A CLS-pooled BERT (no Normalize: vectors keep their length) and a Qwen3 decoder served with
    --task embed and no sentence-transformers files (last token, L2-normalized)."""
    loaded = load_model(str(checkpoints[kind]), cache_dir=cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME, task="embed")
    assert loaded.pooling.modes == (("cls",) if kind == "bert-cls" else ("lasttoken",))
    expected = reference(checkpoints[kind], kind, TEXTS)
    async with openai_client(loaded) as (client, _):
        answers = await asyncio.gather(*(client.embeddings.create(model=kind, input=TEXTS[i:i + 8]) for i in range(0, 24, 8)))
    got = torch.tensor([d.embedding for a in answers for d in a.data])
    assert (got - expected).abs().max().item() < TOLERANCE
    norms = got.norm(dim=-1)
    assert torch.allclose(norms, torch.ones(24), atol=1e-5) == (kind == "qwen3-embed")


@pytest.mark.anyio
async def test_dimensions_cut_a_matryoshka_model_and_renormalize(checkpoints, tmp_path):
    """With `matryoshka_dimensions` in its config, a vector cut to 16 is the full one's first 16
    components, normalized again; another length is a 400, and so is any cut of a model without."""
    import shutil

    directory = shutil.copytree(checkpoints["bert-mean"], tmp_path / "matryoshka")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [8, 16, 32]}))
    loaded = load_model(str(directory), cache_dir=cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME, task="auto")
    assert loaded.task == "embed"
    async with openai_client(loaded) as (client, http):
        full = torch.tensor((await client.embeddings.create(model="matryoshka", input=TEXTS[0])).data[0].embedding)
        cut = torch.tensor((await client.embeddings.create(model="matryoshka", input=TEXTS[0], dimensions=16)).data[0].embedding)
        assert cut.shape == (16,) and torch.allclose(cut, torch.nn.functional.normalize(full[:16], dim=0), atol=1e-6)
        assert (await client.embeddings.create(model="matryoshka", input=TEXTS[0], dimensions=32)).data[0].embedding == full.tolist()
        assert_error_shape(await http.post("/v1/embeddings", json={"input": "a", "dimensions": 10}), 400, "invalid_value", "dimensions")


BAD_BODIES = [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": ""}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": 5}, "input"),
    ({"input": [1, "a"]}, "input"),
    ({"input": {"text": "a"}}, "input"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "dimensions": 8}, "dimensions"),  # not a Matryoshka model
    ({"input": [10**6]}, "input"),  # outside the vocabulary
    ({"input": "word " * 600}, "input"),  # past the 512-token context: refused, not truncated
    ({"input": ["a"] * 2049}, "input"),
    ({"input": "a", "model": ""}, "model"),
]


def test_bad_bodies_are_400s_and_the_server_keeps_serving(server):
    url = server.base_url + "/embeddings"
    for body, param in BAD_BODIES:
        error = assert_error_shape(httpx.post(url, json=body, timeout=60), 400)
        assert (error["param"] or "").startswith(param), (body, error)
    too_long = httpx.post(url, json={"input": "word " * 600}).json()["error"]
    assert too_long["code"] == "context_length_exceeded" and "512" in too_long["message"]
    assert_error_shape(httpx.post(url, content=b"{nope", headers={"Content-Type": "application/json"}), 400)
    assert_error_shape(httpx.post(url, json={"input": "a", "model": "gpt-4o"}), 404, "model_not_found", "model")
    assert httpx.post(url, json={"input": "still serving"}).status_code == 200


def test_an_embedding_server_answers_generation_routes_with_400(server):
    assert httpx.get(server.url + "/ready").status_code == 200
    models = httpx.get(server.base_url + "/models").json()["data"]
    assert [(m["id"], m["task"], m["dimensions"]) for m in models] == [("bert-mean", "embed", 32)]
    for path, body in [("/v1/chat/completions", {"model": "bert-mean", "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/completions", {"model": "bert-mean", "prompt": "Hi"}),
                       ("/v1/responses", {"model": "bert-mean", "input": "Hi"})]:
        error = assert_error_shape(httpx.post(server.url + path, json=body), 400, "task_not_served")
        assert "--task generate" in error["message"] and "embeddings" in error["message"], path
    messages = httpx.post(server.url + "/v1/messages", json={"model": "bert-mean", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]})
    assert messages.status_code in (400, 404), messages.text  # 404 before the Messages API is served
    for path, body in [("/v1/rerank", {"query": "a", "documents": ["b"]}), ("/v1/score", {"text_1": "a", "text_2": "b"})]:
        error = assert_error_shape(httpx.post(server.url + path, json=body), 400, "task_not_served")
        assert "--task rerank" in error["message"], path
    assert server.metric('kvserve_pooled_inputs_total{task="embed"}') > 0


@pytest.mark.anyio
async def test_a_generating_server_answers_pooling_routes_with_400(app_client, smollm2):
    async with app_client() as client:
        for path, body, task in [("/v1/embeddings", {"input": "a"}, "embed"), ("/v1/rerank", {"query": "a", "documents": ["b"]}, "rerank"),
                                 ("/v1/score", {"text_1": "a", "text_2": "b"}, "rerank")]:
            error = assert_error_shape(await client.post(path, json=body), 400, "task_not_served")
            assert f"--task {task}" in error["message"] and "generation" in error["message"], path
        assert (await client.post("/v1/chat/completions", json={"model": smollm2.model_id, "max_tokens": 1,
                                                                  "messages": [{"role": "user", "content": "Hi"}]})).status_code == 200


class _Gated:
    """An embedding head that records each forward's rows and holds the first one until released."""

    def __init__(self, head) -> None:
        self.head, self.rows, self.release, self.entered = head, [], threading.Event(), threading.Event()

    def __call__(self, model, batch):
        self.rows.append(batch.ids.shape[0])
        self.entered.set()
        self.release.wait(10)
        return self.head(model, batch)


@contextlib.contextmanager
def gated_pooler(checkpoints):
    """The BERT mean-pooling model, and its pooler started with a head that holds each forward
    until released (`_Gated`): (loaded, head, pooler); released and stopped on leaving."""
    loaded = load_model(str(checkpoints["bert-mean"]), cache_dir=cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME, task="embed")
    head = _Gated(EmbedHead(PoolingSpec(("mean",), True, "test")))
    pooler = Pooler(loaded.model, head, pad_id=0, max_batch_tokens=4096, max_queue=8)
    pooler.start()
    try:
        yield loaded, head, pooler
    finally:
        head.release.set()
        pooler.stop()


@pytest.mark.anyio
async def test_the_pooler_runs_queued_requests_in_one_padded_forward(checkpoints):
    """Three requests queued while a forward runs go together into the next one, padded to the
    longest; each gets its own rows back, equal to its rows computed alone."""
    loop = asyncio.get_running_loop()
    with gated_pooler(checkpoints) as (loaded, head, pooler):
        ids = [loaded.tokenizer(t)["input_ids"] for t in TEXTS[:7]]
        first = pooler.submit([PoolingInput(ids[0])], loop)
        await asyncio.to_thread(head.entered.wait, 10)
        queued = [pooler.submit([PoolingInput(i) for i in ids[k:k + 2]], loop) for k in (1, 3, 5)]
        head.release.set()
        together = (await first) + [v for f in queued for v in await f]
        for _ in range(100):  # the futures' done callbacks, which count them, run on the loop after
            if pooler.idle:
                break
            await asyncio.sleep(0.01)
        assert head.rows == [1, 6] and pooler.idle
        alone = [(await pooler.submit([PoolingInput(i)], loop))[0] for i in ids]
    assert head.rows[2:] == [1] * 7
    assert max((a - b).abs().max().item() for a, b in zip(together, alone)) < TOLERANCE


@pytest.mark.anyio
async def test_a_request_past_its_deadline_is_a_504_and_its_rows_are_dropped(checkpoints):
    """A request whose waiter gives up (its deadline, or the client gone: the future is
    cancelled) has its rows not yet run dropped from the next round; over HTTP the deadline is a
    504 `timeout`, and the pooler is left idle."""
    loop = asyncio.get_running_loop()
    with gated_pooler(checkpoints) as (loaded, head, pooler):
        ids = [loaded.tokenizer(t)["input_ids"] for t in TEXTS[:4]]
        first = pooler.submit([PoolingInput(ids[0])], loop)
        await asyncio.to_thread(head.entered.wait, 10)
        dropped = pooler.submit([PoolingInput(i) for i in ids[1:3]], loop)
        kept = pooler.submit([PoolingInput(ids[3])], loop)
        dropped.cancel()
        await asyncio.sleep(0)  # its done callbacks (the drop among them) run on the loop
        head.release.set()
        await first
        assert len(await kept) == 1 and head.rows == [1, 1]  # the cancelled request's two rows never ran
    async with served(loaded, request_timeout_s=1e-6) as s:
        late = await s.http.post("/v1/embeddings", json={"input": TEXTS[:8]})
        assert_error_shape(late, 504, "timeout")
        engine = s.app.state.kv.ctx.engine
        for _ in range(100):
            if engine.idle:
                break
            await asyncio.sleep(0.01)
        assert engine.idle


def _files(**files):
    return lambda name: files.get(name.replace("/", "_").replace(".", "_"))


def test_the_pooling_is_read_from_modules_json():
    """The current and the legacy Pooling config, several modes in order, Normalize; a module
    kvserve does not compute and a model without Pooling are refused by name."""
    from server.engine.pooling_spec import PoolingConfigError, default_spec, read_modules

    modules = [{"type": "sentence_transformers.models.Transformer", "path": ""},
               {"type": "sentence_transformers.models.Pooling", "path": "1_Pooling"},
               {"type": "sentence_transformers.models.Normalize", "path": "2_Normalize"}]
    legacy = {"pooling_mode_cls_token": True, "pooling_mode_max_tokens": True, "pooling_mode_mean_tokens": False}
    spec = read_modules(_files(modules_json=json.dumps(modules), **{"1_Pooling_config_json": json.dumps(legacy)}))
    assert (spec.modes, spec.normalize) == (("cls", "max"), True)
    current = {"pooling_mode": "lasttoken", "include_prompt": True}
    spec = read_modules(_files(modules_json=json.dumps(modules[:2]), **{"1_Pooling_config_json": json.dumps(current)}))
    assert (spec.modes, spec.normalize) == (("lasttoken",), False)
    assert read_modules(_files()) is None
    assert default_spec(is_decoder=True).modes == ("lasttoken",) and default_spec(is_decoder=False).modes == ("mean",)
    dense = modules[:2] + [{"name": "2", "type": "sentence_transformers.models.Dense", "path": "2_Dense"}]
    with pytest.raises(PoolingConfigError, match="Dense"):
        read_modules(_files(modules_json=json.dumps(dense), **{"1_Pooling_config_json": json.dumps(current)}))
    with pytest.raises(PoolingConfigError, match="no Pooling"):
        read_modules(_files(modules_json=json.dumps(modules[:1])))
    with pytest.raises(PoolingConfigError, match="pooling modes"):
        read_modules(_files(modules_json=json.dumps(modules[:2]), **{"1_Pooling_config_json": json.dumps({"pooling_mode": "median"})}))
