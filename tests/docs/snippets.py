"""Runnable documentation: every shell and Python snippet of README.md and docs/**/*.md is run
against a real `kvserve serve` process, or carries the reason why it cannot be.

The convention, for whoever writes the docs:

* A snippet is a fenced block (``` or ~~~, indented or not) whose info string starts with
  bash, sh, shell, console, python or py. Other blocks (yaml, json, text, ...) are prose.
* Markers are HTML comments, one per line, stacked directly above the opening fence (no blank
  line between), except `expect`, which goes on the line(s) directly after the closing fence:
    <!-- not-run: REASON -->   not run; the reason is required
    <!-- server: FLAGS -->     run against `kvserve serve FLAGS` ({tmp} = that server's temp
                               dir); without it, the default server. One server per distinct
                               FLAGS per test session.
    <!-- server-setup: SHELL --> a bash command run once before that server starts, in a
                               snippet directory ({tmp} as in `server`): what its flags need
                               first (a model written by `python -m bench.vision --save`)
    <!-- setup: SHELL -->      a bash command run first, in the snippet's directory
    <!-- expect: REGEX -->     stdout must match (re.search, DOTALL); may repeat
* A run: bash/sh/shell with `bash -euo pipefail -c`; console: only the `$ ` lines are commands
  (a trailing backslash continues onto the next line), the other lines are illustrative output
  and are not checked (use `expect`); python/py with this interpreter. `127.0.0.1:8000` and
  `localhost:8000` become the server's address; OPENAI_BASE_URL, OPENAI_API_KEY (the server's
  first key, else "unused") and KVSERVE_URL point at it; PATH starts with the venv's bin.
* The snippet's directory is a fresh temp dir holding a copy of the repo's working tree (what
  git tracks or would track) and a link to its .venv, so `scripts/...`, `.venv/bin/...` and
  `python -m bench.x` work and nothing (a `--readme README.md`, say) writes into the repo.
* Checks: exit status 0 within the timeout; every `expect`; every JSON document on stdout (a
  line starting with `{`, or an SSE `data: {...}` line) parses and is not an OpenAI error
  object, unless an `expect` mentions "error". Python prints reprs, so there a line starting
  with `{` that is not JSON is let be.
* A snippet whose every command is `kvserve serve ...` (or `.venv/bin/kvserve serve`, maybe
  after `VAR=value` assignments and `scripts/install.sh && `, which is dropped: the suite runs
  after `scripts/install.sh test`) is a server start: each command runs with `--host 127.0.0.1
  --port <free>`, must turn /ready 200 and answer GET /v1/models 200, then exit 0 on SIGTERM.
  A hub id for `--model`/`--draft-model` needs a download: such snippets must be `not-run`.
  `serve --help`/`--check` are ordinary commands; a block mixing a server start with other
  commands (`kvserve serve &` then curl) must be split or marked `not-run`.
* Never run, so they must be `not-run`: (re)installs (`install.sh`, `pip install`) and pytest.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

LANGUAGES = {"bash": "shell", "sh": "shell", "shell": "shell", "console": "console", "python": "python", "py": "python"}
MARKERS = ("not-run", "server", "server-setup", "setup", "expect")

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")
_COMMENT = re.compile(r"^\s*<!--(?P<body>.*?)-->\s*$")
_MARKER = re.compile(r"^\s*(?P<name>[A-Za-z][\w.-]*)\s*(?::(?P<value>.*))?$", re.DOTALL)
LOCAL_SERVER = re.compile(r"\b(?:127\.0\.0\.1|localhost):8000\b")
_INSTALL_PREFIX = re.compile(r"^\s*(?:\./)?scripts/install\.sh(?:\s+test)?\s*&&\s*")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Commands the suite must never run: they reinstall the venv or run the suite inside itself.
_FORBIDDEN = [
    (re.compile(r"install\.sh|\bpip3? install\b|-m pip install"), "it (re)installs packages; the suite runs after `scripts/install.sh test`"),
    (re.compile(r"-m pytest\b|(^|\s)pytest\s"), "it runs the test suite"),
]


class SnippetFailed(AssertionError):
    """A snippet broke the convention or its run failed; the message names it by file:line."""


@dataclass(frozen=True, slots=True)
class Marker:
    name: str
    value: str | None  # None: no colon at all
    line: int


@dataclass(frozen=True, slots=True)
class ServeCommand:
    """One `kvserve serve ...` line: its VAR=value assignments and its argv."""

    assignments: tuple[str, ...]
    argv: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Block:
    """A fenced block of one markdown file and the markers around it."""

    file: str  # relative to the repo root
    line: int  # the opening fence, 1-based
    info: str
    code: str
    markers: tuple[Marker, ...] = ()

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def kind(self) -> str | None:
        """shell, console or python; None for a block that is not a snippet."""
        words = self.info.strip().lstrip("{.").split()
        return LANGUAGES.get(words[0].rstrip("}").lower()) if words else None

    def values(self, name: str) -> list[str]:
        return [(m.value or "").strip() for m in self.markers if m.name == name]

    @property
    def not_run(self) -> str | None:
        reasons = self.values("not-run")
        return reasons[0] if reasons else None

    @property
    def server_flags(self) -> str:
        flags = self.values("server")
        return flags[0] if flags else ""

    @property
    def commands(self) -> str:
        """The code a shell runs: a console block's `$ ` lines, continuations joined."""
        if self.kind != "console":
            return self.code
        out: list[str] = []
        continuing = False
        for line in self.code.splitlines():
            if line.startswith("$ ") or line == "$":
                out.append(line[2:])
            elif continuing:
                out.append(line)
            else:
                continue
            continuing = line.endswith("\\")
        return "\n".join(out) + "\n"

    @property
    def serve_commands(self) -> list[ServeCommand] | None:
        """The server starts of a snippet made only of them; None otherwise."""
        if self.kind == "python":
            return None
        lines = [line for line in _logical_lines(self.commands) if line.strip() and not line.lstrip().startswith("#")]
        serves = [_serve_command(line) for line in lines]
        return serves if lines and all(serves) else None  # type: ignore[return-value]

    def problems(self) -> list[str]:
        """What breaks the convention in this block's markers, one line each."""
        out = []
        names = [m.name for m in self.markers]
        for m in self.markers:
            if m.name not in MARKERS:
                out.append(f"{self.file}:{m.line}: unknown marker {m.name!r} (known: {', '.join(MARKERS)})")
            elif m.name != "server" and not (m.value or "").strip():
                out.append(f"{self.file}:{m.line}: empty {m.name!r} marker" + (" (give the reason)" if m.name == "not-run" else ""))
        if self.kind is None:
            if any(name in MARKERS for name in names):
                out.append(f"{self.id}: markers on a {self.info.split()[0] if self.info.split() else 'plain'!r} block, which is never run")
            return out
        for name in ("not-run", "server"):
            if names.count(name) > 1:
                out.append(f"{self.id}: more than one {name!r} marker")
        if self.not_run is not None and set(names) & {"server", "server-setup", "setup", "expect"}:
            out.append(f"{self.id}: not-run together with server/setup/expect markers")
        if "server-setup" in names and not self.server_flags:
            out.append(f"{self.id}: a 'server-setup' marker without the 'server' whose start it prepares")
        for pattern in self.values("expect"):
            try:
                re.compile(pattern)
            except re.error as err:
                out.append(f"{self.id}: expect {pattern!r} is not a regex ({err})")
        if self.not_run is None:
            out += [f"{self.id}: {problem}" for problem in self._run_problems()]
        return out

    def _run_problems(self) -> list[str]:
        """Why running this (unmarked) snippet cannot work or must not be tried."""
        code = self.commands
        serves = self.serve_commands
        if serves:
            code = "\n".join(shlex.join(s.argv) for s in serves)
            if "server" in [m.name for m in self.markers]:
                return ["a server start takes no 'server' marker (its own flags say it)"]
            for serve in serves:
                hub = _hub_model(serve)
                if hub:
                    return [f"`{hub}` downloads a model from the hub: mark it <!-- not-run: downloads a model from the hub -->"]
        elif self.kind != "python" and any(_serve_start(line) for line in _logical_lines(code)):
            return ["mixes `kvserve serve` with other commands: split it, or mark it not-run"]
        for pattern, why in _FORBIDDEN:
            if pattern.search(code):
                return [f"must not run here: {why}; mark it not-run"]
        return []


