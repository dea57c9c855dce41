"""Request fields -> GrammarSpec -> CompiledGrammar: the engine-level half of structured output.

`spec_from_request` turns OpenAI `response_format` and vLLM's extensions into one small,
hashable `GrammarSpec` (or None). `GrammarCompiler` owns the llguidance tokenizer (built once),
compiles and validates a spec under parser limits and a wall-clock limit, and keeps compiled
grammars in a bounded LRU. Every failure a client can cause is a `GrammarError`: a `ValueError`
with the request field to blame (`param`) and a one-line reason naming the keyword.

Strict by default: a JSON-schema keyword or `format` that llguidance cannot enforce is rejected
(400), never ignored, so a completed response always validates. `lenient=True` is an operator
opt-in that ignores such keywords (llguidance's `lenient`, which also treats `oneOf` as `anyOf`):
more schemas compile (87 % -> 99 % on JSONSchemaBench) but an output may then violate the
ignored keywords.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import llguidance
import llguidance.hf
from llguidance import LLMatcher
from llguidance.gbnf_to_lark import any_to_lark, is_lark_syntax

from grammars.matcher import Matcher

GrammarKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]

_ANY_OBJECT = '{"type":"object"}'
_MAX_MESSAGE = 300
# What a compiled grammar counts against the cache's byte bound: llguidance reports no sizes.
# NOTE: on SmolLM2's vocabulary a compiled grammar holds 0.1-0.25 MB of RSS plus 30-150 bytes
# per byte of its text (its lexer grows as masks are computed): counted as its upper end.
GRAMMAR_BASE_BYTES = 128 * 1024
GRAMMAR_BYTES_PER_BYTE = 128


class GrammarError(ValueError):
    """A grammar the server will not run; `param` names the request field to blame."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """What to compile. Hashable; equal specs share one compiled grammar.

    payload: json_schema -> the schema as compact JSON text (key order kept: llguidance emits
    properties in schema order, so two orderings are two grammars); json_object -> None;
    regex -> the pattern; choice -> the alternatives; lark/gbnf -> the grammar text.
    whitespace_flexible: None = the compiler's default (compact JSON).
    """

    kind: GrammarKind
    payload: str | tuple[str, ...] | None = None
    whitespace_flexible: bool | None = None
    param: str = field(default="response_format", compare=False)

    @property
    def schema(self) -> dict[str, Any] | None:
        """The JSON schema outputs must validate against (json kinds only)."""
        if self.kind == "json_schema":
            return json.loads(self.payload)  # type: ignore[arg-type]
        if self.kind == "json_object":
            return json.loads(_ANY_OBJECT)
        return None


# ---------------------------------------------------------------- request fields -> spec


def _as_dict(value: Any, name: str) -> dict[str, Any]:
    """A request object as a dict (pydantic models too); `name` may be dotted, the param is not."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(by_alias=True, exclude_none=True)
    if not isinstance(value, Mapping):
        raise GrammarError(f"{name} must be an object", name.split(".")[0])
    return dict(value)


def _schema_spec(schema: Any, param: str, ws: bool | None = None) -> GrammarSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise GrammarError(f"{param} is not valid JSON", param) from None
    if not isinstance(schema, Mapping):
        raise GrammarError(f"{param}: the schema must be a JSON object", param)
    try:
        text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    except RecursionError:
        raise GrammarError(f"{param}: the schema is nested too deeply", param) from None
    except (TypeError, ValueError) as e:  # non-JSON values, circular containers
        raise GrammarError(f"{param}: the schema is not JSON: {e}", param) from None
    return GrammarSpec("json_schema", text, ws, param)


def _regex_spec(pattern: Any, param: str, ws: bool | None = None) -> GrammarSpec:
    if not isinstance(pattern, str):
        raise GrammarError(f"{param} must be a string", param)
    return GrammarSpec("regex", pattern, ws, param)


