"""Tensor parallel on CPU (server/parallel.py): real `kvserve serve --tensor-parallel-size 2`
processes over gloo, fp32, tiny random models of the dense, MoE, GQA-with-few-KV-heads and
sliding-window families saved with the default model's tokenizer. Greedy tokens equal
transformers' `generate` on the whole model in one process, alone, batched, on a reused session
and with prompt lookup; a killed rank, a family without a plan and heads the ranks do not divide
each end the server with its status and leave nothing running; two processes started as two
nodes serve together over loopback TCP."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bench.common import free_port, launch
from server import exits
from tests.conftest import test_cache_dir as cache_dir

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=2)
FAMILIES = {
    "dense": ("llama", {}),
    "moe": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gqa": ("qwen2", dict(num_attention_heads=8, num_key_value_heads=2)),  # one KV head per rank
    "few-kv-heads": ("llama", dict(num_attention_heads=4, num_key_value_heads=1)),  # fewer KV heads than ranks: replicated
    "sliding": ("mistral", dict(sliding_window=8)),
}
FLAGS = ("--device", "cpu", "--dtype", "float32", "--kv-budget-bytes", str(64 * 2**20), "--max-running", "4")
PROMPTS = [
    [(7 * i + 11) % 5000 + 3 for i in range(n)] for n in (5, 23, 40)
]
N = 12


def save(path: Path, tokenizer, model_type: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**BASE, **extra}), dtype=torch.float32).eval()
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return model


def generate(model, prompt: list[int], n: int = N) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def complete(server, prompt: list[int], n: int = N, session: str | None = None) -> dict:
    headers = {"X-Session-ID": session} if session else {}
    r = httpx.post(server.url + "/v1/completions", headers=headers, timeout=120,
                   json={"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode([t for t in ids if t != 2])


def descendants(pid: int) -> list[int]:
    """Live processes below `pid` (from /proc)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, parent in parents.items() if parent == p]
        found += kids
        frontier += kids
    return found


def alive(pid: int) -> bool:
    try:
        return "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
    except OSError:
        return False


@pytest.mark.parametrize("family", list(FAMILIES))
def test_two_ranks_give_generate_tokens(family, tmp_path, tokenizer):
    model_type, extra = FAMILIES[family]
    model = save(tmp_path / "m", tokenizer, model_type, **extra)
    # the dense model drafts by prompt lookup; the sliding-window one runs the transposed product,
    # whose output (a strided view) the all-reduce must not take as it is
    flags = ("--speculative", "ngram") if family == "dense" else ("--no-cpu-packed-weights",) if family == "sliding" else ()
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", *FLAGS, *flags) as server:
        engine = httpx.get(server.url + "/v1/models").json()["data"][0]["engine"]
        assert engine["tensor_parallel"] == "2 ranks over gloo"
        expected = [generate(model, p) for p in PROMPTS]
        # alone, then batched (concurrent requests share steps)
        for prompt, want in zip(PROMPTS, expected):
            assert complete(server, prompt)["choices"][0]["text"] == text_of(tokenizer, want)
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], PROMPTS))
        assert texts == [text_of(tokenizer, want) for want in expected]
        # a session's second turn prefills only its new tokens, and gives generate's tokens
        first = PROMPTS[1] + expected[1] + PROMPTS[0]
        complete(server, PROMPTS[1], session=f"s-{family}")
        second = complete(server, first, session=f"s-{family}")
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(PROMPTS[1])
        assert second["choices"][0]["text"] == text_of(tokenizer, generate(model, first))
        if family == "dense":  # prompt lookup drafts what followed the prompt's end before; both ranks verify it
            looping = PROMPTS[1] + expected[1] + PROMPTS[1]
            assert complete(server, looping, n=20)["choices"][0]["text"] == text_of(tokenizer, generate(model, looping, 20))
            assert server.metric("kvserve_spec_decode_draft_tokens_total") > 0
            # every rank's figures reach rank 0's metrics within a few seconds
            deadline, seen = time.monotonic() + 30, {}
            while time.monotonic() < deadline and len(seen) < 4:
                complete(server, PROMPTS[0], n=2)
                for line in httpx.get(server.url + "/metrics").text.splitlines():
                    if line.startswith(("kvserve_rank_step_seconds{", 'kvserve_rank_memory_bytes{kind="in_use"')):
                        seen[line.split(" ")[0]] = float(line.split(" ")[1])
                time.sleep(0.5)
            assert sorted(seen) == ['kvserve_rank_memory_bytes{kind="in_use",rank="0"}', 'kvserve_rank_memory_bytes{kind="in_use",rank="1"}',
                                    'kvserve_rank_step_seconds{rank="0"}', 'kvserve_rank_step_seconds{rank="1"}'], seen
            assert all(v > 0 for v in seen.values())


