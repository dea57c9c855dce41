"""The chart's router option (`router.enabled`): Shepherd Model Gateway (SMG) in front of the
kvserve replicas, rendered by real Helm and validated like the rest of the chart (test_helm.py).

The last test runs the router command the chart renders, with the real `smg` 1.13 wheel (the
test extra), in front of two stand-in workers that check keys the way kvserve does: it shows
that SMG registers key-protected replicas and forwards each client's own Authorization header.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import helm_python as helm
import httpx
import kubernetes_validate
import pytest

from bench.common import free_port
from tests.deploy.helm_chart import ALL_OPTIONS, CHART, KUBE_VERSIONS, render

ROUTER = {"router": {"enabled": True}}
# Without `lora`: SMG cannot route to adapters, so the chart refuses them with the router
# (test_helm.py, test_lora_is_refused_behind_the_router).
ROUTER_ALL_OPTIONS = {k: v for k, v in copy.deepcopy(ALL_OPTIONS).items() if k != "lora"} | {"router": {
    "enabled": True,
    "replicaCount": 2,
    "image": {"repository": "registry.example.com/smg", "tag": "1.13.0",
              "digest": "sha256:" + "0" * 64, "pullPolicy": "Always"},
    "policy": "cache_aware",
    "cacheThreshold": 0.5,
    "loadMonitorIntervalSeconds": 2,
    "port": 30000,
    "metricsPort": 29000,
    "discovery": {"mode": "kubernetes"},
    "healthCheck": {"path": "/ready", "intervalSeconds": 2, "timeoutSeconds": 2,
                    "failureThreshold": 2, "successThreshold": 1},
    "requestTimeoutSeconds": 900,
    "shutdownGraceSeconds": 20,
    "logLevel": "debug",
    "extraArgs": ["--retry-max-retries", 3],
    "serviceAccount": {"create": True, "name": "smg", "annotations": {"example.com/role": "router"}},
    "podAnnotations": {"example.com/team": "ml"},
    "podLabels": {"tier": "router"},
    "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "4Gi"}},
    "nodeSelector": {"kubernetes.io/os": "linux"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "router", "effect": "NoSchedule"}],
    "affinity": {"podAntiAffinity": {}},
}}
STATIC = {"router": {"enabled": True, "discovery": {"mode": "static",
                                                    "workerUrls": ["http://10.0.0.1:8000", "http://10.0.0.2:8000"]}}}
VARIANTS = {"router": ROUTER, "router-all-options": ROUTER_ALL_OPTIONS, "router-static": STATIC}


def named(docs, kind: str, name: str) -> dict[str, Any]:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def router_deployment(docs) -> dict[str, Any]:
    return named(docs, "Deployment", "demo-kvserve-router")


def router_container(docs) -> dict[str, Any]:
    (container,) = router_deployment(docs)["spec"]["template"]["spec"]["containers"]
    return container


def flag(args: list[str], name: str) -> list[str]:
    """The values after `name` up to the next flag."""
    start = args.index(name) + 1
    end = next((i for i in range(start, len(args)) if str(args[i]).startswith("--")), len(args))
    return args[start:end]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_helm_lint(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace="llm")
    assert report["errors"] == [], report
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_validates(chart, variant: str) -> None:
    for doc in render(chart, VARIANTS[variant]):
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            continue  # a CRD: test_helm.py checks its shape
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_router_off_by_default(chart) -> None:
    docs = render(chart)
    assert not [d for d in docs if "router" in d["metadata"]["name"] or d["kind"] in ("Role", "RoleBinding")]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    kvserve_pods = named(docs, "Deployment", "demo-kvserve")["spec"]["template"]["metadata"]["labels"]
    assert selects(service["spec"]["selector"], kvserve_pods)


def test_router_renders_its_kinds(chart) -> None:
    kinds = sorted(d["kind"] for d in render(chart, ROUTER))
    assert kinds == sorted(["Deployment", "Deployment", "Service", "Service", "ServiceAccount",
                            "ServiceAccount", "Role", "RoleBinding"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_router_args(chart, variant: str) -> None:
    args = router_container(render(chart, VARIANTS[variant]))["args"]
    assert flag(args, "--policy") == ["cache_aware"]
    assert flag(args, "--health-check-endpoint") == ["/ready"]
    assert flag(args, "--port") == ["30000"]
    assert flag(args, "--load-monitor-interval") == [str(VARIANTS[variant]["router"].get("loadMonitorIntervalSeconds", 1))]
    assert "--disable-tokenizer-autoload" in args  # plain HTTP routing: nothing to download


def test_router_args_parse_with_smg(chart) -> None:
    """Every rendered flag is one `smg launch` 1.13 knows, with a value it accepts."""
    if importlib.util.find_spec("smg") is None:
        pytest.skip("smg is not installed (it comes with the test extra)")
    from smg.launch_router import parse_router_args

    for values in VARIANTS.values():
        parsed = parse_router_args([str(a) for a in router_container(render(chart, values))["args"]])
        assert parsed.policy == "cache_aware" and parsed.health_check_endpoint == "/ready"
        assert parsed.load_monitor_interval == values["router"].get("loadMonitorIntervalSeconds", 1)


def test_kubernetes_discovery_watches_this_release_s_kvserve_pods(chart) -> None:
    docs = render(chart, ROUTER)
    args = router_container(docs)["args"]
    assert "--service-discovery" in args and "--worker-urls" not in args
    selector = dict(s.split("=", 1) for s in flag(args, "--selector"))
    kvserve_pods = named(docs, "Deployment", "demo-kvserve")["spec"]["template"]["metadata"]["labels"]
    router_pods = router_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    assert selects(selector, kvserve_pods) and not selects(selector, router_pods)
    assert flag(args, "--service-discovery-namespace") == ["llm"]
    assert flag(args, "--service-discovery-port") == ["8000"]
    # ...and no kvserve selector picks up the router's pods.
    kvserve_selector = named(docs, "Deployment", "demo-kvserve")["spec"]["selector"]["matchLabels"]
    assert not selects(kvserve_selector, router_pods)


def test_rbac_iff_kubernetes_discovery(chart) -> None:
    docs = render(chart, ROUTER)
    role, binding = named(docs, "Role", "demo-kvserve-router"), named(docs, "RoleBinding", "demo-kvserve-router")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "demo-kvserve-router"}
    spec = router_deployment(docs)["spec"]["template"]["spec"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"], "namespace": "llm"}]
    assert spec["automountServiceAccountToken"] is True
    assert not [d for d in docs if d["kind"] == "ClusterRole"]

    static = render(chart, STATIC)
    assert not [d for d in static if d["kind"] in ("Role", "RoleBinding", "ClusterRole")]
    assert router_deployment(static)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    args = router_container(static)["args"]
    assert flag(args, "--worker-urls") == STATIC["router"]["discovery"]["workerUrls"]
    assert "--service-discovery" not in args
    with pytest.raises(helm.HelmError, match="workerUrls"):
        render(chart, {"router": {"enabled": True, "discovery": {"mode": "static"}}})


def test_service_and_ingress_point_at_the_router(chart) -> None:
    docs = render(chart, ROUTER_ALL_OPTIONS)
    router_pods = router_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    kvserve_pods = named(docs, "Deployment", "demo-kvserve")["spec"]["template"]["metadata"]["labels"]
    service = named(docs, "Service", "demo-kvserve")
    assert selects(service["spec"]["selector"], router_pods)
    assert not selects(service["spec"]["selector"], kvserve_pods)
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]
    assert "http" in [p["name"] for p in router_container(docs)["ports"]]
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": "demo-kvserve", "port": {"number": 8000}}
    # The kvserve pods keep a headless Service of their own, which the ServiceMonitor scrapes.
    workers = named(docs, "Service", "demo-kvserve-workers")
    assert workers["spec"]["clusterIP"] == "None"
    assert selects(workers["spec"]["selector"], kvserve_pods)
    monitor = next(d for d in docs if d["kind"] == "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert selects(monitor, workers["metadata"]["labels"]) and not selects(monitor, service["metadata"]["labels"])


def test_network_policy_lets_only_the_router_call_kvserve(chart) -> None:
    docs = render(chart, ROUTER_ALL_OPTIONS)
    router_pods = router_deployment(docs)["spec"]["template"]["metadata"]["labels"]
    kvserve_policy = named(docs, "NetworkPolicy", "demo-kvserve")
    (api_rule,) = [r for r in kvserve_policy["spec"]["ingress"] if r["ports"][0]["port"] == "http"]
    (source,) = api_rule["from"]
    assert selects(source["podSelector"]["matchLabels"], router_pods)
    router_policy = named(docs, "NetworkPolicy", "demo-kvserve-router")
    assert selects(router_policy["spec"]["podSelector"]["matchLabels"], router_pods)
    (router_api,) = [r for r in router_policy["spec"]["ingress"] if r["ports"][0]["port"] == "http"]
    assert router_api["from"] == ALL_OPTIONS["networkPolicy"]["apiFrom"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_router_probes_and_hardening(chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    container = router_container(docs)
    assert container["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert container["readinessProbe"]["httpGet"] == {"path": "/readiness", "port": "http"}
    spec = router_deployment(docs)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    context = container["securityContext"]
    assert context["allowPrivilegeEscalation"] is False and context["readOnlyRootFilesystem"] is True
    assert context["capabilities"]["drop"] == ["ALL"] and not context.get("privileged")
    assert container["resources"]["requests"] and container["resources"]["limits"]["memory"]
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {"/tmp"}
    pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
    grace = float(flag(container["args"], "--shutdown-grace-period-secs")[0])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + grace


def test_router_image_is_pinned(chart) -> None:
    assert router_container(render(chart, ROUTER))["image"] == "docker.io/lightseekorg/smg:1.13.0"
    assert router_container(render(chart, ROUTER_ALL_OPTIONS))["image"] == (
        "registry.example.com/smg:1.13.0@sha256:" + "0" * 64)


def test_router_reads_kvserve_s_keys_from_the_secret(chart) -> None:
    docs = render(chart, ROUTER_ALL_OPTIONS)
    container = router_container(docs)
    assert container["command"][:2] == ["python3", "-c"]
    assert container["command"][3] == "/etc/kvserve/secrets/api-keys"
    assert not [a for a in container["args"] if str(a) in ALL_OPTIONS["apiKey"]["keys"]]  # no key in the spec
    (volume,) = [v for v in router_deployment(docs)["spec"]["template"]["spec"]["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == next(d for d in docs if d["kind"] == "Secret")["metadata"]["name"]
    assert "checksum/api-keys" in router_deployment(docs)["spec"]["template"]["metadata"]["annotations"]
    assert router_container(render(chart, ROUTER))["command"] == ["python3", "-m", "smg.launch_router"]


@pytest.mark.parametrize("bad", [
    {"router": {"enabled": True, "policy": "fastest"}},
    {"router": {"enabled": True, "discovery": {"mode": "dns"}}},
    {"router": {"enabled": True, "image": {"repository": "smg", "tag": ""}}},
    {"router": {"enabled": True, "cacheThreshold": 2}},
    {"router": {"enabled": True, "loadMonitorIntervalSeconds": 0}},
    {"router": {"enabled": True, "no_such_option": 1}},
])
def test_schema_rejects_bad_router_values(chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        render(chart, bad)


# A stand-in worker that checks keys as kvserve does (all but /health and /ready need one) and
# logs each request's path and Authorization header as one JSON line.
STUB_WORKER = textwrap.dedent("""
    import json, sys, threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    KEYS = {"Bearer sk-team-a", "Bearer sk-team-b"}
    MODELS = {"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "kvserve"}]}
    CHAT = {"id": "c", "object": "chat.completion", "created": 0, "model": "m", "usage": {
        "prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}, "choices": [{
        "index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "hi"}}]}
    LOG = threading.Lock()
    class Worker(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        def reply(self, code, body):
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        def handle_any(self):
            self.rfile.read(int(self.headers.get("content-length") or 0))
            path, auth = self.path.split("?")[0], self.headers.get("authorization")
            with LOG:
                sys.stdout.write(json.dumps({"method": self.command, "path": path, "auth": auth}) + "\\n")
                sys.stdout.flush()
            if path in ("/health", "/ready"):
                return self.reply(200, {"status": "ok"})
            if auth not in KEYS:
                return self.reply(401, {"error": {"message": "Incorrect or missing API key"}})
            if path == "/v1/models":
                return self.reply(200, MODELS)
            if path == "/v1/chat/completions":
                return self.reply(200, CHAT)
            return self.reply(404, {"error": {"message": "not found"}})
        do_GET = do_POST = handle_any
        def log_message(self, *args):
            pass
    ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Worker).serve_forever()
""")


def test_rendered_router_command_registers_keyed_replicas_and_forwards_authorization(chart, tmp_path: Path) -> None:
    if importlib.util.find_spec("smg") is None:
        pytest.skip("smg is not installed (it comes with the test extra)")
    (tmp_path / "worker.py").write_text(STUB_WORKER)
    ports = [free_port(), free_port()]
    router_port, metrics_port = free_port(), free_port()
    values = copy.deepcopy(ROUTER_ALL_OPTIONS)
    values["router"] |= {"port": router_port, "metricsPort": metrics_port, "extraArgs": [],
                         "discovery": {"mode": "static", "workerUrls": [f"http://127.0.0.1:{p}" for p in ports]}}
    container = router_container(render(chart, values))
    keys_file = tmp_path / "api-keys"
    keys_file.write_text("# team keys\nsk-team-a\n\nsk-team-b\nsk-team-a\n")
    command = [sys.executable, *container["command"][1:3], str(keys_file)]
    args = [str(a) for a in container["args"]]
    args[args.index("--host") + 1] = args[args.index("--prometheus-host") + 1] = "127.0.0.1"
    with contextlib.ExitStack() as stack:
        logs = []
        for port in ports:
            log = stack.enter_context(open(tmp_path / f"worker-{port}.log", "w"))
            logs.append(tmp_path / f"worker-{port}.log")
            stack.callback(subprocess.Popen([sys.executable, str(tmp_path / "worker.py"), str(port)], stdout=log).kill)
        router_log = stack.enter_context(open(tmp_path / "router.log", "w"))
        router = subprocess.Popen(command + args, stdout=router_log, stderr=subprocess.STDOUT,
                                  env={"NO_COLOR": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
        stack.callback(router.kill)
        base = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 60
        while True:
            assert router.poll() is None, (tmp_path / "router.log").read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(base + "/readiness", timeout=2).json().get("healthy_workers") == 2:
                    break
            assert time.monotonic() < deadline, (tmp_path / "router.log").read_text()[-3000:]
            time.sleep(0.2)
        body = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}
        for key in ("sk-team-a", "sk-team-b"):
            reply = httpx.post(base + "/v1/chat/completions", json=body, timeout=10,
                               headers={"Authorization": f"Bearer {key}"})
            assert reply.status_code == 200, reply.text
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=10,
                          headers={"Authorization": "Bearer sk-unknown"}).status_code == 401
        assert httpx.post(base + "/v1/chat/completions", json=body, timeout=10).status_code == 401
    seen = [json.loads(line) for log in logs for line in log.read_text().splitlines()]
    chats = sorted(r["auth"] for r in seen if r["path"] == "/v1/chat/completions")
    assert chats == ["Bearer sk-team-a", "Bearer sk-team-b"]  # each client's own key, unchanged
    assert {r["auth"] for r in seen if r["path"] == "/v1/models"} == {"Bearer sk-team-a"}  # registration
