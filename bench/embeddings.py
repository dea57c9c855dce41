"""Embeddings: sentences per second of kvserve's /v1/embeddings (a real `kvserve serve --task embed`
process, concurrent batched requests) against sentence-transformers' `encode` (batched) on the same
random-weight model, in one run.

    .venv/bin/python -m bench.embeddings [--shape minilm] [--sentences 512] [--clients 8] [--batch 16] [--max-batch-tokens 512] [--rounds 3] [--threads N]
    .venv/bin/python -m bench.embeddings --save DIR [--kind bert-mean]   # a tiny checkpoint to serve

Prints sentences/s of each and their ratio, and the largest difference between the two vectors
of a sentence. The checkpoints built here (no hub) are what tests/server/test_embeddings.py
serves: `KINDS` names them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch

# a small English vocabulary: WordPiece's whole words, with letters and '##' letters for the rest
WORDS = (
    "the of and to in is was for on that with as by at from it his an were are which this be or has had not first one "
    "their its new after who they have her she two been other when there all during into school time may years more "
    "most only over city some world would where later up such used many can state about national out known university "
    "united then made also what river capital china beijing paris france gravity force planet sun moon light water sea "
    "mountain music book film game team war king queen house road train ship art science history language people day "
    "night year week good great small large old young long short high low red blue green black white dog cat bird fish "
    "tree flower rain snow wind cloud star earth fire stone gold iron bread milk tea coffee query document answer search "
    "question passage relevant weight movement bodies attracts physical objects responsible around"
).split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LETTERS = "abcdefghijklmnopqrstuvwxyz0123456789.,?!'-"

# hidden, layers, heads, intermediate
SHAPES = {"tiny": (32, 2, 2, 64), "minilm": (384, 6, 12, 1536)}  # minilm: all-MiniLM-L6-v2's shape
# what --save writes: (architecture, pooling written in modules.json or None, Normalize module)
KINDS = {
    "bert-mean": ("bert", "mean", True),  # all-MiniLM's layout: mean pooling + Normalize
    "bert-cls": ("bert", "cls", False),  # CLS pooling, unnormalized
    "qwen3-embed": ("qwen3", None, False),  # Qwen3-Embedding's kind: no modules.json, last token + L2
    "bert-reranker": ("bert-classifier", None, False),  # a cross-encoder (BertForSequenceClassification)
    "qwen3-reranker": ("qwen3", None, False),  # Qwen3-Reranker's kind: a causal LM scored by yes/no
}


def bert_tokenizer(directory: Path):
    """A WordPiece tokenizer over `WORDS` (lower-cased), written into `directory` and loaded."""
    from transformers import BertTokenizerFast

    directory.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + list(dict.fromkeys(WORDS + list(LETTERS) + [f"##{c}" for c in LETTERS]))
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(directory / "vocab.txt"), do_lower_case=True)
    tokenizer.model_max_length = 512
    return tokenizer


def bert(shape: str, vocab_size: int, classifier: bool = False, seed: int = 0):
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    hidden, layers, heads, inner = SHAPES[shape]
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=inner, max_position_embeddings=512, num_labels=1, initializer_range=0.2)
    return (BertForSequenceClassification if classifier else BertModel)(config).eval()


def qwen3(shape: str, vocab_size: int, seed: int = 0):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    hidden, layers, heads, inner = SHAPES[shape]
    config = Qwen3Config(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads, intermediate_size=inner,
                         max_position_embeddings=2048, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


def write_modules(directory: Path, pooling: str, normalize: bool, dimension: int) -> None:
    """sentence-transformers' files: modules.json, the Pooling module's config (mean in the legacy
    boolean keys, other modes in the current `pooling_mode`) and a Normalize module."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir(exist_ok=True)
    (directory / "modules.json").write_text(json.dumps(modules, indent=2))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    if pooling == "mean":
        config = {"word_embedding_dimension": dimension, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                  "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False}
    else:
        config = {"embedding_dimension": dimension, "pooling_mode": pooling, "include_prompt": True}
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(config, indent=2))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 512, "do_lower_case": False}))


def save(kind: str, directory: str | Path, shape: str = "tiny") -> Path:
    """Write the random-weight checkpoint `kind` (`KINDS`) of `shape` to `directory`."""
    arch, pooling, normalize = KINDS[kind]
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if arch.startswith("bert"):
        tokenizer = bert_tokenizer(directory)
        model = bert(shape, len(tokenizer), classifier=arch == "bert-classifier")
    else:
        from bench.architectures import tokenizer as smollm2_tokenizer

        tokenizer = smollm2_tokenizer()
        model = qwen3(shape, len(tokenizer))
        if kind == "qwen3-embed":
            # NOTE: as Qwen3-Embedding embeds plain text; sentence-transformers >= 5 would render a
            # text through a decoder tokenizer's chat template (its "message" modality) when it has one
            tokenizer.chat_template = None
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    if pooling is not None:
        write_modules(directory, pooling, normalize, model.config.hidden_size)
    return directory


