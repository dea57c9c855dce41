"""The sampler: the one owner of how a sequence's next token is chosen from its logits.

Every token the engine samples goes through here, one position of one sequence at a time in
the same order: the model's logprobs (before anything below) when asked; the position's
constraint (`constraint`: the grammar's mask once the sequence answers, or the tokens a
thinking model may not write while it thinks); the request's logit bias; its penalties; then
greedy argmax or a seeded draw (server/engine/sampling.py holds those pure functions), or a
thinking model's forced marker taken as it is (`forced_marker`); then `taken` counts the token
for the penalties. `choose` does that for a step's rows at once;
`verify` does it position by position along a speculative draft (server/engine/speculative.py),
accepting drafted tokens by the rules below, so a draft never changes which token a position
gets (greedy) or its distribution (sampling).

Shapes: `logits` is float32 [rows, vocab] (one row per sequence) for `choose`, [k + 1, vocab]
(the pending token's position and each of k drafted ones) for `verify`.
"""

from __future__ import annotations

import numpy as np
import torch

from grammars.matcher import additive_masks
from server.engine.sampling import (
    apply_logit_bias,
    apply_penalties,
    checked,
    device_tensor,
    draw_rows,
    filtered_probs,
    logprob_infos,
    sample_ids,
    sample_rows,
    softmax_rows,
    take_rows,
)
from server.engine.sequence import Sequence, TokenInfo

# -- one step's rows ---------------------------------------------------------------------------


def choose(seqs: list[Sequence], logits: torch.Tensor, chosen: torch.Tensor | None = None) -> list[TokenInfo | None]:
    """The next token of each sequence from its row of raw logits [R, vocab]; None for a row
    that draws from no distribution (NaN or inf in its logits: `sampling.draw_ids`), which
    fails alone while the others keep what they drew.

    `chosen` [R]: every row's token, already chosen on the device (`chosen_on_device`), taken
    as it is with one device-to-host copy for the step and nothing read from the logits.
    Logprobs are the model's own distribution (before constraints, bias and penalties).
    Side effects: constraint masks are added to `logits` in place; penalty counts move forward.
    """
    if chosen is not None:
        return [taken(seq, token_id, None) if token_id >= 0 else None for seq, token_id in zip(seqs, chosen.tolist())]
    asked = [i for i, s in enumerate(seqs) if s.params.logprobs]
    logprobs = softmax_rows(take_rows(logits, asked), log=True) if asked else None
    apply_constraints(seqs, logits)
    logits = apply_logit_bias(logits, [s.params.logit_bias for s in seqs])
    for i, seq in enumerate(seqs):
        row = logits[i]
        if (done := penalized(seq, row)) is not row:
            logits[i] = done
    # a seeded request draws from its own generator; the others draw together, in one call. A
    # forced marker's token is taken as it is, with no draw: the generator moves as it would
    # without logprobs, so the tokens after it are the same
    token_ids = [forced_marker(s) for s in seqs]
    free = [i for i, token_id in enumerate(token_ids) if token_id is None]
    if free:
        drawn = sample_rows(take_rows(logits, free), [seqs[i].params for i in free], [_draws_from(seqs[i]) for i in free])
        for i, token_id in zip(free, drawn):
            token_ids[i] = token_id
    infos = {}
    if asked:  # (a row that drew from no distribution: read at token 0, then dropped)
        infos = dict(zip(asked, logprob_infos(logprobs, [max(token_ids[i], 0) for i in asked], [seqs[i].params.top_logprobs for i in asked])))
    return [taken(seq, token_id, infos.get(i)) if token_id >= 0 else None for i, (seq, token_id) in enumerate(zip(seqs, token_ids))]


def device_chooses(seq: Sequence) -> bool:
    """Whether the sequence's next token can be chosen on the device from its raw logits
    (`chosen_on_device`): no penalties and no logprobs, whose state and answers live on the
    host. A constraint's mask (its grammar's, a thinking model's bans) is the host's too, but
    reaches the device in one copy that does not wait, and its logit bias is added there."""
    params = seq.params
    return not (params.logprobs or params.uses_penalties)


