"""Running the snippets that tests/docs/snippets.py reads off the docs: each in a fresh copy of
the repo, against a real `kvserve serve` process (one per distinct flags, `ServerPool`), with the
checks that module's docstring lists (exit status, `expect`, JSON on stdout).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx

from bench.common import ServerProcess, free_port, launch, started
from tests.docs.snippets import LOCAL_SERVER, Block, ServeCommand, SnippetFailed, api_key, line_of, without_address

TIMEOUT_S = 120


READY_TIMEOUT_S = 180
SERVER_SETUP_TIMEOUT_S = 300


class ServerPool:
    """`kvserve serve` processes by their extra flags, started on first use and kept until
    `close` (one per distinct flag string)."""

    def __init__(self, work_dir: Path, base_flags: tuple[str, ...]) -> None:
        self.work_dir, self.base_flags = work_dir, base_flags
        self._servers: dict[str, ServerProcess] = {}
        self._stack = contextlib.ExitStack()

    def get(self, flags: str, prepare: Callable[[Path], None] | None = None) -> ServerProcess:
        """The server for `flags`; its `api_key` attribute is its first key, or None.
        `prepare(tmp)` runs once before it starts ({tmp}: its temp dir)."""
        if flags not in self._servers:
            tmp = self.work_dir / f"server-{len(self._servers)}"
            (tmp / "tmp").mkdir(parents=True)
            if prepare is not None:
                prepare(tmp / "tmp")
            argv = shlex.split(flags.replace("{tmp}", str(tmp / "tmp")))
            server = self._stack.enter_context(launch(tmp, *self.base_flags, *argv, ready_timeout_s=READY_TIMEOUT_S))
            server.api_key = api_key(argv, ())
            self._servers[flags] = server
        return self._servers[flags]

    def close(self) -> None:
        self._stack.close()


def run(block: Block, pool: ServerPool, tmp: Path, repo: Path, server_env: dict[str, str], timeout_s: float = TIMEOUT_S) -> str:
    """Run one snippet (see the module docstring) and return its stdout; raises SnippetFailed.
    `server_env` is what a server the snippet starts gets (cache dir, device)."""
    broken = block.problems()
    if broken:
        raise SnippetFailed("\n".join(broken))
    if block.not_run is not None:
        raise ValueError(f"{block.id} is marked not-run: {block.not_run}")
    cwd = workdir(tmp / "cwd", repo)
    env = {**os.environ, **server_env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    serves = block.serve_commands
    if serves:
        for serve in serves:
            _start_and_stop(block, serve, cwd, tmp, env)
        return ""

    def prepare(server_tmp: Path) -> None:
        for setup in block.values("server-setup"):
            setup = setup.replace("{tmp}", str(server_tmp))
            _check_exit(block, f"server-setup `{setup}`", SERVER_SETUP_TIMEOUT_S,
                        *_execute(["bash", "-euo", "pipefail", "-c", setup], cwd, tmp, env, SERVER_SETUP_TIMEOUT_S))

    server = pool.get(block.server_flags, prepare)
    env |= {"OPENAI_BASE_URL": server.base_url, "OPENAI_API_KEY": server.api_key or "unused", "KVSERVE_URL": server.url}
    code = LOCAL_SERVER.sub(f"127.0.0.1:{server.port}", block.commands)
    if block.kind == "python":
        (cwd / "_snippet.py").write_text(code)
        cmd = [sys.executable, "_snippet.py"]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    for setup in block.values("setup"):
        _check_exit(block, f"setup `{setup}`", timeout_s, *_execute(["bash", "-euo", "pipefail", "-c", setup], cwd, tmp, env, timeout_s))
    status, stdout, stderr = _execute(cmd, cwd, tmp, env, timeout_s)
    _check_exit(block, code, timeout_s, status, stdout, stderr, server)
    expects = block.values("expect")
    for pattern in expects:
        if not re.search(pattern, stdout, re.DOTALL):
            raise SnippetFailed(f"{block.id}: stdout does not match expect {pattern!r}\n{_report(code, stdout, stderr)}")
    bad = json_problems(stdout, strict=block.kind != "python", errors_expected=any("error" in p.lower() for p in expects))
    if bad:
        raise SnippetFailed(f"{block.id}: " + "; ".join(bad) + "\n" + _report(code, stdout, stderr))
    return stdout


def json_problems(stdout: str, *, strict: bool = True, errors_expected: bool = False) -> list[str]:
    """The JSON documents on `stdout` (from a line start or right after another document, or
    an SSE `data:` payload) that do not parse (only when `strict`) or are OpenAI error objects
    (unless `errors_expected`)."""
    out: list[str] = []
    decoder = json.JSONDecoder()
    i, n = 0, len(stdout)

    def check(doc: object, at: int) -> None:
        if isinstance(doc, dict) and not errors_expected and (doc.get("error") is not None or doc.get("type") == "error"):
            out.append(f"stdout line {line_of(stdout, at)} is an error: {json.dumps(doc)[:300]}")

    while i < n:
        eol = stdout.find("\n", i)
        eol = n if eol < 0 else eol
        if stdout.startswith("data:", i):
            payload = stdout[i + 5:eol].strip()
            if payload.startswith(("{", "[")) and payload != "[DONE]":
                try:
                    check(json.loads(payload), i)
                except ValueError as err:
                    if strict:
                        out.append(f"stdout line {line_of(stdout, i)}: an SSE payload that is not JSON ({err})")
            i = eol + 1
        elif stdout[i] == "{":
            try:
                doc, end = decoder.raw_decode(stdout, i)
            except ValueError as err:
                if strict:
                    out.append(f"stdout line {line_of(stdout, i)} looks like JSON but does not parse ({err})")
                i = eol + 1
                continue
            check(doc, i)
            i = end
            while i < n and stdout[i] in " \t\r\n":
                i += 1
        else:
            i = eol + 1
    return out


def workdir(path: Path, repo: Path) -> Path:
    """A fresh copy of the repo's working tree (the files git tracks or would track; 2-3 MB),
    with a link to its .venv: snippets run here, so they cannot write into the repo."""
    path.mkdir(parents=True)
    for name in _tree_files(repo):
        source, target = repo / name, path / name
        if source.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    if (repo / ".venv").is_dir():
        (path / ".venv").symlink_to(repo / ".venv", target_is_directory=True)
    return path


def _tree_files(repo: Path) -> list[str]:
    """`git ls-files --cached --others --exclude-standard`; without git, every file outside
    hidden directories, __pycache__ and *.egg-info."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        listed = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=repo, capture_output=True, timeout=30, check=True
        )
        return [name for name in listed.stdout.decode().split("\0") if name]
    names = [p.relative_to(repo) for p in repo.rglob("*")]
    return [n.as_posix() for n in names if not any(part.startswith(".") or part == "__pycache__" or part.endswith(".egg-info") for part in n.parts)]