@dataclass(slots=True)
class Page:
    """One markdown file: its fenced blocks and any marker that is attached to none."""

    blocks: list[Block] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)


def parse(text: str, file: str) -> Page:
    """The fenced blocks of `text` with their markers. A known marker that is not directly above
    a fence (or, for `expect`, directly after a closing one) is reported in `stray`."""
    page = Page()
    lines = text.splitlines()
    pending: list[Marker] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        comment = _COMMENT.match(line)
        opening = _FENCE.match(line)
        if comment:
            pending.append(_marker(comment["body"], i + 1))
            i += 1
            continue
        if not opening:
            _report_stray(page, file, pending)
            pending = []
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        closing = re.compile(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        body, j = [], i + 1
        while j < len(lines) and not closing.match(lines[j]):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j].lstrip())
            j += 1
        after, k = [], j + 1
        while k < len(lines) and (c := _COMMENT.match(lines[k])) and _marker(c["body"], k + 1).name == "expect":
            after.append(_marker(c["body"], k + 1))
            k += 1
        above = [m for m in pending if m.name in MARKERS or m.value is not None]
        _report_stray(page, file, [m for m in above if m.name == "expect"], "above a fence (it goes directly after the closing fence)")
        markers = tuple(m for m in above if m.name != "expect") + tuple(after)
        page.blocks.append(Block(file, i + 1, opening["info"], "\n".join(body) + "\n", markers))
        pending = []
        i = k
    _report_stray(page, file, pending)
    return page


