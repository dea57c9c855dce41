"""Every shell and Python snippet of README.md and docs/**/*.md runs against a real server with
its output checked, or says why it cannot (the convention: tests/docs/snippets.py). One test
case per snippet, named by file:line; run just these with `pytest tests/docs/test_snippets.py`."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.docs import snippet_runner, snippets
from tests.docs.snippets import SnippetFailed

REPO = Path(__file__).resolve().parents[2]
PAGES = snippets.collect(REPO)
SNIPPETS = snippets.snippets(PAGES)

SAMPLE = textwrap.dedent("""\
    # A sample page

    ```bash
    curl -s http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{
      "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Hi"}],
      "temperature": 0, "max_tokens": 4}'
    # streamed: this line's SSE follows the JSON above on the same line (curl adds no newline)
    curl -sN localhost:8000/v1/completions -H 'Content-Type: application/json' -d '{
      "model": "SmolLM2-135M-Instruct", "prompt": "1, 2,", "max_tokens": 3, "stream": true}'
    ```
    <!-- expect: "object":\\s*"chat\\.completion".*data: \\[DONE\\] -->

    ```python
    from openai import OpenAI

    client = OpenAI(base_url="http://localhost:8000/v1", api_key="unused")
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], temperature=0, max_tokens=4,
    )
    print(out.usage.completion_tokens, {"python": "repr"})
    ```
    <!-- expect: ^4 -->

    <!-- not-run: needs a GPU -->
    ```bash
    kvserve serve --device cuda
    ```

    ```bash
    scripts/install.sh && .venv/bin/kvserve serve --max-running 4 --port 8000
    ```

    <!-- server: --api-key sk-test -->
    <!-- setup: printf 'Hello\\n' > greeting.txt -->
    ```console
    $ curl -s "$OPENAI_BASE_URL/models" \\
        -H "Authorization: Bearer $OPENAI_API_KEY"
    {"object": "list", "data": [...]}
    $ cat greeting.txt
    Hello
    ```
    <!-- expect: SmolLM2-135M-Instruct.*Hello -->

    ```yaml
    not: a snippet
    ```
    """)


def sample_page(text: str = SAMPLE):
    return snippets.parse(text, "sample.md")


@pytest.mark.e2e
@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet(snippet, server_pool, server_env, tmp_path):
    if snippet.not_run is not None and not snippet.problems():
        pytest.skip(f"not run: {snippet.not_run}")
    snippet_runner.run(snippet, server_pool, tmp_path, REPO, server_env)


def test_every_snippet_is_run_or_marked():
    problems = snippets.problems(PAGES)
    assert not problems, "\n".join(problems)


def test_extraction_of_markers_console_and_expect():
    page = sample_page()
    assert page.stray == []
    assert [(b.line, b.kind) for b in page.blocks] == [(3, "shell"), (13, "python"), (25, "shell"), (29, "shell"), (35, "console"), (44, None)]
    curl, python, gpu, serve, console, yaml = page.blocks
    assert curl.values("expect") == [r'"object":\s*"chat\.completion".*data: \[DONE\]'] and curl.not_run is None
    assert python.code.startswith("from openai import OpenAI\n") and python.values("expect") == ["^4"]
    assert gpu.not_run == "needs a GPU" and gpu.serve_commands is not None
    assert serve.serve_commands == [snippets.ServeCommand((), (".venv/bin/kvserve", "serve", "--max-running", "4", "--port", "8000"))]
    assert console.server_flags == "--api-key sk-test" and console.values("setup") == ["printf 'Hello\\n' > greeting.txt"]
    assert console.commands == 'curl -s "$OPENAI_BASE_URL/models" \\\n    -H "Authorization: Bearer $OPENAI_API_KEY"\ncat greeting.txt\n'
    assert curl.serve_commands is None and console.serve_commands is None
    assert yaml.code == "not: a snippet\n"
    assert snippets.problems([page]) == []


def test_convention_breaks_are_reported_by_file_and_line():
    page = sample_page(textwrap.dedent("""\
        <!-- not-run: -->
        ```bash
        true
        ```

        <!-- server: --deterministic -->

        ```python
        print(1)
        ```
        <!-- skip: flaky -->
        ```sh
        true
        ```

        <!-- expect: x -->
        ```py
        print(1)
        ```

        ```bash
        kvserve serve --model Qwen/Qwen3-0.6B
        ```

        ```bash
        kvserve serve &
        curl localhost:8000/v1/models
        ```
        <!-- expect: [ -->

        <!-- not-run: a config file -->
        ```yaml
        a: 1
        ```

        ```bash
        scripts/install.sh test && .venv/bin/python -m pytest -q
        ```
        """))
    assert snippets.problems([page]) == [
        "sample.md:6: 'server' marker not directly above a fence",
        "sample.md:16: 'expect' marker above a fence (it goes directly after the closing fence)",
        "sample.md:1: empty 'not-run' marker (give the reason)",
        "sample.md:11: unknown marker 'skip' (known: not-run, server, server-setup, setup, expect)",
        "sample.md:21: `Qwen/Qwen3-0.6B` downloads a model from the hub: mark it <!-- not-run: downloads a model from the hub -->",
        "sample.md:25: expect '[' is not a regex (unterminated character set at position 0)",
        "sample.md:25: mixes `kvserve serve` with other commands: split it, or mark it not-run",
        "sample.md:32: markers on a 'yaml' block, which is never run",
        "sample.md:36: must not run here: it (re)installs packages; the suite runs after `scripts/install.sh test`; mark it not-run",
    ]


def test_a_server_setup_needs_the_server_it_prepares():
    page = sample_page("<!-- server-setup: true -->\n```bash\ntrue\n```\n")
    assert snippets.problems([page]) == ["sample.md:2: a 'server-setup' marker without the 'server' whose start it prepares"]


def test_json_checks():
    ok = '{"id": 1}data: {"a": 1}\n\ndata: [DONE]\n{\n  "pretty": true\n}\nplain text {not json\n'
    assert snippet_runner.json_problems(ok) == []
    error = '{"error": {"message": "no", "code": "model_not_found"}}'
    assert snippet_runner.json_problems(error) == [f"stdout line 1 is an error: {error}"]
    assert snippet_runner.json_problems(error, errors_expected=True) == []
    assert snippet_runner.json_problems('{"object": "response", "error": null}') == []
    assert snippet_runner.json_problems('data: {"type": "error", "message": "x"}\n')[0].startswith("stdout line 1 is an error")
    assert snippet_runner.json_problems("ok\n{'a': 1}\n")[0].startswith("stdout line 2 looks like JSON but does not parse")
    assert snippet_runner.json_problems("{'a': 1}\n", strict=False) == []


@pytest.mark.e2e
def test_runner_on_a_sample_page(server_pool, server_env, tmp_path):
    """The runner's own end-to-end check: the sample page passes, and each kind of failure is
    caught and named by file:line."""
    for i, block in enumerate(b for b in sample_page().blocks if b.kind and b.not_run is None):
        snippet_runner.run(block, server_pool, tmp_path / str(i), REPO, server_env)

    def fails(markdown: str, match: str) -> None:
        (block,) = snippets.parse(textwrap.dedent(markdown), "bad.md").blocks
        with pytest.raises(SnippetFailed, match=match):
            snippet_runner.run(block, server_pool, tmp_path / f"bad-{len(list(tmp_path.iterdir()))}", REPO, server_env)

    not_found = """\
        ```bash
        curl -s localhost:8000/v1/chat/completions -H 'Content-Type: application/json' -d '{"model": "gpt-4o", "messages": [{"role": "user", "content": "Hi"}]}'
        ```
        """
    fails(not_found, r"bad.md:1: stdout line 1 is an error: .*model_not_found")
    (allowed,) = snippets.parse(textwrap.dedent(not_found) + '<!-- expect: "error".*model_not_found -->\n', "ok.md").blocks
    snippet_runner.run(allowed, server_pool, tmp_path / "allowed", REPO, server_env)
    fails("```python\nprint('hello')\n```\n<!-- expect: goodbye -->\n", r"bad.md:1: stdout does not match expect 'goodbye'")
    fails("```sh\necho partial; false\n```\n", r"(?s)bad.md:1: exited 1.*partial")
    fails("<!-- server: --max-running 3 -->\n<!-- server-setup: echo preparing; exit 3 -->\n```sh\ntrue\n```\n",
          r"(?s)bad.md:3: exited 3.*server-setup `echo preparing; exit 3`.*preparing")
    fails("```bash\nkvserve serve --max-running 0\n```\n", r"bad.md:1: `kvserve serve --max-running 0 --host 127.0.0.1 --port \d+` did not become ready")


    written = snippets.parse("```bash\ntouch scripts/new-file README.md\n```\n", "ok.md").blocks[0]
    snippet_runner.run(written, server_pool, tmp_path / "written", REPO, server_env)
    assert (tmp_path / "written/cwd/scripts/new-file").exists() and not (REPO / "scripts/new-file").exists()