def _start_and_stop(block: Block, serve: ServeCommand, cwd: Path, tmp: Path, env: dict[str, str]) -> None:
    """Run one `kvserve serve` line on a free port until it is ready and lists its models,
    then SIGTERM it and expect status 0."""
    port = free_port()
    argv = without_address(list(serve.argv)) + ["--host", "127.0.0.1", "--port", str(port)]
    line = shlex.join(["env", *serve.assignments, *argv]) if serve.assignments else shlex.join(argv)
    cmd = ["bash", "-c", f"cd {shlex.quote(str(cwd))} && exec {line}"]
    key = api_key(argv, serve.assignments)
    try:
        with started(ServerProcess, cmd, port, tmp / f"serve-{port}.log", _ready, env=env, ready_timeout_s=READY_TIMEOUT_S) as server:
            models = httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
            if models.status_code != 200:
                raise SnippetFailed(f"{block.id}: `{line}`: GET /v1/models answered {models.status_code}: {models.text[:500]}")
    except RuntimeError as err:
        raise SnippetFailed(f"{block.id}: `{line}` did not become ready: {err}") from None
    if server.proc.returncode != 0:
        raise SnippetFailed(f"{block.id}: `{line}` exited {server.proc.returncode} on SIGTERM:\n{server.log()[-3000:]}")


def _ready(server: ServerProcess) -> bool:
    return httpx.get(server.url + "/ready", timeout=2).status_code == 200


def _execute(cmd: list[str], cwd: Path, tmp: Path, env: dict[str, str], timeout_s: float) -> tuple[int | None, str, str]:
    """(status or None on timeout, stdout, stderr). Output goes to files and the whole process
    group is killed afterwards, so a backgrounded child can neither hold a pipe nor linger."""
    out_path, err_path = tmp / "stdout", tmp / "stderr"
    with open(out_path, "w") as out, open(err_path, "w") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        try:
            status = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            status = None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return status, out_path.read_text(errors="replace"), err_path.read_text(errors="replace")


def _check_exit(
    block: Block, code: str, timeout_s: float, status: int | None, stdout: str, stderr: str, server: ServerProcess | None = None
) -> None:
    if status == 0:
        return
    what = f"timed out after {timeout_s:.0f} s" if status is None else f"exited {status}"
    log = f"\n--- server log (tail) ---\n{server.log()[-2000:]}" if server is not None else ""
    raise SnippetFailed(f"{block.id}: {what}\n{_report(code, stdout, stderr)}{log}")


def _report(code: str, stdout: str, stderr: str) -> str:
    return f"--- ran ---\n{code.rstrip()}\n--- stdout (tail) ---\n{stdout[-3000:]}\n--- stderr (tail) ---\n{stderr[-3000:]}"