def test_the_compiled_forward_on_two_ranks_gives_generate_tokens(tmp_path, tokenizer):
    """`--compile require` under tensor parallel: each rank compiles its shard's decode forward
    with the all-reduces inside (attention's, and the experts' partial sums), on merged and
    packed local weights (sharding.localize), and the tokens are generate's, alone and batched."""
    model_type, extra = FAMILIES["moe"]
    model = save(tmp_path / "m", tokenizer, model_type, **extra)
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", "--compile", "require", *FLAGS, ready_timeout_s=300) as server:
        engine = httpx.get(server.url + "/v1/models").json()["data"][0]["engine"]
        assert (engine["compile"], engine["cpu_linear"], engine["fallbacks"]) == ("decode", "packed", {}), engine
        assert engine["merged"].startswith("qkv 2"), engine
        expected = [text_of(tokenizer, generate(model, p)) for p in PROMPTS]
        assert [complete(server, p)["choices"][0]["text"] for p in PROMPTS] == expected
        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(lambda p: complete(server, p)["choices"][0]["text"], PROMPTS)) == expected


def test_four_ranks_over_two_kv_heads_each_keep_the_head_they_read(tmp_path, tokenizer):
    """KV heads fewer than the ranks: ranks 0-1 keep KV head 0 and ranks 2-3 KV head 1 (the
    projections replicated, then cut)."""
    model = save(tmp_path / "m", tokenizer, "qwen2", num_key_value_heads=2)
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "4", *FLAGS) as server:
        assert complete(server, PROMPTS[1])["choices"][0]["text"] == text_of(tokenizer, generate(model, PROMPTS[1]))


def test_a_draft_model_on_rank_0_gives_generate_tokens(tmp_path, tokenizer):
    """The draft model runs whole on rank 0, its caches out of rank 0's budget; every rank's
    pool keeps rank 0's blocks, and the sharded target verifies the drafts."""
    model = save(tmp_path / "m", tokenizer, "llama")
    save(tmp_path / "draft", tokenizer, "llama", num_hidden_layers=1)
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", "--speculative", "draft", "--draft-model", str(tmp_path / "draft"), *FLAGS) as server:
        for prompt in PROMPTS:
            assert complete(server, prompt)["choices"][0]["text"] == text_of(tokenizer, generate(model, prompt))
        assert server.metric("kvserve_spec_decode_draft_tokens_total") > 0


def test_fp8_kv_on_two_ranks_gives_one_process_tokens(tmp_path, tokenizer):
    """Each rank quantizes its own heads as one process quantizes them (a scale per token and
    head): the tokens are one process's with the same --kv-cache-dtype."""
    save(tmp_path / "m", tokenizer, "qwen2", num_attention_heads=8, num_key_value_heads=2)
    flags = ("--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()), "--kv-cache-dtype", "fp8", *FLAGS)
    texts = {}
    for size in ("1", "2"):
        with launch(tmp_path, *flags, "--tensor-parallel-size", size) as server:
            texts[size] = [complete(server, p)["choices"][0]["text"] for p in PROMPTS]
    assert texts["2"] == texts["1"]


def test_a_session_survives_a_restart_on_every_rank(tmp_path, tokenizer):
    """Rank 0 persists the session with every rank's heads at shutdown; a new pair of ranks
    restores it, each its own heads, and continues it with generate's tokens."""
    model = save(tmp_path / "m", tokenizer, "qwen2", num_attention_heads=8, num_key_value_heads=2)
    flags = ("--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()), "--tensor-parallel-size", "2",
             "--kv-disk-dir", str(tmp_path / "kv"), *FLAGS)
    first = PROMPTS[2]
    with launch(tmp_path, *flags) as server:
        turn = complete(server, first, session="kept")["choices"][0]["text"]
    assert turn == text_of(tokenizer, generate(model, first))
    prompt = first + generate(model, first) + PROMPTS[0]
    with launch(tmp_path, *flags) as server:
        second = complete(server, prompt, session="kept")
        # only a restored session has cached tokens after a restart
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(first)
        assert second["choices"][0]["text"] == text_of(tokenizer, generate(model, prompt))


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_transformers_own_tensor_parallel_generate_agrees(family, tmp_path, tokenizer):
    """The reference the tests above hold kvserve's two ranks to (`generate` in one process) is
    also what transformers' own tensor-parallel `generate` gives on the same two shards."""
    model_type, extra = FAMILIES[family]
    model = save(tmp_path / "m", tokenizer, model_type, **extra)
    assert tp_generate("transformers", tmp_path / "m", PROMPTS[1]) == generate(model, PROMPTS[1])


@pytest.mark.parametrize("model_type, extra", [
    # uneven vocabulary slices, the head tied to the embedding (weights wide enough that the
    # tokens are not the last one repeated, as a tied random model gives)
    ("llama", dict(vocab_size=1001, tie_word_embeddings=True, initializer_range=0.2)),
    # a scaled embedding, q/k norms over local heads, a pad token in the last rank's rows
    ("gemma3_text", dict(vocab_size=1001, head_dim=16, sliding_window=8, pad_token_id=1000)),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),  # experts' partial sums
    ("llama", dict(num_key_value_heads=1)),  # the KV head replicated, then cut
])
def test_kvserve_local_shards_give_generate_tokens(model_type, extra, tmp_path, tokenizer):
    """kvserve's shards (local weights, its own collectives in hooks: sharding.localize) run by
    transformers' modeling code give the whole model's greedy tokens, over odd vocabularies too."""
    model = save(tmp_path / "m", tokenizer, model_type, **extra)
    prompt = [t % extra.get("vocab_size", BASE["vocab_size"]) for t in PROMPTS[2]]
    assert tp_generate("kvserve", tmp_path / "m", prompt) == generate(model, prompt)