def _choice_spec(choices: Any, param: str, ws: bool | None = None) -> GrammarSpec:
    if (
        isinstance(choices, (str, bytes))
        or not isinstance(choices, Sequence)
        or not choices
        or not all(isinstance(c, str) for c in choices)
    ):
        raise GrammarError(f"{param} must be a non-empty list of strings", param)
    return GrammarSpec("choice", tuple(choices), ws, param)


def _grammar_spec(text: Any, param: str, ws: bool | None = None) -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise GrammarError(f"{param} must be a non-empty Lark or GBNF grammar", param)
    return GrammarSpec("lark" if is_lark_syntax(text) else "gbnf", text, ws, param)


def _response_format_spec(rf: Any) -> GrammarSpec | None:
    rf = _as_dict(rf, "response_format")
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec("json_object")
    if kind != "json_schema":
        raise GrammarError(
            "response_format.type must be 'text', 'json_object' or 'json_schema'", "response_format"
        )
    js = _as_dict(rf.get("json_schema"), "response_format.json_schema")
    if js.get("schema") is None:  # NOTE: optional in OpenAI's API; without it: any JSON object
        return GrammarSpec("json_object")
    return _schema_spec(js["schema"], "response_format")


# vLLM's StructuredOutputsParams: one constraint key; options we honour, ignore or refuse.
_SO_BUILDERS = {"json": _schema_spec, "regex": _regex_spec, "choice": _choice_spec,
                "grammar": _grammar_spec}
_SO_IGNORED = {"disable_fallback", "_backend", "_backend_was_auto"}
_SO_REFUSED = {"structural_tag", "whitespace_pattern", "disable_additional_properties"}


def _structured_outputs_spec(so: Any) -> GrammarSpec | None:
    p = "structured_outputs"
    so = {k: v for k, v in _as_dict(so, p).items() if v is not None and v is not False}
    ws = None
    if "disable_any_whitespace" in so:
        ws = not so.pop("disable_any_whitespace")
    for key in so.keys() - _SO_BUILDERS.keys() - _SO_IGNORED - {"json_object"}:
        reason = "is not supported" if key in _SO_REFUSED else "is unknown"
        raise GrammarError(f"structured_outputs.{key} {reason}", p)
    given = [k for k in (*_SO_BUILDERS, "json_object") if k in so]
    if len(given) != 1:
        raise GrammarError(
            "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
            + (f" (got {', '.join(given)})" if given else ""), p)
    if given[0] == "json_object":
        return GrammarSpec("json_object", None, ws, p)
    return _SO_BUILDERS[given[0]](so[given[0]], p, ws)


def spec_from_request(
    response_format: Mapping[str, Any] | None,
    structured_outputs: Mapping[str, Any] | None,
    guided_json: Any = None,
    guided_regex: str | None = None,
    guided_choice: Sequence[str] | None = None,
    guided_grammar: str | None = None,
) -> GrammarSpec | None:
    """The request's output constraint, or None for free text.

    At most one source may constrain: `response_format` (json_object / json_schema),
    `structured_outputs`, or one `guided_*` field; `response_format: {"type": "text"}` alongside
    an extension is fine. Raises GrammarError naming the offending field.
    """
    found: list[tuple[str, GrammarSpec]] = []

    def add(param: str, spec: GrammarSpec | None) -> None:
        if spec is None:
            return
        if found:
            raise GrammarError(
                f"{param} conflicts with {found[0][0]}: give only one output constraint", param)
        found.append((param, spec))

    if response_format is not None:
        add("response_format", _response_format_spec(response_format))
    if structured_outputs is not None:
        add("structured_outputs", _structured_outputs_spec(structured_outputs))
    if guided_json is not None:
        add("guided_json", _schema_spec(guided_json, "guided_json"))
    if guided_regex is not None:
        add("guided_regex", _regex_spec(guided_regex, "guided_regex"))
    if guided_choice is not None:
        add("guided_choice", _choice_spec(guided_choice, "guided_choice"))
    if guided_grammar is not None:
        add("guided_grammar", _grammar_spec(guided_grammar, "guided_grammar"))
    return found[0][1] if found else None