def chosen_on_device(seqs: list[Sequence], logits: torch.Tensor, greedy: torch.Tensor | None) -> torch.Tensor | None:
    """Each row's next token [R] on the device, with no sync (`greedy`: the runner's argmax of
    each row after its logit bias, from a step of decode rows alone; None: every row is chosen
    here); None unless every row's can be chosen there (`device_chooses`). Each row's
    constraint mask is added to `logits` in place (`apply_constraints`, as `choose` adds it);
    greedy rows without one take the runner's argmax, and the others are chosen as `choose`
    would have chosen them (the same rows' logits, the same argmax, the same draw calls in the
    same order: the same tokens), so the engine may launch the next step from them before they
    reach the host (its overlap) and `choose` takes them as they are."""
    if not all(device_chooses(s) for s in seqs):
        return None
    masked = set(apply_constraints(seqs, logits))
    picked = [i for i, s in enumerate(seqs) if greedy is None or not s.params.greedy or i in masked]  # not the runner's argmax
    if not picked:
        return greedy
    every = len(picked) == len(seqs)
    rows = None if every else device_tensor(picked, torch.long, logits.device)  # one copy, for the rows' logits and their tokens
    biased = apply_logit_bias(logits if every else logits[rows], [seqs[i].params.logit_bias for i in picked])
    ids = sample_ids(biased, [seqs[i].params for i in picked], [_draws_from(seqs[i]) for i in picked])
    if every:
        return ids
    return greedy.index_copy(0, rows, ids)


def _draws_from(seq: Sequence) -> torch.Generator | None:
    """The generator a row of a step draws from: a seeded request's own, else None (the rows
    without one draw together from the device's default generator: `draw_ids`). `choose` and
    `chosen_on_device` both ask here, so that they draw the same tokens."""
    return seq.generator if seq.params.seed is not None else None


def _bans(seq: Sequence) -> bool:
    """Whether a thinking model's spec bans tokens while the sequence thinks (now)."""
    reasoning = seq.reasoning
    return reasoning is not None and reasoning.thinking and bool(reasoning.spec.banned_ids)


