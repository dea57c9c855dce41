"""Sampling as small pure functions over a step's logits.

Shapes: `logits` is a float32 tensor [rows, vocab] (one row per sequence; the per-sequence helpers
take a [vocab] row); `counts` is an int tensor [vocab] with how often each token was generated
so far (for the penalties), on the logits' device. Every function returns a new tensor or
modifies only what it is documented to modify.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


@dataclass(slots=True)
class SamplingParams:
    """What the engine needs to pick tokens; built by the HTTP layer from the wire request."""

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if not (0.0 <= self.temperature <= 2.0):
            raise ValueError("temperature must be in [0, 2]")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not (0 <= self.top_logprobs <= 20):
            raise ValueError("top_logprobs must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        # NOTE: a temperature too small to divide by (in float32 or bf16 logits) is greedy, as
        # it is in the limit; vLLM draws the same line.
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator on the device where its draws are made (the logits'): the same
    seed gives the same draws whatever else runs."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed % (2**63))
    return generator


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a tensor on `device`, without waiting for the device: on CUDA a
    pinned copy sent non-blocking (`torch.tensor(..., device=cuda)` copies from pageable memory
    and waits for every kernel queued before it, which would stall a step launched ahead)."""
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`tensor`'s rows `rows` (a host list, in its order), without waiting for the device
    (indexing a CUDA tensor with a list copies it from pageable memory, which waits for every
    kernel queued before it); `tensor` itself where `rows` is each of its rows in order."""
    if rows == list(range(tensor.shape[0])):
        return tensor
    return tensor[device_tensor(rows, torch.long, tensor.device)]


def apply_logit_bias(logits: torch.Tensor, biases: list[dict[int, float]]) -> torch.Tensor:
    """Logits [rows, vocab] with each row's bias (token id -> added value) added: a new tensor,
    or `logits` itself when no row has one. One host-to-device copy and one add for all rows."""
    vocab = logits.shape[-1]
    entries = [(row * vocab + token, value) for row, bias in enumerate(biases) for token, value in bias.items()]
    if not entries:
        return logits
    # NOTE: one float64 tensor carries the flat places and the values (exact for any vocabulary
    # size). index_add, not index_put(accumulate=True): that one sorts its indices and reads
    # their range back to the host (a sync on CUDA, which a step launched ahead would wait on);
    # a row holds a token once, so no two adds meet and the sums are the same bits
    places, values = device_tensor(list(zip(*entries)), torch.float64, logits.device)
    return logits.flatten().index_add(0, places.long(), values.to(logits.dtype)).view(logits.shape)


def apply_penalties(
    logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float
) -> torch.Tensor:
    """OpenAI's definition: logit -= presence * [count > 0] + frequency * count."""
    if presence == 0.0 and frequency == 0.0:
        return logits
    counts = counts.to(logits.dtype)
    return logits - presence * (counts > 0).to(logits.dtype) - frequency * counts


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from processed logits [vocab]: argmax when greedy, else a seeded
    draw; ValueError where it draws from no distribution (`checked`)."""
    return checked(sample_rows(logits[None], [params], [generator]))[0]


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> list[int]:
    """`sample_ids`' tokens on the host, in one copy."""
    return sample_ids(logits, params, generators).tolist()


