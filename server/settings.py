"""Deployment settings: one pydantic-settings model, read from `KVSERVE_*` env vars and CLI flags.

Every field is documented here once; `server.cli` turns each field into a `--flag` of the same
name, so the env var `KVSERVE_MAX_QUEUE=8` and the flag `--max-queue 8` are two spellings of one
setting. A flag wins over the env var.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict
from typing_extensions import Annotated


def adapter_name_problem(name: str) -> str | None:
    """What keeps `name` from naming a LoRA adapter (a model id: 1-128 characters without
    whitespace, '/', '|' or ':'); None when it can."""
    if not name or len(name) > 128 or any(c.isspace() or c in "/|:" for c in name):
        return f"the adapter name {name!r} must be 1-128 characters without whitespace, '/', '|' or ':'"
    return None


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "kvserve"


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVSERVE_", extra="ignore")

    model: str | None = Field(
        None,
        description="Local HF directory, hub id (read from the HF cache) or a .gguf file; "
        "unset = the embedded SmolLM2-135M-Instruct.",
    )
    served_model_name: str | None = Field(
        None, description="Model id reported by /v1/models; default: derived from --model."
    )
    task: Literal["auto", "generate", "embed", "rerank"] = Field(
        "auto",
        description="What the model is served for, one task per server: generate = chat, completions, Responses "
        "(a causal LM); embed = /v1/embeddings (pooling from the checkpoint's sentence-transformers modules, else "
        "mean for an encoder and a normalized last token for a decoder); rerank = /v1/rerank and /v1/score (a "
        "*ForSequenceClassification cross-encoder, or a causal LM scored by its yes/no logits as Qwen3-Reranker). "
        "auto = embed for a sentence-transformers checkpoint (modules.json), rerank for a *ForSequenceClassification "
        "architecture, else generate. The other task's routes answer 400.",
    )
    model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Other ids accepted in the `model` field (comma-separated)."
    )
    lora: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="LoRA adapters (PEFT directories) served beside the base model, each as NAME=PATH "
        "(comma-separated in the env var; the flag may repeat); a request picks one by its NAME in "
        "the `model` field. Each adapter's sessions and cached prefixes are its own.",
    )
    max_loras: int = Field(
        8, ge=1, le=1024,
        description="Most LoRA adapters resident on the device at once (a step with adapter rows computes "
        "all their columns); the others wait in host memory and are swapped in, least recently used out.",
    )
    max_cpu_loras: int | None = Field(
        None, ge=1, le=4096,
        description="Most LoRA adapters loaded at once, device and host memory together; a load beyond it is "
        "refused (507). Default: 32, or --max-loras when higher.",
    )
    max_lora_rank: int = Field(
        64, ge=1, le=512, description="Largest LoRA rank accepted; an adapter of a higher rank is refused."
    )
    enable_lora_loading: bool = Field(
        False,
        description="Serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (behind the API key), for "
        "adapters under --lora-dir only. Reserves device memory for --max-loras adapters of --max-lora-rank "
        "on every linear layer from the start.",
    )
    lora_dir: Path | None = Field(
        None, description="The directory run-time loads may read adapters from (required by --enable-lora-loading)."
    )
    host: str = Field("127.0.0.1", description="Interface to bind.")
    port: int = Field(8000, ge=0, le=65535, description="Port to bind (0 = any free port).")
    api_key: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Accepted bearer keys (comma-separated in the env var; the flag may repeat). "
        "Each key is its own principal. Empty = no auth.",
    )
    api_key_file: Path | None = Field(
        None, description="File with one API key per line, added to --api-key."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="auto = bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = CUDA when available, else CPU."
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64,
        description="Ranks the model is split over by its tensor-parallel plan, one process per GPU (gloo on CPU). "
        "kvserve starts the other ranks of this node itself; under torchrun (WORLD_SIZE set) each process joins as "
        "its RANK. Rank 0 serves HTTP; the others follow its steps.",
    )
    nnodes: int = Field(
        1, ge=1, le=64,
        description="Nodes the --tensor-parallel-size ranks span, as many on each; every node runs kvserve with the "
        "same flags and its own --node-rank, and rank 0 (on node 0) serves HTTP.",
    )
    node_rank: int = Field(0, ge=0, description="This node's index among --nnodes (0: the node that serves HTTP).")
    master_addr: str = Field(
        "127.0.0.1", description="Address of node 0, where the ranks meet (torch.distributed's rendezvous over TCP)."
    )
    master_port: int | None = Field(
        None, ge=1, le=65535,
        description="Port on --master-addr where the ranks meet; unset = a free port (one node only: several need it).",
    )
    tensor_parallel_timeout_s: float = Field(
        120.0, gt=0, le=86400,
        description="How long a rank waits for the others in one collective (start-up, a step, or the leader's idle "
        "heartbeat) before it gives the engine up as dead.",
    )
    trust_remote_code: bool = Field(False, description="Allow model code from the model's repo.")
    cache_dir: Path = Field(
        default_factory=default_cache_dir,
        description="Where converted models (GGUF -> safetensors) are kept between starts.",
    )
    max_model_len: int | None = Field(
        None, ge=16, description="Context length; default the model's own."
    )
    max_queue: int = Field(
        64, ge=1, le=100_000, description="Requests waiting for the engine; more get 429."
    )
    max_running: int = Field(
        16, ge=1, le=1024, description="Sequences decoding at once; the rest wait in the queue."
    )
    max_batch_tokens: int = Field(
        512, ge=1, le=1_000_000,
        description="Tokens one engine step computes in its single forward pass: one per decoding "
        "sequence, the rest prefill chunks (first come, first served). A sequence alone prefills "
        "its whole prompt in one pass.",
    )
    max_tokens_default: int = Field(
        512, ge=1,
        description="max_tokens when a request sets none (capped by the context and --max-request-tokens).",
    )
    max_request_tokens: int | None = Field(
        None, ge=1,
        description="Most work one request may ask for: prompts x n x max_tokens, each token counted "
        "1 + top_logprobs times (its logprob entries); more is a 400 naming the field to lower. "
        "Unset = 8 x the context (--max-model-len).",
    )
    request_timeout_s: float = Field(
        600.0, gt=0, description="A request still running after this many seconds is ended (504)."
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="Larger request bodies get 413. Serving a vision-language model, the limit "
        "grows by room for --max-request-image-bytes of images as base64 data: URLs."
    )
    session_reuse: bool = Field(
        True, description="Keep each session's KV cache between requests (off: every request prefills)."
    )
    anonymous_reuse: bool = Field(
        None,
        description="Requests without a session id may reuse the longest matching prefix "
        "among the same API key's earlier anonymous requests (in steps of 32 tokens). Unset = "
        "auto: on with API keys, off without (keyless, every caller would share one cache); "
        "env value 'auto' = unset.",
    )
    session_ttl_s: float = Field(1800.0, gt=0, description="Idle sessions expire after this long.")
    kv_budget_bytes: int | None = Field(
        None, ge=1,
        description="Bytes of KV cache for all sessions together; unset = measured on a GPU "
        "(--gpu-memory-utilization), --kv-budget-fraction of RAM on CPU. Below one sequence at the "
        "full context (--max-model-len) the server refuses to start.",
    )
    gpu_memory_utilization: float = Field(
        0.9, gt=0, le=1.0,
        description="On a GPU without --kv-budget-bytes: the share of the GPU's total memory kvserve "
        "may fill. The KV budget is that share less what is in use after loading (weights, CUDA "
        "context, other processes), the activation peak of a forward pass at --max-batch-tokens, "
        "attention's workspace and a reserve, measured at start-up.",
    )
    kv_budget_fraction: float = Field(
        0.25, gt=0, le=0.95,
        description="On CPU without --kv-budget-bytes: this share of physical RAM.",
    )
    kv_cache_dtype: Literal["auto", "fp8", "int8"] = Field(
        "auto",
        description="How the KV cache is stored, on the device and in the host and disk tiers: "
        "auto = the model's dtype; fp8 = float8 e4m3, int8 = 8-bit integers, each with one bf16 "
        "scale per token and KV head (about half the bytes of bf16, a quarter of fp32; dequantized "
        "when attention reads it).",
    )
    mla_cache: Literal["auto", "latent", "heads"] = Field(
        "auto",
        description="How a multi-head latent attention model (DeepSeek-V2/V3, Kimi K2, GLM-4.7-Flash, "
        "MiniCPM3, LongCat...) keeps its KV: latent = the compressed KV and the shared rotary key "
        "per token and layer, attended from it (1/71 of the per-head "
        "keys and values for DeepSeek-V3's shape); heads = transformers' decompressed keys and "
        "values per head; auto = latent unless LoRA adapters are served (one may target "
        "kv_b_proj) or the latent's logits differ from transformers' at load (the log says why). "
        "Models without MLA ignore it.",
    )
    kv_host_bytes: int = Field(
        0, ge=0,
        description="Bytes of pinned host memory for idle sessions' KV evicted from the GPU "
        "(copied asynchronously; restored when cheaper than recomputing). CUDA only: on a CPU "
        "the device budget is already host memory. 0 = off.",
    )
    kv_disk_dir: Path | None = Field(
        None,
        description="Directory for the disk KV tier: idle sessions evicted from memory, and every "
        "session on shutdown (SIGTERM) and each --kv-persist-interval-s, so sessions survive a "
        "restart. Unset = off.",
    )
    kv_disk_bytes: int | None = Field(
        None, ge=1,
        description="Byte bound of the disk KV tier (its files, writes in progress included; the "
        "least recently used sessions' files are deleted to stay within); unset = 8 GiB, or half "
        "the free space of its file system at start where that is less.",
    )
    kv_persist_interval_s: float = Field(
        60.0, gt=0,
        description="How often resident sessions whose KV changed are written to the disk tier "
        "(in the background; they stay resident).",
    )
    allowed_media_domains: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Hosts from which images may be fetched by URL (comma-separated in the env var; the flag "
        "may repeat): `example.com` that host, `*.example.com` its subdomains. Empty = only data: URLs. "
        "Fetches go over http(s) to public addresses only, redirects re-checked, with a byte cap and a time-out.",
    )
    max_image_bytes: int = Field(20 * 2**20, ge=1, description="Largest encoded image (bytes); larger ones get 400.")
    max_request_image_bytes: int = Field(50 * 2**20, ge=1, description="Most image bytes in one request, all images together.")
    max_images_per_request: int = Field(16, ge=1, description="Most images in one request.")
    max_image_pixels: int = Field(
        6000 * 6000, ge=1, description="Most pixels (width x height) of one image, read from its header before it is decoded."
    )
    media_fetch_timeout_s: float = Field(10.0, gt=0, description="Time-out of fetching one image by URL (connect and body).")
    encoder_cache_bytes: int = Field(
        256 * 2**20, ge=0, description="Bytes of image features kept by digest, so a picture seen again skips the vision encoder "
        "(on a GPU, set aside from the KV budget).",
    )
    response_store_bytes: int = Field(
        64 * 2**20, ge=0,
        description="Bytes of stored responses (/v1/responses with store: true), each holding its "
        "whole conversation; the least recently used are evicted (then 404) to stay within. "
        "Kept in memory, and under <--kv-disk-dir>/responses when the disk tier is on, so they "
        "survive a restart. 0 = nothing is stored.",
    )
    reject_busy_sessions: bool = Field(
        False, description="A second concurrent request on a busy session gets 409 instead of waiting."
    )
    cpu_packed_weights: bool = Field(
        True,
        description="On CPU, run the linear layers on copies of their weights packed for oneDNN "
        "(faster at every batch size, but the linear weights are held twice); off: the dense "
        "weights only.",
    )
    cuda_graphs: Literal["auto", "off", "require"] = Field(
        "auto",
        description="On CUDA, capture decode steps as CUDA graphs at start-up (one per batch and "
        "context bucket) and replay them: auto = try (a failed capture logs a WARNING and runs "
        "eagerly), require = refuse to start without them (exit status 8), off "
        "(--no-cuda-graphs) = every step runs eagerly.",
        json_schema_extra={"negated": "off"},
    )
    compile: Literal["auto", "off", "require"] = Field(
        "auto",
        description="Compile the decode steps' forward with torch.compile (inductor) at start-up, "
        "inside the CUDA graphs (on CUDA the steps that carry prefill chunks, forced or drafted "
        "tokens run it too, without a graph): auto = on CUDA (a failed compilation logs a WARNING and runs "
        "eagerly; on CPU, where it is not faster, off), require = compile on any device or refuse "
        "to start (exit status 8), off (--no-compile) = eager. With --tensor-parallel-size > 1 every "
        "rank compiles its shard, and a compilation that fails on any rank ends the start. Compiled "
        "kernels are cached under --cache-dir, so a restart skips most of the compilation.",
        json_schema_extra={"negated": "off"},
    )
    overlap: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Launch each decode step (and each with a row's forced tokens, or after a prompt's "
        "last chunk) before the previous step's tokens reach the host, "
        "so the device computes it while the host detokenizes and streams, where every row's "
        "token is chosen on the device (greedy, or a draw with temperature, top-k, top-p and a logit "
        "bias, under a grammar's mask or not; not penalty or logprobs rows): a row "
        "that stopped loses the token computed past its stop (never sent, never kept in its "
        "session). auto = on CUDA; on = on CPU too (where steps do not overlap: for tests); "
        "off (--no-overlap) = each step waits for the previous one. Hybrid and LongRoPE models "
        "and decode steps off the paged path run without it (a logged fallback), and so does "
        "speculative decoding (it drafts from each step's tokens on the host); steps wait for each "
        "other while more than a tenth of the rows have tokens forced (a schema of short keys: under "
        "the overlap a forced token costs its row a step).",
        json_schema_extra={"negated": "off"},
    )
    deterministic: bool = Field(
        False,
        description="Exact mode: a request's tokens and logprobs are bit-identical whatever else "
        "runs in its batch, however its prompt is chunked, reused from a session or restored "
        "from a tier, with speculation on or off (batch-invariant linear layers and attention, "
        "docs/architecture.md). Costs some speed; off: the fast mode (near-ties may flip).",
    )
    reasoning_parser: str = Field(
        "auto",
        description="How a thinking model's reasoning is told apart from its answer: auto = from the "
        "tokenizer's markers (none for models without); none = all output is the answer; or a "
        "parser name (qwen3, deepseek_r1, glm45, smollm3, gpt_oss).",
    )
    max_reasoning_tokens: int | None = Field(
        None, ge=0,
        description="Default thinking budget per request (tokens between the reasoning markers); the "
        "engine then writes the end marker itself. Unset = unbounded (max_tokens still caps the total).",
    )
    json_whitespace_flexible: bool = Field(
        False, description="Structured JSON may contain free whitespace (default: compact JSON)."
    )
    grammar_compile_timeout_s: float = Field(
        5.0, gt=0, description="A grammar that takes longer to compile is rejected (400)."
    )
    grammar_cache_size: int = Field(256, ge=1, description="Compiled grammars kept (LRU).")
    grammar_cache_bytes: int = Field(
        256 * 2**20, ge=1,
        description="Estimated bytes of the compiled grammars kept (LRU, beside --grammar-cache-size): "
        "each counts 128 KiB plus 128 bytes per byte of its schema or grammar text; one larger than "
        "the bound is used but not kept.",
    )
    speculative: Literal["off", "ngram", "draft"] = Field(
        "off",
        description="Speculative decoding: draft tokens, verify them in the step's one forward pass, "
        "keep the accepted ones (same output). ngram = prompt lookup (drafts copy what followed the "
        "last tokens earlier in the prompt or output); draft = a small model of the same "
        "tokenizer (--draft-model). Requests opt out with \"speculative\": false.",
    )
    draft_model: str | None = Field(
        None, description="With --speculative draft: the draft model (HF directory, hub id or .gguf)."
    )
    speculative_max_draft: int = Field(
        15, ge=1, le=64,
        description="Most tokens one sequence drafts per step; each step drafts fewer (or none) "
        "when its recent acceptance rate or the batch makes them not worth their cost.",
    )
    speculative_ngram_min: int = Field(
        1, ge=1, le=16,
        description="Prompt lookup: the shortest suffix (in tokens) that it matches; a one-token "
        "match drafts only when the acceptance rate and step cost make it worth it.",
    )
    speculative_ngram_max: int = Field(
        4, ge=1, le=16, description="Prompt lookup: the longest suffix it tries first."
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="Serve /metrics on this separate port too, without auth (for scrapers).",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, how long in-flight requests may run before exit."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="Log level.")

    @field_validator("cuda_graphs", "compile", mode="before")
    @classmethod
    def _mode_as_bool(cls, value: object) -> object:
        """true/on (the flag's old boolean form) = auto; false = off."""
        if isinstance(value, bool) or str(value).lower() in ("true", "false", "on", "1", "0"):
            return "auto" if str(value).lower() in ("true", "on", "1") else "off"
        return value

    @field_validator("anonymous_reuse", mode="wrap")
    @classmethod
    def _auto(cls, value: object, handler) -> object:
        # NOTE: the field stays a plain bool for the CLI (--x / --no-x); None is "auto".
        if value is None or (isinstance(value, str) and value.strip().lower() in ("auto", "")):
            return None
        return handler(value)

    @model_validator(mode="after")
    def _ranks_fit_nodes(self) -> "Settings":
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"--tensor-parallel-size {self.tensor_parallel_size} is not a multiple of --nnodes {self.nnodes}")
        if self.node_rank >= self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} is not one of --nnodes {self.nnodes}")
        if self.nnodes > 1 and self.master_port is None:
            raise ValueError("--nnodes > 1 needs --master-port (and --master-addr): every node must meet at the same one")
        if self.tensor_parallel_size > 1:
            # NOTE: each of these keeps or moves state one rank alone would hold
            unsharded = [flag for flag, on in (
                ("--lora/--enable-lora-loading", self.serves_adapters),
                ("--deterministic", self.deterministic),
                ("--overlap on", self.overlap == "on"),
                (f"--task {self.task}", self.task in ("embed", "rerank")),
            ) if on]
            if unsharded:
                raise ValueError(f"{', '.join(unsharded)}: not served with --tensor-parallel-size > 1 yet")
        return self

    @model_validator(mode="after")
    def _speculation_is_complete(self) -> "Settings":
        if self.speculative == "draft" and not self.draft_model:
            raise ValueError("--speculative draft needs --draft-model")
        if self.speculative_ngram_min > self.speculative_ngram_max:
            raise ValueError("--speculative-ngram-min must not exceed --speculative-ngram-max")
        if self.speculative != "off" and self.overlap == "on":
            raise ValueError("--overlap on and --speculative exclude each other: speculation drafts from each step's tokens on the host")
        return self

    @model_validator(mode="after")
    def _resolve_anonymous_reuse(self) -> "Settings":
        # NOTE: "auto" (None) is resolved here, so every reader of the field sees a bool.
        if self.anonymous_reuse is None:
            try:
                self.anonymous_reuse = bool(self.api_keys())
            except OSError:  # an unreadable key file: keys were meant (startup fails on it)
                self.anonymous_reuse = True
        return self

    @field_validator("lora")
    @classmethod
    def _name_equals_path(cls, value: list[str]) -> list[str]:
        names = []
        for entry in value:
            name, sep, path = entry.partition("=")
            name = name.strip()
            if not sep or not path.strip():
                raise ValueError(f"--lora {entry!r}: expected NAME=PATH")
            if problem := adapter_name_problem(name):
                raise ValueError(f"--lora {entry!r}: {problem}")
            if name in names:
                raise ValueError(f"--lora: the name {name!r} is given twice")
            names.append(name)
        return value

    @model_validator(mode="after")
    def _loras_fit(self) -> "Settings":
        if len(self.lora) > self.lora_capacity:
            raise ValueError(f"{len(self.lora)} --lora adapters, but --max-cpu-loras is {self.lora_capacity}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras {self.max_cpu_loras} is below --max-loras {self.max_loras}")
        if self.enable_lora_loading and (self.lora_dir is None or not self.lora_dir.is_dir()):
            raise ValueError("--enable-lora-loading needs --lora-dir, an existing directory: run-time loads read adapters from under it only")
        return self

    @property
    def lora_capacity(self) -> int:
        """Most adapters loaded at once (--max-cpu-loras, or its default)."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else max(32, self.max_loras)

    @property
    def serves_adapters(self) -> bool:
        return bool(self.lora) or self.enable_lora_loading

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each --lora, in the order given."""
        return [(name.strip(), path.strip()) for name, _, path in (entry.partition("=") for entry in self.lora)]

    @field_validator("api_key", "model_aliases", "lora", "allowed_media_domains", mode="before")
    @classmethod
    def _split_commas(cls, value: object) -> object:
        if isinstance(value, str):
            return [part.strip() for part in value.split(",") if part.strip()]
        return value

    def api_keys(self) -> list[str]:
        """Keys from --api-key and --api-key-file, in that order, without duplicates."""
        keys = list(self.api_key)
        if self.api_key_file is not None:
            keys += [line.strip() for line in self.api_key_file.read_text().splitlines()]
        return list(dict.fromkeys(k for k in keys if k and not k.startswith("#")))