def constraint(seq: Sequence, vocab: int) -> np.ndarray | None:
    """What the sequence may write next, as mask words [ceil(vocab / 32)] int32 on the host
    (bit i allows token i: grammars/matcher.py `additive_masks`), None when anything goes: its
    grammar's once it answers; while a thinking model thinks, all but the tokens its spec bans
    (a tool format's call markers)."""
    n_words = -(-vocab // 32)
    grammar = seq.grammar
    if grammar is not None:
        if grammar.vocab_size != vocab:
            raise ValueError(f"logits width {vocab} != vocab_size {grammar.vocab_size}")
        return grammar.next_words()[:n_words]
    if _bans(seq):
        if seq.banned_words is None:
            allowed = np.ones(n_words * 32, dtype=bool)
            allowed[[t for t in seq.reasoning.spec.banned_ids if t < vocab]] = False
            seq.banned_words = np.packbits(allowed, bitorder="little").view(np.int32)
        return seq.banned_words
    return None


def forced_marker(seq: Sequence) -> int | None:
    """The next token of a thinking model's forced marker (its start, or its end once the budget
    is spent) when the request asks for logprobs: `choose` takes it at its position, with the
    model's logprob, and draws nothing; without logprobs the engine appends markers with no
    forward pass of their own (`Engine._continue`). Speculation never drafts at a forced
    marker (speculative.py), so `verify` does not meet one."""
    reasoning = seq.reasoning
    if reasoning is None or not seq.params.logprobs:
        return None
    forced = reasoning.opening() or reasoning.forced()
    return forced[0] if forced else None


def apply_constraints(seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """Add each row's constraint mask to its logits [R, vocab] in place (rows without one are
    left alone): the masks' words stacked on the host, one copy to the device that does not
    wait, unpacked there (`additive_masks`), one add. Returns the rows masked."""
    vocab = logits.shape[-1]
    words = [constraint(s, vocab) for s in seqs]
    rows = [i for i, w in enumerate(words) if w is not None]
    if not rows:
        return rows
    masks = additive_masks(np.stack([words[i] for i in rows]), vocab, logits.device).to(logits.dtype)
    if len(rows) == len(seqs):
        logits.add_(masks)
    else:
        logits.index_add_(0, device_tensor(rows, torch.long, logits.device), masks)
    return rows


def processed(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """One position's logits [vocab] after the request's logit bias and penalties (`logits`
    itself when it has neither)."""
    return penalized(seq, apply_logit_bias(logits[None], [seq.params.logit_bias])[0])


def penalized(seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
    """One position's logits [vocab] after the request's penalties (`logits` itself without);
    a request with penalties starts counting its tokens here."""
    params = seq.params
    if params.uses_penalties and seq.counts is None:
        seq.counts = torch.zeros(logits.shape[-1], dtype=torch.int32, device=logits.device)
    if seq.counts is None:
        return logits
    return apply_penalties(logits, seq.counts, params.presence_penalty, params.frequency_penalty)


def taken(seq: Sequence, token_id: int, info: tuple[float, list[tuple[int, float]]] | None) -> TokenInfo:
    """The token chosen at one position, counted for penalties; with its logprob and the top
    ones (`logprob_infos`), when the request asks for logprobs."""
    if seq.counts is not None:
        seq.counts[token_id] += 1
    if info is None:
        return TokenInfo(token_id)
    return TokenInfo(token_id, logprob=info[0], top=info[1])


# -- a drafted row, position by position -------------------------------------------------------


def verify(seq: Sequence, tokens: list[int], probs: torch.Tensor | None, logits: torch.Tensor, ends_forced: bool) -> tuple[list[TokenInfo], int]:
    """The tokens decoding emits for a row that carried the draft `tokens` (with the draft's
    distributions `probs` [k, vocab], or None for a deterministic draft), from its raw logits
    [k + 1, vocab]: the accepted drafted tokens, then the token chosen at the first rejected
    position (or after the whole draft, unless `ends_forced`: what follows it is forced).
    Returns them and how many drafted tokens were accepted.

    Side effects, as `choose` one position at a time would have: constraint masks are added to
    `logits` in place, penalty counts move forward, the request's generator draws. The
    speculator drafts no row whose constraint could change inside the draft (a grammar waiting
    for a thinking model's answer), so one constraint per position holds for the whole draft.
    """
    params, k = seq.params, len(tokens)
    logprobs = softmax_rows(logits, log=True) if params.logprobs else None
    grammar = seq.grammar
    if grammar is not None:
        logits.add_(grammar.draft_masks(logits.device).to(logits.dtype))
    elif (words := constraint(seq, logits.shape[-1])) is not None:
        logits.add_(additive_masks(words[None], logits.shape[-1], logits.device).to(logits.dtype))
    out: list[TokenInfo] = []
    accepted = 0
    for j in range(k + 1):
        if j == k and ends_forced:
            break
        x = processed(seq, logits[j])
        if j == k:
            ok, token = False, checked(sample_rows(x[None], [params], [seq.generator]))[0]
        elif params.greedy:
            ok, token = accept_greedy(x, tokens[j])
        else:
            p = filtered_probs(x[None], [params])[0]
            if probs is None:
                ok, token = accept_point_mass(p, tokens[j], seq.generator)
            else:
                ok, token = accept_or_resample(p, probs[j], tokens[j], seq.generator)
        info = None if logprobs is None else logprob_infos(logprobs[j : j + 1], [token], [params.top_logprobs])[0]
        out.append(taken(seq, token, info))
        if not ok:
            break
        accepted += 1
    return out, accepted


def accept_greedy(logits: torch.Tensor, token: int) -> tuple[bool, int]:
    """Greedy verification at one position of processed logits [vocab]: (accepted, the token
    decoding emits here: the draft's when accepted, else the argmax)."""
    best = int(torch.argmax(logits))
    return best == token, best


def accept_point_mass(probs: torch.Tensor, token: int, generator: torch.Generator) -> tuple[bool, int]:
    """The standard rule for a deterministic draft token (q = a point mass): draw y ~ p with
    the request's generator; accept iff y == token, else y is the emitted (residual) token.
    P(accept) = p(token) and a rejected draw is distributed as norm(p without token)."""
    drawn = draw_rows(probs[None], [generator])[0]
    return drawn == token, drawn


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, token: int, generator: torch.Generator) -> tuple[bool, int]:
    """The standard rule for a token drawn from a draft distribution q [vocab] against the
    target distribution p [vocab]: accept with probability min(1, p(token) / q(token)), else
    emit a draw from norm(max(0, p - q)). The emitted token is distributed as p."""
    p, q = p.to(generator.device), q.to(generator.device)
    u = float(torch.rand((), generator=generator, device=generator.device))
    if q[token] > 0 and u * float(q[token]) < float(p[token]):
        return True, token
    residual = torch.clamp(p - q, min=0)
    if float(residual.sum()) <= 0:  # p == q: nothing to correct (never rejected, in theory)
        residual = p
    return False, draw_rows(residual[None], [generator])[0]