def sentences(n: int, seed: int = 0) -> list[str]:
    """`n` sentences of 6 to 40 words from `WORDS`, a fixed draw."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 40))).capitalize() + "." for _ in range(n)]


def measure(directory: Path, texts: list[str], clients: int, batch: int, batch_tokens: int, rounds: int,
            log_dir: Path, threads: int | None = None) -> tuple[float, float, float]:
    """(kvserve's sentences/s, sentence-transformers', the largest |difference| of a vector
    component), each rate the best of `rounds` alternating passes over `texts` (on a shared box,
    the best pass is the one least disturbed). kvserve: a `kvserve serve --task embed` process,
    `clients` concurrent clients sending requests of `batch` sentences, its forward passes of at
    most `batch_tokens` padded tokens; sentence-transformers: `encode` with `batch_size=batch`.
    `threads`: torch's threads in each (None: its default, one per core)."""
    import asyncio
    import time

    from openai import AsyncOpenAI
    from sentence_transformers import SentenceTransformer

    from bench.common import launch

    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    reference = SentenceTransformer(str(directory), device="cpu")
    env = {"OMP_NUM_THREADS": str(threads)} if threads else None
    if threads:
        torch.set_num_threads(threads)
    with launch(log_dir, "--model", str(directory), "--task", "embed", "--device", "cpu", "--dtype", "float32",
                "--max-queue", "1024", "--max-batch-tokens", str(batch_tokens), env=env) as server:
        client = AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        out: dict[int, list] = {}

        async def worker(k: int) -> None:
            for c in range(k, len(chunks), clients):
                answer = await client.embeddings.create(model=directory.name, input=chunks[c])
                out[c] = [d.embedding for d in answer.data]

        async def served_pass() -> float:
            start = time.perf_counter()
            await asyncio.gather(*(worker(k) for k in range(clients)))
            return time.perf_counter() - start

        def reference_pass() -> tuple[float, torch.Tensor]:
            start = time.perf_counter()
            vectors = reference.encode(texts, batch_size=batch, convert_to_tensor=True)
            return time.perf_counter() - start, vectors

        loop = asyncio.new_event_loop()
        loop.run_until_complete(client.embeddings.create(model=directory.name, input=texts[:batch]))  # warm
        reference.encode(texts[:batch], batch_size=batch)
        served, ref = [], []
        for _ in range(rounds):
            served.append(loop.run_until_complete(served_pass()))
            took, expected = reference_pass()
            ref.append(took)
        loop.run_until_complete(client.close())
        loop.close()
    got = torch.tensor([v for c in range(len(chunks)) for v in out[c]])
    return len(texts) / min(served), len(texts) / min(ref), (got - expected.float()).abs().max().item()


def main() -> None:
    import argparse
    import tempfile

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="minilm")
    parser.add_argument("--sentences", type=int, default=512)
    parser.add_argument("--clients", type=int, default=8, help="concurrent HTTP clients")
    parser.add_argument("--batch", type=int, default=16, help="sentences per request, and encode's batch_size")
    parser.add_argument("--max-batch-tokens", type=int, default=512, help="the server's padded tokens per forward pass (its default)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating passes of each; the best counts")
    parser.add_argument("--threads", type=int, help="torch threads of each side (default: one per core); 1 on a shared box")
    parser.add_argument("--save", metavar="DIR", help="write the tiny checkpoint --kind to DIR and exit (docs/guides/embeddings.md)")
    parser.add_argument("--kind", choices=sorted(KINDS), default="bert-mean")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    if args.save:
        save(args.kind, args.save)
        print(f"a random-weight {args.kind} checkpoint in {args.save}")
        return
    texts = sentences(args.sentences)
    with tempfile.TemporaryDirectory(prefix="kvserve-bench-") as tmp:
        directory = save("bert-mean", Path(tmp) / f"bert-mean-{args.shape}", shape=args.shape)
        served, reference, diff = measure(directory, texts, args.clients, args.batch, args.max_batch_tokens, args.rounds, Path(tmp),
                                          args.threads)
    print(f"bert-mean ({args.shape} shape, mean pooling + Normalize), {len(texts)} sentences of 6-40 words, fp32 on CPU, "
          f"{args.threads or torch.get_num_threads()} torch thread(s) each, best of {args.rounds} alternating passes")
    print("| measure | kvserve | sentence-transformers | ratio |")
    print("|---|---|---|---|")
    print(f"| sentences/s ({args.clients} clients x {args.batch} a request, --max-batch-tokens {args.max_batch_tokens} / "
          f"encode batch_size {args.batch}) | {served:.1f} | {reference:.1f} | **{served / reference:.2f}** |")
    print(f"largest |difference| of a vector component: {diff:.2e}")


if __name__ == "__main__":
    main()