def collect(root: Path) -> list[Page]:
    """README.md and every docs/**/*.md under `root` (docs/ may not exist yet)."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md"))]
    return [parse(f.read_text(), f.relative_to(root).as_posix()) for f in files if f.is_file()]


def snippets(pages: list[Page]) -> list[Block]:
    return [block for page in pages for block in page.blocks if block.kind]


def problems(pages: list[Page]) -> list[str]:
    """Every break of the convention: bad or stray markers, snippets that cannot be run."""
    return [p for page in pages for p in page.stray] + [p for page in pages for b in page.blocks for p in b.problems()]


def _marker(body: str, line: int) -> Marker:
    match = _MARKER.match(body)
    if not match:
        return Marker(body.strip(), None, line)
    return Marker(match["name"], match["value"], line)


def _report_stray(page: Page, file: str, markers: list[Marker], why: str = "not directly above a fence") -> None:
    page.stray += [f"{file}:{m.line}: {m.name!r} marker {why}" for m in markers if m.name in MARKERS]


def _logical_lines(code: str) -> list[str]:
    return re.sub(r"\\\n", " ", code).splitlines()


def _serve_command(line: str) -> ServeCommand | None:
    """The line as a plain `kvserve serve ...` command (no pipes, `&`, `;`, redirections), or
    None."""
    serve = _serve_start(line)
    if serve is None or any(set(t) <= set("&|;<>()") for t in serve.argv):
        return None
    return serve


def _serve_start(line: str) -> ServeCommand | None:
    """The line when it starts `kvserve serve` (after VAR=value assignments and a dropped
    `scripts/install.sh && `), operators and all; `--help`, `-h` and `--check` start nothing."""
    rest = _INSTALL_PREFIX.sub("", line)
    try:
        lexer = shlex.shlex(rest, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        tokens = list(lexer)
    except ValueError:
        return None
    assignments = []
    while tokens and re.match(r"^[A-Za-z_]\w*=", tokens[0]):
        assignments.append(tokens.pop(0))
    if len(tokens) < 2 or not (tokens[0] == "kvserve" or tokens[0].endswith("/kvserve")) or tokens[1] != "serve":
        return None
    if {"--help", "-h", "--check"} & set(tokens):
        return None
    return ServeCommand(tuple(assignments), tuple(tokens))


def _flag_values(argv: list[str] | tuple[str, ...], flag: str) -> list[str]:
    values = []
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            values.append(argv[i + 1])
        elif token.startswith(flag + "="):
            values.append(token.split("=", 1)[1])
    return values


def _hub_model(serve: ServeCommand) -> str | None:
    env = dict(a.split("=", 1) for a in serve.assignments)
    for value in [*_flag_values(serve.argv, "--model"), *_flag_values(serve.argv, "--draft-model"), env.get("KVSERVE_MODEL", "")]:
        if _HUB_ID.match(value) and not value.startswith(("./", "../")):
            return value
    return None


def api_key(argv: list[str] | tuple[str, ...], assignments: tuple[str, ...]) -> str | None:
    keys = _flag_values(argv, "--api-key") + [a.split("=", 1)[1] for a in assignments if a.startswith("KVSERVE_API_KEY=")]
    keys = [k for value in keys for k in value.split(",") if k.strip()]
    return keys[0].strip() if keys else None


def without_address(argv: list[str]) -> list[str]:
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token in ("--port", "--host"):
            skip = True
        elif not token.startswith(("--port=", "--host=")):
            out.append(token)
    return out


def line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1
