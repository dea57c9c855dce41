"""The disk KV tier on real `kvserve serve` processes, through the openai SDK: sessions survive
a restart (SIGTERM writes them; the next process restores them on first use), the admin API
shows and deletes them in every tier, and a full disk stops the tier growing while serving goes
on."""

from __future__ import annotations

import re
import resource

import httpx
from openai import OpenAI

from bench.common import launch
from tests.conftest import test_cache_dir as cache_dir
from tests.device import SERVE_FLAGS

MODEL = "SmolLM2-135M-Instruct"
# the device holds 14 blocks of 16 tokens (SmolLM2 fp32: 46080 bytes a token): the long
# conversation below (186 prompt tokens and 8 more: 13 blocks) or the short one (31 and 8: 3),
# never both
ONE_SESSION_BUDGET = str(14 * 16 * 46080)


def labelled(server, name: str, **labels) -> float:
    """One labelled sample from /metrics (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        match = re.match(r"^(\S+?)\{(.*)\} (\S+)$", line)
        if match and match[1] == name and ",".join(sorted(match[2].split(","))) == want:
            return float(match[3])
    return 0.0


def ask(client: OpenAI, session: str, messages: list[dict]):
    """One greedy turn; returns (reply text, cached tokens, X-Cache-Miss-Reason)."""
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=8, prompt_cache_key=session,
    )
    completion = raw.parse()
    cached = completion.usage.prompt_tokens_details.cached_tokens
    return completion.choices[0].message.content, cached, raw.headers.get("x-cache-miss-reason")


def conversation(n_facts: int) -> list[dict]:
    facts = " ".join(f"Fact {k}: item {k} is {k * 7 % 13} metres long." for k in range(n_facts))
    return [{"role": "system", "content": f"You answer briefly. {facts}"}, {"role": "user", "content": "Which item is longest?"}]


def test_sessions_survive_a_restart(tmp_path):
    disk = tmp_path / "kv"
    flags = ("--cache-dir", str(cache_dir()), *SERVE_FLAGS, "--kv-disk-dir", str(disk))
    messages = conversation(4)
    with launch(tmp_path, *flags) as server:
        client = OpenAI(base_url=server.base_url, api_key="none")
        reply, _, _ = ask(client, "kept", messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "And the shortest?"}]
        assert ask(client, "gone", conversation(2))[0]
    assert server.proc.returncode == 0
    assert len(list(disk.glob("*.kv"))) == 2  # SIGTERM wrote both sessions
    with launch(tmp_path, *flags) as server:
        client = OpenAI(base_url=server.base_url, api_key="none")
        listed = httpx.get(server.url + "/v1/sessions", headers={"X-Session-ID": "kept"}).json()["data"]
        assert [(s["id"], s["tier"]) for s in listed] == [("kept", "disk")] and listed[0]["tokens"] > 0
        restored = ask(client, "kept", messages)
        fresh = ask(client, "fresh", messages)  # the same prompt, prefilled from scratch
        assert restored[1] > 0 and restored[2] == "restored_disk", restored
        assert fresh[1] == 0 and restored[0] == fresh[0]
        assert labelled(server, "kvserve_kv_restores_total", tier="disk") == 1
        # DELETE removes a session from every tier: its file goes too
        response = httpx.delete(server.url + "/v1/sessions/gone", headers={"X-Session-ID": "gone"})
        assert response.status_code == 204
        assert len(list(disk.glob("*.kv"))) == 1


def test_a_full_disk_stops_the_tier_growing_and_serving_goes_on(tmp_path):
    """RLIMIT_FSIZE makes the server's writes of files over 3 MB fail (EFBIG, as ENOSPC would):
    a short session's file fits, a long one's does not."""
    disk = tmp_path / "kv"
    flags = ("--cache-dir", str(cache_dir()), *SERVE_FLAGS, "--kv-disk-dir", str(disk), "--kv-budget-bytes", ONE_SESSION_BUDGET, "--max-model-len", str(14 * 16))
    with launch(tmp_path, *flags) as server:
        limit = 3 * 2**20
        resource.prlimit(server.proc.pid, resource.RLIMIT_FSIZE, (limit, limit))
        client = OpenAI(base_url=server.base_url, api_key="none")
        budget = labelled(server, "kvserve_kv_tier_budget_bytes", tier="disk")
        short, long = [{"role": "user", "content": "Hi"}], conversation(12)
        for turn in range(2):
            for session, messages in (("short", short), ("long", long)):
                reply, cached, reason = ask(client, session, messages)
                assert reply is not None
                if turn == 1 and session == "short":
                    assert cached > 0 and reason == "restored_disk"
                if turn == 1 and session == "long":
                    assert cached == 0 and reason == "evicted"  # its file could not be written
        assert labelled(server, "kvserve_kv_disk_writes_total", result="failed") >= 1
        assert labelled(server, "kvserve_kv_tier_budget_bytes", tier="disk") < budget  # stopped growing
        assert all(p.stat().st_size <= limit for p in disk.iterdir()) and not list(disk.glob("*.tmp"))
        assert httpx.get(server.url + "/ready").status_code == 200
