"""A step's grammar masks: microseconds to put R rows' masks on their logits, the way the
engine does it now against the way it did before, in one run (issue 47; the first user's
path: every row under a JSON schema, Qwen2.5's vocabulary of 152,064).

    .venv/bin/python -m bench.masks [--vocab 152064] [--rows 1 8 64] [--device cpu|cuda]

Both ways start from llguidance's mask words [R, ceil(vocab / 32)] int32 on the host (what
its executor writes) and end with the masks added to float32 logits [R, vocab] on `--device`:

* words (now): the words stacked, one copy to the device that does not wait, unpacked there
  into additive masks and added (`grammars.matcher.additive_masks`, `sampler.apply_constraints`);
* floats (before): each row's words unpacked on the host into a float32 mask of 0 / -inf
  (`np.unpackbits` and a lookup: the mask worker's thread did it during the forward pass), the
  masks stacked, pinned and copied (R x 608 KB at Qwen's vocabulary), and added.

On CUDA each step ends with a synchronize, so a time is the host's work and the device's. On
CPU the "device" is the host: the words' unpacking is host time there too, and the floats'
unpacking (which the worker thread overlapped with the forward pass) is counted in full.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from grammars.matcher import additive_masks

LUT = np.array([-np.inf, 0.0], dtype=np.float32)  # a bit -> its additive mask value (the way before)


def floats(words: np.ndarray, logits: torch.Tensor) -> None:
    """The way before: float masks built on the host, stacked, copied, added."""
    vocab = logits.shape[-1]
    masks = [torch.from_numpy(LUT[np.unpackbits(row.view(np.uint8), count=vocab, bitorder="little")]) for row in words]
    stacked = torch.stack(masks)
    if logits.device.type == "cuda":
        stacked = stacked.pin_memory()
    logits.add_(stacked.to(logits.device, non_blocking=True))


def now(words: np.ndarray, logits: torch.Tensor) -> None:
    """The engine's way: words stacked (as `apply_constraints` stacks the rows'), unpacked on the device."""
    logits.add_(additive_masks(np.stack(list(words)), logits.shape[-1], logits.device))


def timed(way, words: np.ndarray, logits: torch.Tensor, steps: int) -> float:
    """Median seconds of one step of `way` (after two untimed)."""
    sync = torch.cuda.synchronize if logits.device.type == "cuda" else (lambda: None)
    times = []
    for i in range(steps + 2):
        sync()
        t0 = time.perf_counter()
        way(words, logits)
        sync()
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    n_words = -(-args.vocab // 32)
    print(f"vocabulary {args.vocab}, {args.device}")
    print("| rows | floats, before (us/step) | words, now (us/step) | now / before | bytes copied, before -> now |")
    print("|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        words = rng.integers(-(2**31), 2**31, size=(rows, n_words), dtype=np.int64).astype(np.int32)
        logits = torch.zeros(rows, args.vocab, device=args.device)
        check = logits.clone()
        floats(words, logits)
        now(words, check)
        assert torch.equal(logits, check), "the two ways give different masks"
        before, after = timed(floats, words, logits, args.steps), timed(now, words, logits, args.steps)
        print(f"| {rows} | {before * 1e6:,.0f} | {after * 1e6:,.0f} | {after / before:.2f} | {rows * args.vocab * 4:,} -> {words.nbytes:,} |")


if __name__ == "__main__":
    main()