def sample_ids(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of processed logits [rows, vocab], as a long tensor [rows] on their
    device, nothing read back: argmax for greedy rows; for the others temperature, top-k and
    top-p per row, vectorised, then a draw (`draw_ids`): a row with a generator from it (it
    draws the same whatever else is in the batch), the rows without one all in one call. -1
    for a row that draws from no distribution: the caller fails that row alone, and the others
    keep their draws (a seeded row draws once)."""
    greedy = [i for i, p in enumerate(params) if p.greedy]
    drawn = [i for i, p in enumerate(params) if not p.greedy]
    if not drawn:
        return torch.argmax(logits, dim=-1)
    ids = draw_ids(filtered_probs(take_rows(logits, drawn), [params[i] for i in drawn]), [generators[i] for i in drawn])
    if not greedy:
        return ids
    out = torch.argmax(logits, dim=-1)  # (the drawn rows' argmax is overwritten: one kernel, not a gather)
    return out.index_copy(0, device_tensor(drawn, torch.long, logits.device), ids)


def draw_rows(probs: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """`draw_ids`, on the host: only the drawn ids cross, in one copy; ValueError where a row
    drew from no distribution (`checked`)."""
    return checked(draw_ids(probs, generators).tolist())


def checked(tokens: list[int]) -> list[int]:
    """`tokens`, or ValueError where a row drew from no distribution (`draw_ids`' -1)."""
    if min(tokens, default=0) < 0:
        raise ValueError(f"rows {[i for i, t in enumerate(tokens) if t < 0]} drew from no distribution (NaN or inf in their logits)")
    return tokens


def draw_ids(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probabilities [rows, vocab] (each row's own scale), as a long
    tensor [rows] on the probabilities' device, in row order. A row with a generator draws
    from it, where it lives (a seeded row draws the same whatever else is in the batch; the
    engine makes generators on the probabilities' device); the rows without one draw
    together, in one call, from the device's default generator. -1 for a row whose
    probabilities are no distribution (NaN from the model, or all 0): the caller fails it
    (`checked`, `sampler.choose`); nothing here reads the device or asserts on it."""
    shared = [i for i, g in enumerate(generators) if g is None]
    own = [i for i, g in enumerate(generators) if g is not None]
    picked: list[torch.Tensor] = [_race(take_rows(probs, shared))] if shared else []
    picked += [_race(probs[i : i + 1].to(generators[i].device), generators[i]).to(probs.device) for i in own]
    drawn = torch.cat(picked)
    if shared and own:  # back in row order: row i's draw is at its place in shared + own
        at = [0] * len(generators)
        for k, i in enumerate(shared + own):
            at[i] = k
        drawn = drawn[device_tensor(at, torch.long, probs.device)]
    # a real draw never lands on a token of probability 0 (nor NaN): argmax did, where no token had more
    return torch.where(probs.gather(1, drawn[:, None])[:, 0] > 0, drawn, -1)


def _race(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token per row of probabilities [rows, vocab]: `torch.multinomial(probs, 1)`'s own
    draw for one sample (argmax of p / q, q ~ Exp(1) from `generator`), the same numbers from
    the same generator, so the same tokens, without its checks of the input. Those read the
    device back (some torch releases) or assert on it, and a device-side assert breaks a CUDA
    process for good: a row of NaN logits would take down every request."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Probabilities [rows, vocab] after temperature, top-k, then top-p (each per row); a row's
    are the same bits in every run, however many rows come with it (`_mass_before_fixed`,
    `softmax_rows`)."""
    device = logits.device
    temperature = device_tensor([p.temperature for p in params], logits.dtype, device)
    logits = logits / temperature[:, None]
    vocab = logits.shape[-1]
    if any(0 < p.top_k < vocab for p in params):
        ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        k = device_tensor(ks, torch.long, device)
        kth = torch.topk(logits, max(ks), dim=-1).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, -math.inf)
    if any(p.top_p < 1.0 for p in params):
        top_p = device_tensor([p.top_p for p in params], torch.float32, device)
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = softmax_rows(sorted_logits.float())
        # A token is dropped when the mass before it already reaches top_p; the most likely one
        # never is (a top_p that rounds to 0 keeps it alone).
        drop_sorted = _mass_before_fixed(sorted_probs) >= (top_p.double() * FIXED_ONE).round().long()[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        logits = logits.masked_fill(drop, -math.inf)
    return softmax_rows(logits.float())


def softmax_rows(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """Softmax (`log`: log-softmax) over the last dimension, each row's bits independent of its
    place among the rows.

    NOTE: PyTorch's CUDA softmax over long rows starts its vector loads at each row's first
    16-byte boundary (SoftMax.cu: a `shift` taken from the row's address), so with rows whose
    byte length is not a multiple of 16 (a vocabulary of 50,257 float32s) which thread sums
    which element follows the row's index. Padded with -inf (weight 0) to whole 16 bytes,
    every row starts aligned. Read in the source, not measured; the CPU's softmax is per row."""
    fn = torch.log_softmax if log else torch.softmax
    pad = -x.shape[-1] % max(1, 16 // x.element_size())
    if pad == 0 or x.device.type == "cpu":
        return fn(x, dim=-1)
    return fn(F.pad(x, (0, pad), value=-math.inf), dim=-1)[..., : x.shape[-1]]


FIXED_ONE = 2.0**50  # top-p sums probabilities as integer multiples of 2**-50


def _mass_before_fixed(sorted_probs: torch.Tensor) -> torch.Tensor:
    """Each token's running mass before it (probabilities in descending order per row), in
    fixed point: int64 multiples of 1 / FIXED_ONE.

    NOTE: integer sums are exact in any order. A float scan is not: PyTorch's CUDA cumsum
    scans one row with cub's device-wide scan, whose combining order follows the run's timing
    (PyTorch marks it nondeterministic), and several rows with a kernel whose thread layout
    follows the row count (ATen's ScanUtils.cuh), so a token at the top-p boundary could be
    kept in one step and cut in another. A float32 probability times 2**50 is exact in
    float64; rounding drops under 2**-51 of mass per token."""
    fixed = (sorted_probs.double() * FIXED_ONE).round().long()
    return fixed.cumsum(dim=-1) - fixed


def logprob_infos(logprobs: torch.Tensor, token_ids: list[int], ks: list[int]) -> list[tuple[float, list[tuple[int, float]]]]:
    """Per row of log-probabilities [rows, vocab]: the logprob of its chosen token and its
    `ks[i]` most likely (token id, logprob) pairs, most likely first (ties: lower id first); one device-to-host copy
    for all rows."""
    rows = logprobs.shape[0]
    ids = device_tensor(token_ids, torch.long, logprobs.device)[:, None]
    chosen = logprobs.gather(1, ids).double()
    k = max(ks, default=0)
    # NOTE: a stable sort, not topk: equal logprobs come in token id order whatever the row
    # count (topk breaks ties differently for different batch shapes)
    values, top = torch.sort(logprobs, dim=-1, descending=True, stable=True) if k else (logprobs, ids)
    values, top = values[:, :k], top[:, :k]
    host = torch.cat([chosen, values.double(), top.double()], dim=1).tolist()
    return [(row[0], [(int(t), v) for t, v in zip(row[1 + k : 1 + k + ks[i]], row[1 : 1 + ks[i]])]) for i, row in enumerate(host[:rows])]
