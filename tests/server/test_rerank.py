"""POST /v1/rerank and /v1/score (--task rerank) on tiny random-weight checkpoints
(bench/embeddings.py): a cross-encoder (BertForSequenceClassification) behind a real `kvserve
serve` process, its scores equal to sentence-transformers' CrossEncoder.predict; a decoder
reranker of Qwen3-Reranker's kind in-process, its scores equal to the model card's computation
with plain transformers (P("yes") over the yes/no logits after its prompt); results sorted,
`top_n`, `return_documents`, score pairs 1:N and N:N; every malformed body a 400 in OpenAI's
shape; `--task auto` choosing the task from the checkpoint."""

from __future__ import annotations

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from bench.common import launch
from bench.embeddings import save
from server.api.serving_pooling import DEFAULT_INSTRUCTION, YES_NO_PREFIX, YES_NO_SUFFIX
from server.model_loader import load_model, resolve_task
from tests.conftest import test_cache_dir as cache_dir
from tests.device import DEVICE, DTYPE_NAME, SERVE_FLAGS
from tests.inprocess import openai_client
from tests.server.test_api import assert_error_shape

TOLERANCE = 1e-5
QUERY = "What is the capital of China?"
DOCUMENTS = [
    "The capital of China is Beijing.",
    "Gravity is a force that attracts two bodies towards each other.",
    "Paris is the capital of France.",
    "Beijing",
    "The sun is a star, and the moon moves around the earth at night.",
    "A small red bird on a tree in the rain.",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("rerankers")
    return {kind: save(kind, root / kind) for kind in ("bert-reranker", "qwen3-reranker")}


@pytest.fixture(scope="module")
def server(checkpoints, tmp_path_factory):
    """`kvserve serve` on the cross-encoder, its task left to `auto` (ForSequenceClassification: rerank)."""
    with launch(tmp_path_factory.mktemp("server"), "--model", str(checkpoints["bert-reranker"]), "--cache-dir", str(cache_dir()),
                *SERVE_FLAGS) as s:
        yield s


def cross_encoder_scores(directory, pairs) -> list[float]:
    from sentence_transformers import CrossEncoder

    return CrossEncoder(str(directory), device=str(DEVICE)).predict(pairs, batch_size=4).tolist()


def qwen3_reranker_scores(directory, pairs, instruction=None) -> list[float]:
    """Qwen3-Reranker's model card, with plain transformers: the prompt's prefix and suffix around
    the tokenized `<Instruct>/<Query>/<Document>` text, left-padded, softmax over (no, yes) of
    the last position."""
    tokenizer = AutoTokenizer.from_pretrained(directory, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=getattr(torch, DTYPE_NAME)).to(DEVICE).eval()
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    prefix = tokenizer.encode(YES_NO_PREFIX, add_special_tokens=False)
    suffix = tokenizer.encode(YES_NO_SUFFIX, add_special_tokens=False)
    texts = [f"<Instruct>: {instruction or DEFAULT_INSTRUCTION}\n<Query>: {q}\n<Document>: {d}" for q, d in pairs]
    inputs = tokenizer(texts, padding=False, truncation="longest_first", return_attention_mask=False, max_length=8192 - len(prefix) - len(suffix))
    inputs["input_ids"] = [prefix + ids + suffix for ids in inputs["input_ids"]]
    inputs = tokenizer.pad(inputs, padding=True, return_tensors="pt").to(DEVICE)
    logits = model(**inputs).logits[:, -1, :]
    return torch.log_softmax(torch.stack([logits[:, no], logits[:, yes]], dim=1).float(), dim=1)[:, 1].exp().tolist()


def test_cross_encoder_rerank_equals_crossencoder_predict(server, checkpoints):
    expected = cross_encoder_scores(checkpoints["bert-reranker"], [(QUERY, d) for d in DOCUMENTS])
    documents = [d if i % 2 else {"text": d} for i, d in enumerate(DOCUMENTS)]  # strings and objects
    answer = httpx.post(server.base_url + "/rerank", json={"model": "bert-reranker", "query": QUERY, "documents": documents}).json()
    results = answer["results"]
    assert sorted(r["index"] for r in results) == list(range(6))
    assert [r["relevance_score"] for r in results] == sorted((r["relevance_score"] for r in results), reverse=True)
    assert max(abs(r["relevance_score"] - expected[r["index"]]) for r in results) < TOLERANCE
    assert all(r["document"] == {"text": DOCUMENTS[r["index"]]} for r in results)
    assert answer["id"].startswith("rerank-") and answer["model"] == "bert-reranker" and answer["usage"]["total_tokens"] > 6
    top = httpx.post(server.base_url + "/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == [r["index"] for r in results[:2]]
    assert all("document" not in r for r in top["results"])


def test_cross_encoder_score_pairs_one_to_many_and_many_to_many(server, checkpoints):
    firsts = [QUERY, "Where is Paris?", QUERY, "Tell me about gravity.", "birds", QUERY]
    expected = cross_encoder_scores(checkpoints["bert-reranker"], list(zip(firsts, DOCUMENTS)))
    answer = httpx.post(server.base_url + "/score", json={"text_1": firsts, "text_2": DOCUMENTS}).json()
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == list(range(6))
    assert all(d["object"] == "score" for d in answer["data"]) and answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"]
    assert max(abs(d["score"] - e) for d, e in zip(answer["data"], expected)) < TOLERANCE
    one = httpx.post(server.base_url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS[:3]}).json()["data"]
    rerank = cross_encoder_scores(checkpoints["bert-reranker"], [(QUERY, d) for d in DOCUMENTS[:3]])
    assert max(abs(d["score"] - e) for d, e in zip(one, rerank)) < TOLERANCE
    single = httpx.post(server.base_url + "/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0]}).json()["data"]
    assert len(single) == 1 and abs(single[0]["score"] - rerank[0]) < TOLERANCE


@pytest.mark.anyio
async def test_decoder_reranker_equals_the_model_cards_computation(checkpoints):
    """A Qwen3 causal LM served with --task rerank: P("yes") after Qwen3-Reranker's prompt, with
    the default instruction and with one of the request's."""
    directory = checkpoints["qwen3-reranker"]
    loaded = load_model(str(directory), cache_dir=cache_dir(), device=str(DEVICE), dtype=DTYPE_NAME, task="rerank")
    assert type(loaded.model).__name__ == "Qwen3ForCausalLM"
    instruction = "Given a question, find the passage that answers it"
    expected = qwen3_reranker_scores(directory, [(QUERY, d) for d in DOCUMENTS])
    instructed = qwen3_reranker_scores(directory, [(QUERY, d) for d in DOCUMENTS], instruction)
    assert max(abs(a - b) for a, b in zip(expected, instructed)) > 1e-6  # the instruction is in the prompt
    async with openai_client(loaded) as (_, http):
        results = (await http.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS})).json()["results"]
        assert [r["index"] for r in results] == sorted(range(6), key=lambda i: -expected[i])
        assert max(abs(r["relevance_score"] - expected[r["index"]]) for r in results) < TOLERANCE
        scored = (await http.post("/v1/score", json={"text_1": QUERY, "text_2": DOCUMENTS, "instruction": instruction})).json()["data"]
        assert max(abs(d["score"] - e) for d, e in zip(scored, instructed)) < TOLERANCE
        assert_error_shape(await http.post("/v1/embeddings", json={"input": "a"}), 400, "task_not_served")


