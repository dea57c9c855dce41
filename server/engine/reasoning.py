"""A sequence's reasoning phase: where a thinking model's thinking starts and ends in its
output, how many tokens it took, and the end marker the budget forces.

The HTTP side finds a model's markers (server/api/reasoning.py) and hands the engine a
`ReasoningSpec`; the engine keeps one `Reasoning` per sequence and feeds it every generated
token (`push`), in order. Markers are matched on token ids, so a marker written as several
tokens is held back until it is complete (or turns out not to be one) and never reaches
either text. Phases only move forward:

    opening --(start marker)--> thinking --(end marker)--> answer
       \\--(any other first token)-----------------------/

* `opening`: the prompt did not open the reasoning; the output may (Qwen3 writes `<think>`
  itself, GLM-4.5 `\n<think>`: blank tokens before the marker wait with it). A grammar cannot wait for that choice, so with a grammar the engine forces the
  start marker (`Reasoning(spec, open=True)`).
* `thinking`: tokens are reasoning. `budget` counts the tokens between the markers; once it is
  spent `forced()` is the rest of the end marker, which the engine appends without sampling.
  `spec.banned_ids` (a tool format's call markers) are masked while thinking, so a call is
  never written inside the thinking, where it would be lost.
* `answer`: tokens are content; a grammar starts here.

`tokens` (usage's `reasoning_tokens`) counts every generated token before the answer, markers
included; `thought` only those between the markers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

OPENING, THINKING, ANSWER = "opening", "thinking", "answer"


@dataclass(frozen=True, slots=True)
class ReasoningSpec:
    """A request's reasoning markers (token ids as the tokenizer writes them) and budget."""

    start_ids: tuple[int, ...]
    end_ids: tuple[int, ...]
    inside: bool = False  # the prompt opened the reasoning: the output starts thinking
    budget: int | None = None  # most tokens between the markers (None: unbounded)
    banned_ids: frozenset[int] = field(default_factory=frozenset)  # masked while thinking
    blank_ids: frozenset[int] = field(default_factory=frozenset)  # whitespace the output may write before opening

    def __post_init__(self) -> None:
        if not self.start_ids or not self.end_ids:
            raise ValueError("reasoning markers must not be empty")
        if self.budget is not None and self.budget < 0:
            raise ValueError("the reasoning budget must be >= 0")


class Reasoning:
    """One sequence's phase (see the module docstring); engine thread only."""

    def __init__(self, spec: ReasoningSpec, *, open: bool = False) -> None:
        self.spec = spec
        self.phase = THINKING if spec.inside else OPENING
        self.forced_open = open and not spec.inside  # the engine writes the start marker
        self.tokens = 0  # generated tokens before the answer, markers included
        self.thought = 0  # tokens between the markers
        self._held: list[int] = []  # a marker's first tokens, until it is complete or not
        self._lead: list[int] = []  # blank tokens before a start marker may come

    @property
    def answering(self) -> bool:
        return self.phase == ANSWER

    @property
    def thinking(self) -> bool:
        return self.phase == THINKING

    def opening(self) -> tuple[int, ...]:
        """The start marker's remaining tokens, which the engine writes before sampling (a
        grammar request whose prompt left the choice to the model); empty otherwise."""
        return self.spec.start_ids[len(self._held):] if self.forced_open and self.phase == OPENING else ()

    def budget_left(self) -> int | None:
        """Tokens the thinking may still take (None: unbounded, or not thinking)."""
        if self.phase != THINKING or self.spec.budget is None:
            return None
        return max(0, self.spec.budget - self.thought - len(self._held))

    def forced(self) -> tuple[int, ...]:
        """The end marker's remaining tokens once the budget is spent; empty otherwise."""
        if self.budget_left() != 0:
            return ()
        return self.spec.end_ids[len(self._held):]

    def push(self, token_id: int) -> list[tuple[int, str]]:
        """Route a generated token: returns (token, "reasoning" | "marker" | "content") for
        the tokens whose place is now known, in generation order: a marker's tokens come back
        once it is complete, as "marker" (no text), held tokens that turned out to be no
        marker as what they are. Moves the phase and the counts."""
        if self.phase == ANSWER:
            return [(token_id, "content")]
        self.tokens += 1
        marker = self.spec.start_ids if self.phase == OPENING else self.spec.end_ids
        if self.phase == OPENING and not self._held and token_id in self.spec.blank_ids:
            self._lead.append(token_id)  # GLM-4.5 writes "\n<think>": undecided yet
            return []
        out: list[tuple[int, str]] = []
        if self._held and token_id != marker[len(self._held)]:  # the held tokens were no marker
            released, self._held = self._held, []
            if self.phase == OPENING:
                return self._no_reasoning(released + [token_id])
            self.thought += len(released)
            out = [(t, "reasoning") for t in released]
        if token_id == marker[len(self._held)]:
            self._held.append(token_id)
            if len(self._held) == len(marker):
                out += [(t, "marker") for t in self._lead + self._held]
                self._held, self._lead = [], []
                self.phase = THINKING if self.phase == OPENING else ANSWER
            return out
        if self.phase == OPENING:
            return self._no_reasoning([token_id])
        self.thought += 1
        return out + [(token_id, "reasoning")]

    def _no_reasoning(self, tokens: list[int]) -> list[tuple[int, str]]:
        """The output did not open a reasoning block: all of it is content."""
        lead, self._lead = self._lead, []
        self.phase = ANSWER
        self.tokens = 0
        return [(t, "content") for t in lead + tokens]

    def flush(self) -> list[tuple[int, str]]:
        """At the end of generation: held tokens of a marker never completed."""
        if self.phase == OPENING:
            released, self._held = self._held, []
            return self._no_reasoning(released)
        released, self._held = self._held, []
        self.thought += len(released)
        return [(t, "reasoning") for t in released]