# ---------------------------------------------------------------- compile + LRU


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """A validated grammar, shared by every request with an equal spec (never mutated)."""

    spec: GrammarSpec
    compile_s: float
    template: LLMatcher
    vocab_size: int
    ll_vocab_size: int
    eos_token_ids: tuple[int, ...]
    fast_forward: bool

    def new_matcher(self) -> Matcher:
        """A fresh per-request matcher at the grammar's start (a cheap copy of the template)."""
        return Matcher(self.template.deep_copy(), self.vocab_size, self.eos_token_ids,
                       ll_vocab_size=self.ll_vocab_size, fast_forward=self.fast_forward)


class GrammarCompiler:
    """Engine-level grammar state: the llguidance tokenizer and an LRU of compiled grammars.

    `compile` is thread-safe and blocking: call it off the event loop. Concurrent compiles of an
    equal spec run once. Deterministic rejections are cached like grammars, timeouts are not.
    The cache holds at most `cache_size` entries and `cache_bytes` of their estimated size
    (`estimated_bytes`); past either bound the least recently used entries (compiled or looked
    up longest ago) are evicted first, and an entry larger than `cache_bytes` alone is returned
    but not kept. Counters for metrics: `hits`, `misses`, `rejected`, `timeouts`, `evictions`,
    `compile_seconds_total`, and `nbytes`; `on_compile(seconds)` is called after every real
    compilation.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        *,
        eos_token_ids: Sequence[int] | None = None,
        cache_size: int = 256,
        cache_bytes: int = 256 << 20,
        compile_timeout_s: float = 5.0,
        flexible_whitespace: bool = False,
        lenient: bool = False,
        max_concurrent_compiles: int = 2,
        max_payload_bytes: int = 1 << 20,
        limits: Mapping[str, int | bool] | None = None,
        on_compile: Callable[[float], None] | None = None,
    ) -> None:
        if cache_size < 1 or cache_bytes < 1 or compile_timeout_s <= 0 or max_concurrent_compiles < 1:
            raise ValueError("cache_size, cache_bytes, compile_timeout_s, max_concurrent_compiles must be > 0")
        eos = list(eos_token_ids) if eos_token_ids else [tokenizer.eos_token_id]
        n_vocab = max(vocab_size, len(tokenizer))
        self.ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=eos)
        self._bytes_in_vocab = _bytes_in_vocab(self.ll_tokenizer)
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(eos)
        self.cache_size = cache_size
        self.cache_bytes = cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.flexible_whitespace = flexible_whitespace
        self.lenient = lenient
        self.max_payload_bytes = max_payload_bytes
        # NOTE: verbose_errors=False keeps parser state and grammar text out of error messages.
        self.limits = llguidance.LLParserLimits(**{**(limits or {}), "verbose_errors": False})
        self.on_compile = on_compile
        self.hits = self.misses = self.rejected = self.timeouts = self.evictions = 0
        self.compile_seconds_total = 0.0
        self.nbytes = 0  # estimated bytes of the cached entries
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple, CompiledGrammar | str] = OrderedDict()
        self._sizes: dict[tuple, int] = {}
        self._inflight: dict[tuple, Future] = {}
        # NOTE: a compile that outlives its timeout cannot be interrupted (it runs in Rust); it
        # keeps its slot until it ends, so runaway compiles never use more than these threads.
        self._slots = threading.BoundedSemaphore(max_concurrent_compiles)
        self._pool = ThreadPoolExecutor(max_concurrent_compiles, "kvserve-grammar-compile")

    def __len__(self) -> int:
        return len(self._cache)

    def compile(self, spec: GrammarSpec) -> CompiledGrammar:
        """The compiled grammar for `spec`, from the LRU or compiled now (<= compile_timeout_s).

        Raises GrammarError (param = spec.param) for anything invalid, unsupported or too slow.
        """
        ws = spec.whitespace_flexible
        if ws is None:
            ws = self.flexible_whitespace
        key = (spec.kind, spec.payload, ws)
        with self._lock:
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                pending = self._inflight.get(key)
                owner = pending is None
                if owner:
                    pending = self._inflight[key] = Future()
                    self.misses += 1
        try:
            if entry is None and owner:
                entry = self._compile_and_store(key, spec, ws, pending)
            elif entry is None:
                entry = pending.result(timeout=self.compile_timeout_s)
        except TimeoutError:
            entry = self._timeout_message()
        if isinstance(entry, str):
            with self._lock:
                self.rejected += 1
            raise GrammarError(entry, spec.param)
        if entry.spec.param != spec.param:  # same grammar, reached through another field
            entry = replace(entry, spec=spec)
        return entry

    def _compile_and_store(self, key: tuple, spec: GrammarSpec, ws: bool, pending: Future):
        t0 = time.perf_counter()
        cacheable = True
        try:
            entry: CompiledGrammar | str = self._build(spec, ws, t0)
        except GrammarError as e:
            entry = str(e)
        except TimeoutError:
            entry, cacheable = self._timeout_message(), False
        except BaseException as e:  # a bug, not the client's fault: nothing cached, waiters told
            with self._lock:
                del self._inflight[key]
            pending.set_exception(e)
            raise
        dt = time.perf_counter() - t0
        with self._lock:
            self.compile_seconds_total += dt
            if not cacheable:
                self.timeouts += 1
            else:
                self._store(key, entry)
            del self._inflight[key]
        pending.set_result(entry)
        if self.on_compile is not None:
            self.on_compile(dt)
        return entry

    def _store(self, key: tuple, entry: CompiledGrammar | str) -> None:
        """Cache `entry`, then evict the least recently used entries past either bound (under
        the lock). An entry larger than the byte bound alone is not kept."""
        size = estimated_bytes(key, entry)
        if size > self.cache_bytes:
            return
        self._cache[key] = entry
        self._sizes[key] = size
        self.nbytes += size
        while len(self._cache) > self.cache_size or self.nbytes > self.cache_bytes:
            old, _ = self._cache.popitem(last=False)
            self.nbytes -= self._sizes.pop(old)
            self.evictions += 1

    def _timeout_message(self) -> str:
        return f"grammar compilation exceeded the {self.compile_timeout_s:g} s time limit"

    def _build(self, spec: GrammarSpec, ws: bool, t0: float) -> CompiledGrammar:
        parts = spec.payload if isinstance(spec.payload, tuple) else (spec.payload or "",)
        size = sum(len(p.encode()) for p in parts)
        if size > self.max_payload_bytes:
            raise GrammarError(f"{spec.kind} too large: {size} > {self.max_payload_bytes} bytes")
        if spec.kind == "choice":
            self._check_producible(spec)
        grammar = self._to_llguidance(spec, ws)
        deadline = t0 + self.compile_timeout_s
        if not self._slots.acquire(timeout=max(0.0, deadline - time.perf_counter())):
            raise TimeoutError
        try:
            fut = self._pool.submit(self._construct, grammar)
        except BaseException:
            self._slots.release()
            raise
        matcher = fut.result(timeout=max(0.0, deadline - time.perf_counter()))
        if matcher.is_error():
            raise GrammarError(_explain(matcher.get_error(), spec))
        compiled = CompiledGrammar(spec, time.perf_counter() - t0, matcher, self.vocab_size,
                                   self.ll_tokenizer.vocab_size, self.eos_token_ids,
                                   self.ll_tokenizer.is_canonical)
        _check_not_empty(compiled)
        return compiled

    def _check_producible(self, spec: GrammarSpec) -> None:
        """Refuse a choice with a byte no token of the vocabulary holds (SmolLM2 has none for
        the control characters 0x04, 0x06, 0x14, ...): the model could never write it.

        NOTE: llguidance's mask does not stop there: past a byte it cannot force it allows the
        bytes that follow, which the parser then refuses (a 400 `grammar_dead_end` mid-output
        for regex and Lark literals, which are not checked here).
        """
        for i, choice in enumerate(spec.payload):  # type: ignore[union-attr]
            if self._bytes_in_vocab.issuperset(choice.encode("utf-8", "surrogatepass")):
                continue
            missing = next(ch for ch in choice if not self._bytes_in_vocab.issuperset(ch.encode("utf-8", "surrogatepass")))
            raise GrammarError(
                f"{spec.param}[{i}] contains {missing!r}, which no token of the model's vocabulary can produce",
                spec.param,
            )

    def _construct(self, grammar: str) -> LLMatcher:
        try:  # NOTE: runs in the pool; LLMatcher() drops the GIL and never raises on bad grammars
            return LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=self.limits)
        finally:
            self._slots.release()

    def _to_llguidance(self, spec: GrammarSpec, ws: bool) -> str:
        """The llguidance grammar text for a spec (cheap: nothing is validated here)."""
        if spec.kind in ("json_schema", "json_object"):
            opts = {"whitespace_flexible": ws, "lenient": self.lenient,
                    "coerce_one_of": self.lenient}
            # NOTE: overrides beat the schema's own "x-guidance", so clients cannot opt into
            # lenient mode or whitespace runs the operator did not allow.
            try:
                schema = spec.payload or _ANY_OBJECT
                return LLMatcher.grammar_from_json_schema(schema, overrides=opts)
            except ValueError as e:
                raise GrammarError(f"JSON schema rejected: {_one_line(str(e))}") from None
        if spec.kind == "regex":
            return LLMatcher.grammar_from_regex(spec.payload)
        if spec.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in spec.payload)  # type: ignore[union-attr]
            return LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if spec.kind == "gbnf":
            try:
                return LLMatcher.grammar_from_lark(any_to_lark(spec.payload))
            except Exception as e:  # GbnfToLarkError and friends from the converter
                raise GrammarError(f"GBNF grammar rejected: {_one_line(str(e))}") from None
        if spec.kind == "lark":
            return LLMatcher.grammar_from_lark(spec.payload)
        raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def estimated_bytes(key: tuple, entry: CompiledGrammar | str) -> int:
    """What a cache entry counts against the byte bound: a compiled grammar, GRAMMAR_BASE_BYTES
    plus GRAMMAR_BYTES_PER_BYTE per byte of its spec's text; a cached rejection, its spec's
    text and its message."""
    payload = key[1]
    parts = payload if isinstance(payload, tuple) else (payload or "",)
    text = sum(len(p.encode("utf-8", "surrogatepass")) for p in parts)
    if isinstance(entry, str):
        return text + len(entry)
    return GRAMMAR_BASE_BYTES + GRAMMAR_BYTES_PER_BYTE * text


# ---------------------------------------------------------------- error messages


_LABELS = {"json_schema": "JSON schema", "json_object": "JSON schema", "regex": "regex",
           "choice": "choice", "lark": "Lark grammar", "gbnf": "GBNF grammar"}


def _explain(error: str, spec: GrammarSpec) -> str:
    """llguidance's compile error -> `<what> rejected: <one-line reason>`."""
    reason = _one_line(error)
    regex = _regex_reason(error)
    if regex is not None and spec.kind == "json_schema":
        try:
            where = _find_bad_pattern(json.loads(spec.payload))  # type: ignore[arg-type]
        except RecursionError:
            where = None
        reason = f"invalid regex{f' in {where}' if where else ''}: {regex}"
    elif regex is not None and spec.kind == "regex":
        reason = f"invalid regex: {regex}"
    return _clip(f"{_LABELS[spec.kind]} rejected: {reason}")