def tp_generate(shards: str, path: Path, prompt: list[int]) -> list[int]:
    script = Path(__file__).with_name("tp_generate.py")
    # (--log-dir: torchrun's own log dirs go with the test's, not to /tmp/torchelastic_*)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
                          "--log-dir", str(path.parent / "torchrun"), str(script), shards, str(path), str(N), *map(str, prompt)],
                         capture_output=True, text=True, timeout=180, cwd=path.parent)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_killed_rank_ends_the_server_with_status_9_and_nothing_left(tmp_path, tokenizer):
    save(tmp_path / "m", tokenizer, "llama")
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", *FLAGS) as server:
        complete(server, PROMPTS[0])
        ranks = descendants(server.proc.pid)
        assert len(ranks) == 1
        os.kill(ranks[0], signal.SIGKILL)
        status = server.proc.wait(timeout=60)
        assert status == exits.ENGINE_DEAD
        log = server.log_path.read_text()
        assert f"rank 1 (pid {ranks[0]}) was killed by signal SIGKILL" in log
        assert not any(alive(p) for p in ranks)


def test_a_killed_rank_0_takes_its_ranks_with_it(tmp_path, tokenizer):
    save(tmp_path / "m", tokenizer, "llama")
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", *FLAGS) as server:
        ranks = descendants(server.proc.pid)
        server.proc.kill()
        server.proc.wait()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in ranks)


