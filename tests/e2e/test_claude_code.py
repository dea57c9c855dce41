"""Claude Code (the `@anthropic-ai/claude-code` npm package, installed by `scripts/install.sh test`
where npm is) pointed at a real `kvserve serve` with ANTHROPIC_BASE_URL, as docs/guides/messages.md
says: a headless prompt (`claude -p`) with its default tools (a ~13k-token system prompt and tool
list, system messages between turns, cache_control, metadata, streaming) runs to its result.

The model is a tiny random-weight Qwen3-format model (a tool format and thinking markers, a
64k context) saved to disk; its end-of-turn token is made likely (about one token in five), so a
turn ends well inside Claude Code's output limit whatever else it writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from bench.common import launch
from tests import conftest, thinking
from tests.device import SERVE_FLAGS

CLAUDE = Path(sys.prefix) / "claude-code" / "node_modules" / "@anthropic-ai" / "claude-code" / "bin" / "claude.exe"
IN_CI = os.environ.get("CI", "").lower() == "true"
MODEL = "tiny-coder"
KEY = "sk-claude-code"

needs_claude = pytest.mark.skipif(not CLAUDE.exists() and not IN_CI, reason="Claude Code is not installed (scripts/install.sh test, with npm)")


def ends_turns_often(loaded, p_end: float = 0.2) -> None:
    """Make the end-of-turn token's probability about `p_end` at every step: a large constant
    in one dimension of every embedding dominates the final norm's output, and the end token's
    row of the (untied) output layer reads that dimension."""
    model = loaded.model
    assert not model.config.tie_word_embeddings
    end = thinking.end_of_turn_ids(loaded.tokenizer)[0]
    hidden = model.config.hidden_size
    with torch.no_grad():
        model.get_input_embeddings().weight[:, 0] += 50.0
        norm_out = hidden ** 0.5  # the normed value of the dominant dimension
        logit = torch.log(torch.tensor(p_end / (1 - p_end) * (model.config.vocab_size - 1))).item()
        model.get_output_embeddings().weight[end, 0] = logit / norm_out


@pytest.fixture(scope="module")
def coder_dir(tmp_path_factory, tokenizer) -> Path:
    loaded = thinking.tiny_model(thinking.family_tokenizer(tokenizer, "qwen3"))
    loaded.model.config.max_position_embeddings = 65536
    ends_turns_often(loaded)
    out = tmp_path_factory.mktemp("coder")
    loaded.model.save_pretrained(out)
    loaded.tokenizer.save_pretrained(out)
    return out


@needs_claude
def test_claude_code_runs_a_headless_prompt(coder_dir, tmp_path):
    flags = ("--model", str(coder_dir), "--served-model-name", MODEL, "--api-key", KEY)
    with launch(tmp_path, "--cache-dir", str(conftest.test_cache_dir()), *SERVE_FLAGS, *flags) as server:
        work, home = tmp_path / "project", tmp_path / "home"
        work.mkdir()
        home.mkdir()
        (work / "notes.txt").write_text("buy milk\n")
        env = {
            "PATH": os.environ["PATH"], "HOME": str(home),
            "ANTHROPIC_BASE_URL": server.url, "ANTHROPIC_API_KEY": KEY,
            "ANTHROPIC_MODEL": MODEL, "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL, "ANTHROPIC_DEFAULT_SONNET_MODEL": MODEL,
            "ANTHROPIC_DEFAULT_OPUS_MODEL": MODEL, "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "256",
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1",
        }
        done = subprocess.run([str(CLAUDE), "-p", "List the files here.", "--output-format", "json", "--max-turns", "2"],
                              cwd=work, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        result = json.loads(done.stdout)
        assert result["type"] == "result" and not result["is_error"], result
        usage = result["modelUsage"][MODEL]
        assert usage["inputTokens"] + usage["cacheReadInputTokens"] > 10_000  # its system prompt and tools were read
        metrics = httpx.get(server.url + "/metrics", headers={"x-api-key": KEY}).text
        served = [line for line in metrics.splitlines() if line.startswith("kvserve_http_requests_total") and '"/v1/messages"' in line]
        assert any('status="200"' in line and not line.endswith(" 0.0") for line in served), served
        assert not any('status="4' in line or 'status="5' in line for line in served), served