def _clip(line: str) -> str:
    return line if len(line) <= _MAX_MESSAGE else line[: _MAX_MESSAGE - 3] + "..."


def _one_line(text: str) -> str:
    """Drop source excerpts, carets and state dumps; join the rest on one bounded line."""
    text = text.split("<state>")[0].replace("<non-verbose/>", "").replace("json-schema:///", "")
    text = text.replace(
        "oneOf constraints are not supported. Enable 'coerce_one_of' option to approximate "
        "oneOf with anyOf", "oneOf is only supported where it is provably equivalent to anyOf")
    text = re.sub(r"Resource '(.*?)' is not present in a registry.*",
                  r"$ref to '\1' is not supported (only local references are)", text)
    lines = [ln.strip() for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and not re.fullmatch(r"\^+|\d+ \|.*", ln)]
    return _clip(re.sub(r"\s+", " ", "; ".join(lines)).strip())


def _regex_reason(error: str) -> str | None:
    if "regex parse error" not in error:
        return None
    m = re.search(r"^\s*error: (.+)$", error, re.MULTILINE)
    return m.group(1).strip() if m else "cannot parse"


def _find_bad_pattern(schema: Any, path: str = "") -> str | None:
    """Keyword and JSON pointer of the first `pattern`/`patternProperties` regex that fails."""
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            if (hit := _find_bad_pattern(item, f"{path}/{i}")) is not None:
                return hit
        return None
    if not isinstance(schema, dict):
        return None
    candidates = []
    if isinstance(schema.get("pattern"), str):
        candidates.append(("pattern", schema["pattern"]))
    if isinstance(schema.get("patternProperties"), dict):
        candidates += [("patternProperties", p) for p in schema["patternProperties"]]
    for keyword, pattern in candidates:
        if LLMatcher.validate_grammar(LLMatcher.grammar_from_regex(pattern)):
            return f"'{keyword}' at {path or '/'}"
    for key, value in schema.items():
        if key not in ("const", "enum", "default", "examples") and isinstance(value, (dict, list)):
            if (hit := _find_bad_pattern(value, f"{path}/{key}")) is not None:
                return hit
    return None