def test_a_failed_step_ends_the_engine_and_every_rank(tmp_path, tokenizer):
    """A forward that fails on rank 0 may leave the others inside a collective: the engine dies
    (503 engine_dead, exit 9) rather than run steps the ranks may not meet in."""
    save(tmp_path / "m", tokenizer, "llama")
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", *FLAGS, env={"KVSERVE_TEST_FAULTS": "requests"}) as server:
        ranks = descendants(server.proc.pid)
        r = httpx.post(server.url + "/v1/completions", headers={"X-Kvserve-Test-Fault": "forward"}, timeout=60,
                       json={"model": "m", "prompt": PROMPTS[0], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert server.proc.wait(timeout=60) == exits.ENGINE_DEAD
        assert "the tensor-parallel ranks cannot be kept in step" in server.log_path.read_text()
        assert not any(alive(p) for p in ranks)


def test_a_hung_rank_ends_the_server_after_the_collective_time_out(tmp_path, tokenizer):
    save(tmp_path / "m", tokenizer, "llama")
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", "--tensor-parallel-timeout-s", "3", *FLAGS) as server:
        ranks = descendants(server.proc.pid)
        os.kill(ranks[0], signal.SIGSTOP)
        r = httpx.post(server.url + "/v1/completions", timeout=60, json={"model": "m", "prompt": PROMPTS[1], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead", r.text
        assert server.proc.wait(timeout=60) == exits.ENGINE_DEAD
        assert not any(alive(p) for p in ranks)


def test_an_idle_server_finds_a_hung_rank(tmp_path, tokenizer):
    """Nothing runs, but rank 0 asks every rank for its figures and writes sessions to disk
    (gathering every rank's heads): a hung rank ends the engine within the time-out."""
    save(tmp_path / "m", tokenizer, "llama")
    with launch(tmp_path, "--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()),
                "--tensor-parallel-size", "2", "--tensor-parallel-timeout-s", "3", "--kv-disk-dir", str(tmp_path / "kv"),
                "--kv-persist-interval-s", "1", *FLAGS) as server:
        complete(server, PROMPTS[1], session="idle")
        ranks = descendants(server.proc.pid)
        os.kill(ranks[0], signal.SIGSTOP)
        assert server.proc.wait(timeout=60) == exits.ENGINE_DEAD
        assert "the engine is dead" in server.log_path.read_text()
        assert not any(alive(p) for p in ranks)


def test_a_rank_that_fails_to_start_ends_rank_0_with_its_status(tmp_path, tokenizer):
    save(tmp_path / "m", tokenizer, "llama")
    status, out, started = run(tmp_path, "--model", str(tmp_path / "m"), "--tensor-parallel-size", "2", *FLAGS,
                               env={"KVSERVE_TEST_FAULTS": "rank"})
    assert status == exits.MODEL_CANNOT_RUN, out
    assert "injected: rank 1 cannot start" in out and f"rank 1 (pid {started[0]}) exited with status 7" in out
    assert not any(alive(p) for p in started)


def run(tmp_path: Path, *flags: str, timeout_s: float = 180, env: dict | None = None) -> tuple[int, str, list[int]]:
    """`kvserve serve` until it exits: (status, output, the pids it started)."""
    cmd = [sys.executable, "-m", "server.cli", "serve", "--port", str(free_port()), "--cache-dir", str(cache_dir()), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env={**os.environ, **(env or {})})
    started: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        started.update(descendants(proc.pid))
        time.sleep(0.1)
    out, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
    return proc.returncode, out, sorted(started)


def test_refusals_exit_with_their_status_and_nothing_left(tmp_path, tokenizer):
    save(tmp_path / "odd", tokenizer, "llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=3)
    status, out, started = run(tmp_path, "--model", str(tmp_path / "odd"), "--tensor-parallel-size", "2", *FLAGS)
    # NOTE: every rank refuses it; rank 0 says why last, or ends first with rank 1's status and
    # points at its line
    assert status == exits.UNSUPPORTED, out
    assert "3 attention heads do not split over 2 ranks" in out and "status 5" in out.strip().splitlines()[-1]
    assert started and not any(alive(p) for p in started)

    save(tmp_path / "gpt2", tokenizer, "gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=1024)
    status, out, started = run(tmp_path, "--model", str(tmp_path / "gpt2"), "--tensor-parallel-size", "2", *FLAGS)
    assert status == exits.UNSUPPORTED, out
    assert "gpt2 has no tensor-parallel plan" in out and "status 5" in out.strip().splitlines()[-1]
    assert not any(alive(p) for p in started)

    status, out, started = run(tmp_path, "--model", str(tmp_path / "odd"), "--tensor-parallel-size", "2", "--deterministic", *FLAGS)
    assert status == exits.SETTINGS and "--deterministic: not served with --tensor-parallel-size > 1 yet" in out, out
    assert not started


def test_check_prints_each_rank(tmp_path, tokenizer):
    save(tmp_path / "m", tokenizer, "llama")
    out = subprocess.run([sys.executable, "-m", "server.cli", "serve", "--check", "--model", str(tmp_path / "m"), "--cache-dir",
                          str(cache_dir()), "--tensor-parallel-size", "2", *FLAGS], capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert [r["rank"] for r in summary["ranks"]] == [0, 1]
    for rank in summary["ranks"]:
        assert rank["kv_budget_bytes"] == 64 * 2**20 and 0 < rank["weights_bytes"] and rank["kv_heads"] == 1
    assert summary["engine"]["tensor_parallel"] == "2 ranks over gloo"


def test_two_nodes_over_loopback(tmp_path, tokenizer):
    """Node 1 runs as a second node would (the same flags, its --node-rank, no HTTP); node 0
    serves; SIGTERM on node 0 drains it and stops node 1 with status 0."""
    model = save(tmp_path / "m", tokenizer, "llama")
    port = free_port()
    nodes = ("--tensor-parallel-size", "2", "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port))
    common = ("--model", str(tmp_path / "m"), "--served-model-name", "m", "--cache-dir", str(cache_dir()), *FLAGS, *nodes)
    second = subprocess.Popen([sys.executable, "-m", "server.cli", "serve", *common, "--node-rank", "1"], cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        with launch(tmp_path, *common, "--node-rank", "0") as server:
            assert complete(server, PROMPTS[2])["choices"][0]["text"] == text_of(tokenizer, generate(model, PROMPTS[2]))
        out, _ = second.communicate(timeout=60)
        assert second.returncode == exits.OK, out
        assert "rank 1 stopped" in out
    finally:
        second.kill()