BAD_BODIES = [
    ("/v1/rerank", {}, "query"),
    ("/v1/rerank", {"query": "q"}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"query": "", "documents": ["a"]}, "query"),
    ("/v1/rerank", {"query": "q", "documents": [{"txt": "a"}]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": [""]}, "documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "return_documents": "maybe"}, "return_documents"),
    ("/v1/rerank", {"query": "q", "documents": ["a"], "instruction": "judge"}, "instruction"),  # a cross-encoder takes none
    ("/v1/rerank", {"query": "q", "documents": ["word " * 600]}, "documents"),  # past the 512-token context
    ("/v1/score", {"text_1": "a"}, "text_2"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, None),
    ("/v1/score", {"text_1": [], "text_2": "a"}, "text_1"),
    ("/v1/score", {"text_1": 3, "text_2": "a"}, "text_1"),
]


def test_bad_bodies_are_400s_and_the_server_keeps_serving(server):
    for path, body, param in BAD_BODIES:
        error = assert_error_shape(httpx.post(server.url + path, json=body, timeout=60), 400)
        assert (error["param"] or "").startswith(param) if param else "query" in error["message"] or path == "/v1/score", (path, body, error)
    assert_error_shape(httpx.post(server.url + "/v1/rerank", json={"query": "q", "documents": ["a"], "model": "x"}), 404, "model_not_found")
    assert httpx.post(server.url + "/v1/rerank", json={"query": "q", "documents": ["a"]}).status_code == 200
    for path, body in [("/v1/embeddings", {"input": "a"}), ("/v1/completions", {"model": "bert-reranker", "prompt": "Hi"})]:
        error = assert_error_shape(httpx.post(server.url + path, json=body), 400, "task_not_served")
        assert "rerank" in error["message"], path
    assert [(m["id"], m["task"]) for m in httpx.get(server.base_url + "/models").json()["data"]] == [("bert-reranker", "rerank")]


def test_task_auto_reads_the_checkpoint(checkpoints, tmp_path):
    """modules.json: embed; *ForSequenceClassification: rerank; a causal LM: generate (a decoder
    reranker or embedder needs --task); an explicit task is kept."""
    embedder = save("bert-cls", tmp_path / "bert-cls")
    for directory, task in [(embedder, "embed"), (checkpoints["bert-reranker"], "rerank"), (checkpoints["qwen3-reranker"], "generate")]:
        assert resolve_task("auto", str(directory), AutoConfig.from_pretrained(directory), {}) == task, directory
    assert resolve_task("embed", str(checkpoints["qwen3-reranker"]), None, {}) == "embed"