def _bytes_in_vocab(ll_tokenizer) -> frozenset[int]:
    """Every byte value that occurs in some non-special token."""
    seen: set[int] = set()
    for i in range(ll_tokenizer.vocab_size):
        if not ll_tokenizer.is_special_token(i):
            seen.update(ll_tokenizer.decode_bytes([i]))
    return frozenset(seen)


def _check_not_empty(compiled: CompiledGrammar) -> None:
    """Refuse a grammar whose first mask llguidance cannot compute: its language is empty (a
    rule that only refers to itself) or beyond llguidance's limits (`a{1000000}`), so no output
    could ever complete it.

    NOTE: a grammar that fails later (a dead end llguidance finds mid-output) ends the request
    with an error (the engine's "grammar" error), never as a valid "stop".
    """
    # NOTE: copies of one grammar share llguidance's lexer and its expression budget; a grammar
    # that only just fits the first mask (`a{1000000}`) fails on the next copy: probe twice.
    for probe in (compiled.new_matcher(), compiled.new_matcher()):
        probe.fill_next_mask()
        # a grammar that forces an endless nesting fails on its second forced run
        forced = probe.fast_forward_tokens()
        if forced and probe.accept_tokens(forced):
            probe.fast_forward_tokens()
        if probe.error is not None:
            break
    if probe.error is not None:
        raise GrammarError(
            f"{compiled.spec.kind}: no output can ever complete this grammar (llguidance: "
            f"{probe.error}); look for a rule or $ref that only refers to itself, or a repetition "
            "too large to enforce",
            compiled.spec.param,
        )
