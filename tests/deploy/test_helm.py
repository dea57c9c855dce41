"""The Helm chart, rendered by real Helm (the Go SDK inside `helm-python-sdk`, no cluster).

`helm lint` and `helm template` run with the default values and with every option on
(helm/kvserve/ci/all-options-values.yaml); every rendered manifest is validated against the
Kubernetes OpenAPI schemas shipped by `kubernetes-validate` (offline), for the oldest
Kubernetes the chart supports and the newest the package knows.
"""

from __future__ import annotations

import base64
import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml

from server.settings import Settings
from tests.deploy.helm_chart import ALL_OPTIONS, CHART, KUBE_VERSIONS, render

SETTINGS_ENV = {f"KVSERVE_{name.upper()}" for name in Settings.model_fields}

VARIANTS: dict[str, dict[str, Any]] = {
    "default": {},
    "all-options": ALL_OPTIONS,
    "cpu-existing-secret-new-pvcs": {
        "gpu": {"enabled": False},
        "kvserve": {"device": "cpu", "metricsPort": None},
        "apiKey": {"enabled": True, "existingSecret": "my-keys", "secretKey": "keys.txt"},
        "cache": {"seedFromImage": False, "persistence": {"enabled": True}},
        "models": {"persistence": {"enabled": True, "size": "100Gi"}},
        "podDisruptionBudget": {"enabled": True, "minAvailable": None, "maxUnavailable": "50%"},
        "networkPolicy": {"enabled": True},
        "ingress": {"enabled": True, "sessionHeader": "X-User-Session", "className": ""},
    },
    "no-auth-metrics-on-api-port": {
        "kvserve": {"metricsPort": None},
        "serviceMonitor": {"enabled": True},
        "networkPolicy": {"enabled": True, "restrictEgress": True},
        "terminationGracePeriodSeconds": 60,
    },
    # all-options has the disk tier on a created ReadWriteMany claim; here on an emptyDir.
    # the manual's 32B-on-one-80GB-GPU recipe (docs/getting-started/helm.md), as shipped
    "qwen2.5-coder-32b-h100": yaml.safe_load((CHART / "examples/qwen2.5-coder-32b-h100.yaml").read_text()),
    # the manual's LoRA recipe (docs/getting-started/helm.md), as shipped: adapters on a ReadOnlyMany claim, run-time loading on
    "lora-adapters": yaml.safe_load((CHART / "examples/lora-adapters.yaml").read_text()),
    "kv-tiers-emptydir": {
        "kvTiers": {"hostBytes": 8 * 2**30, "disk": {
            "enabled": True, "mountPath": "/kv", "bytes": 10 * 2**30, "persistIntervalSeconds": 2.5,
            "persistence": {"enabled": False}, "emptyDir": {"sizeLimit": "20Gi"}}},
        "kvserve": {"shutdownGraceSeconds": 2},
    },
}


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind}"
    return found[0]


def pod_spec(docs) -> dict[str, Any]:
    return one(docs, "Deployment")["spec"]["template"]["spec"]


def server_container(docs) -> dict[str, Any]:
    (container,) = [c for c in pod_spec(docs)["containers"] if c["name"] == "kvserve"]
    return container


def env(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container["env"]}


@pytest.mark.parametrize("variant", ["default", "all-options"])
def test_helm_lint(variant: str) -> None:
    report = helm.lint(CHART, VARIANTS[variant], strict=True, namespace="llm")
    assert report["errors"] == [], report
    # severity 1 = info ("icon is recommended"); warnings and errors fail
    assert [m for m in report["messages"] if m["severity"] >= 2] == [], report


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_manifest_validates(chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    assert docs
    for doc in docs:
        if doc["apiVersion"] == "monitoring.coreos.com/v1":
            # A CRD (Prometheus Operator): no schema in kubernetes-validate; check its shape.
            assert doc["kind"] == "ServiceMonitor"
            assert doc["spec"]["selector"]["matchLabels"] and doc["spec"]["endpoints"]
            continue
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_validation_catches_a_bad_manifest(chart) -> None:
    deployment = copy.deepcopy(one(render(chart), "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["httpGet"]["pth"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBE_VERSIONS[-1], strict=True)


def test_all_options_renders_every_kind(chart) -> None:
    kinds = sorted(d["kind"] for d in render(chart, ALL_OPTIONS))
    assert kinds == sorted([
        "Deployment", "Service", "ServiceAccount", "Secret", "PersistentVolumeClaim", "Ingress",
        "PersistentVolumeClaim",  # the cache's and the disk KV tier's
        "ServiceMonitor", "PodDisruptionBudget", "NetworkPolicy", "HorizontalPodAutoscaler",
    ])


def test_default_renders_a_gpu_deployment_only(chart) -> None:
    docs = render(chart)
    assert sorted(d["kind"] for d in docs) == ["Deployment", "Service", "ServiceAccount"]
    container = server_container(docs)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert {p["name"]: p["containerPort"] for p in container["ports"]} == {"http": 8000, "metrics": 9100}
    cpu = server_container(render(chart, {"gpu": {"enabled": False}}))
    assert "nvidia.com/gpu" not in cpu["resources"].get("limits", {})


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_probes(chart, variant: str) -> None:
    container = server_container(render(chart, VARIANTS[variant]))
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] in ("/ready", "/health")
    # Sized for loading (and on first start converting) a model: minutes, not seconds.
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container[probe]["httpGet"]["port"] == "http"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_security_context(chart, variant: str) -> None:
    spec = pod_spec(render(chart, VARIANTS[variant]))
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] != 0
    assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"] + spec.get("initContainers", []):
        context = container["securityContext"]
        assert context["runAsNonRoot"] is True
        assert context["allowPrivilegeEscalation"] is False
        assert context["readOnlyRootFilesystem"] is True
        assert context["capabilities"]["drop"] == ["ALL"]
        assert not context.get("privileged")


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_writable_paths_are_volumes(chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    container = server_container(docs)
    variables = env(container)
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    writable = [variables["KVSERVE_CACHE_DIR"], "/tmp", variables["HOME"]]
    if "KVSERVE_KV_DISK_DIR" in variables:  # the disk KV tier writes session files there
        writable.append(variables["KVSERVE_KV_DISK_DIR"])
    for path in writable:
        assert path in mounts and not mounts[path].get("readOnly"), path
        volume = volumes[mounts[path]["name"]]
        assert "emptyDir" in volume or "persistentVolumeClaim" in volume
    assert variables["HF_HOME"].startswith(VARIANTS[variant].get("models", {}).get("mountPath", "/data/models"))
    assert any(m["name"] == "models" for m in container["volumeMounts"])
    init = pod_spec(docs).get("initContainers", [])
    if init:  # the seed copies the image's baked cache into the cache volume
        (seed,) = init
        assert seed["image"] == container["image"]
        assert seed["command"][-2] == "/opt/kvserve/cache"
        (target,) = [m for m in seed["volumeMounts"] if m["mountPath"] == seed["command"][-1]]
        assert target["name"] == mounts[variables["KVSERVE_CACHE_DIR"]]["name"]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_env_names_are_kvserve_settings(chart, variant: str) -> None:
    names = {n for n in env(server_container(render(chart, VARIANTS[variant]))) if n.startswith("KVSERVE_")}
    assert names <= SETTINGS_ENV, names - SETTINGS_ENV


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_termination_grace_lets_requests_drain(chart, variant: str) -> None:
    docs = render(chart, VARIANTS[variant])
    container = server_container(docs)
    shutdown_grace = float(env(container)["KVSERVE_SHUTDOWN_GRACE_S"])
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = shutdown_grace + float(pre_stop[1])
    if "KVSERVE_KV_DISK_DIR" in env(container):
        # After the drain the server writes every idle session to disk for up to this long.
        needed += max(5.0, shutdown_grace)
    assert pod_spec(docs)["terminationGracePeriodSeconds"] > needed


def test_too_short_termination_grace_is_refused(chart) -> None:
    values = {"kvserve": {"shutdownGraceSeconds": 60}, "terminationGracePeriodSeconds": 65}
    with pytest.raises(helm.HelmError, match="terminationGracePeriodSeconds"):
        render(chart, values)
    # Long enough to drain, too short to write the sessions to the disk tier as well.
    values = {"kvserve": {"shutdownGraceSeconds": 30}, "terminationGracePeriodSeconds": 60,
              "kvTiers": {"disk": {"enabled": True}}}
    assert pod_spec(render(chart, values | {"kvTiers": {"disk": {"enabled": False}}}))["terminationGracePeriodSeconds"] == 60
    with pytest.raises(helm.HelmError, match=r"max\(5, kvserve.shutdownGraceSeconds\).*disk tier"):
        render(chart, values)
    assert pod_spec(render(chart, values | {"terminationGracePeriodSeconds": None}))["terminationGracePeriodSeconds"] == 10 + 30 + 30 + 15


def test_ingress_routes_by_session_header(chart) -> None:
    ingress = one(render(chart, ALL_OPTIONS), "Ingress")
    annotations = ingress["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_session_id"
    assert annotations["nginx.ingress.kubernetes.io/proxy-buffering"] == "off"  # SSE
    custom = one(render(chart, VARIANTS["cpu-existing-secret-new-pvcs"]), "Ingress")
    assert custom["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_user_session"
    backend = ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": one(render(chart, ALL_OPTIONS), "Service")["metadata"]["name"],
                       "port": {"number": 8000}}


def test_api_keys_from_a_created_secret_are_mounted_as_a_file(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    secret = one(docs, "Secret")
    keys = base64.b64decode(secret["data"]["api-keys"]).decode().split()
    assert keys == ALL_OPTIONS["apiKey"]["keys"]
    container = server_container(docs)
    (volume,) = [v for v in pod_spec(docs)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == secret["metadata"]["name"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert mount["readOnly"] is True
    assert env(container)["KVSERVE_API_KEY_FILE"] == f"{mount['mountPath']}/api-keys"
    assert "KVSERVE_API_KEY" not in env(container)  # never a plain env var
    annotations = one(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/api-keys" in annotations  # new keys roll the pods


def test_api_keys_from_an_existing_secret(chart) -> None:
    docs = render(chart, VARIANTS["cpu-existing-secret-new-pvcs"])
    assert not [d for d in docs if d["kind"] == "Secret"]
    (volume,) = [v for v in pod_spec(docs)["volumes"] if "secret" in v]
    assert volume["secret"]["secretName"] == "my-keys"
    assert volume["secret"]["items"] == [{"key": "keys.txt", "path": "keys.txt"}]
    assert env(server_container(docs))["KVSERVE_API_KEY_FILE"] == "/etc/kvserve/secrets/keys.txt"


def test_no_api_key_no_secret(chart) -> None:
    docs = render(chart)
    assert "KVSERVE_API_KEY_FILE" not in env(server_container(docs))
    assert not [v for v in pod_spec(docs)["volumes"] if "secret" in v]
    with pytest.raises(helm.HelmError, match="apiKey"):
        render(chart, {"apiKey": {"enabled": True}})


def test_hpa_owns_replicas_and_scales_the_deployment(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    assert "replicas" not in one(docs, "Deployment")["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == one(docs, "Deployment")["metadata"]["name"]
    assert one(render(chart), "Deployment")["spec"]["replicas"] == 1


def test_service_monitor_scrapes_the_metrics_port(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    (endpoint,) = one(docs, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert "metrics" in [p["name"] for p in one(docs, "Service")["spec"]["ports"]]
    no_auth = render(chart, VARIANTS["no-auth-metrics-on-api-port"])
    (endpoint,) = one(no_auth, "ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == "http"
    assert [p["name"] for p in one(no_auth, "Service")["spec"]["ports"]] == ["http"]
    assert "KVSERVE_METRICS_PORT" not in env(server_container(no_auth))
    # API key on, no separate metrics port: /metrics would need the key, so refuse.
    with pytest.raises(helm.HelmError, match="metricsPort"):
        render(chart, {"serviceMonitor": {"enabled": True}, "kvserve": {"metricsPort": None},
                       "apiKey": {"enabled": True, "keys": ["k"]}})


def test_network_policy_and_pdb_select_the_pods(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    labels = one(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    for kind, selector in (("NetworkPolicy", lambda d: d["spec"]["podSelector"]),
                           ("PodDisruptionBudget", lambda d: d["spec"]["selector"])):
        assert selector(one(docs, kind))["matchLabels"].items() <= labels.items()
    policy = one(docs, "NetworkPolicy")
    assert {p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]} == {"http", "metrics"}


def test_pvcs(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    claims = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PersistentVolumeClaim"}
    assert sorted(claims) == ["demo-kvserve-cache", "demo-kvserve-kv-sessions"]  # models: existingClaim
    claim = claims["demo-kvserve-cache"]
    assert claim["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["cache"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert volumes["models"]["persistentVolumeClaim"] == {"claimName": "shared-models", "readOnly": True}
    both = render(chart, VARIANTS["cpu-existing-secret-new-pvcs"])
    assert len([d for d in both if d["kind"] == "PersistentVolumeClaim"]) == 2


def kv_disk_volume(docs) -> dict[str, Any]:
    """The volume mounted (writable) at KVSERVE_KV_DISK_DIR."""
    container = server_container(docs)
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == env(container)["KVSERVE_KV_DISK_DIR"]]
    assert not mount.get("readOnly")
    (volume,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == mount["name"]]
    return volume


def test_kv_tiers_off_by_default(chart) -> None:
    docs = render(chart)
    assert not {n for n in env(server_container(docs)) if n.startswith("KVSERVE_KV_")}
    assert "kv-sessions" not in {v["name"] for v in pod_spec(docs)["volumes"]}
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 10 + 30 + 15


def test_kv_disk_tier_on_a_created_claim(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    tiers = ALL_OPTIONS["kvTiers"]
    variables = env(server_container(docs))
    # Byte counts stay integers (Helm reads YAML numbers as floats: no 1.7e+10 here).
    assert variables["KVSERVE_KV_HOST_BYTES"] == str(tiers["hostBytes"]) == "17179869184"
    assert variables["KVSERVE_KV_DISK_DIR"] == tiers["disk"]["mountPath"]
    assert variables["KVSERVE_KV_DISK_BYTES"] == str(tiers["disk"]["bytes"])
    assert float(variables["KVSERVE_KV_PERSIST_INTERVAL_S"]) == tiers["disk"]["persistIntervalSeconds"]
    claim_name = kv_disk_volume(docs)["persistentVolumeClaim"]["claimName"]
    (claim,) = [d for d in docs if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == claim_name]
    assert claim["spec"] == {"accessModes": ["ReadWriteMany"], "storageClassName": "fast-ssd",
                             "resources": {"requests": {"storage": "400Gi"}}}
    # Session files are a disposable cache: the claim goes with the release.
    assert "helm.sh/resource-policy" not in claim["metadata"].get("annotations", {})

    defaults = render(chart, {"kvTiers": {"disk": {"enabled": True}}})
    variables = env(server_container(defaults))
    assert variables["KVSERVE_KV_DISK_DIR"] == "/var/lib/kvserve/kv"
    assert variables["KVSERVE_KV_PERSIST_INTERVAL_S"] == "60"
    assert "KVSERVE_KV_DISK_BYTES" not in variables  # half the volume's free space
    assert "KVSERVE_KV_HOST_BYTES" not in variables  # hostBytes: 0
    (claim,) = [d for d in defaults if d["kind"] == "PersistentVolumeClaim"]
    assert kv_disk_volume(defaults)["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"] == {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "50Gi"}}}


def test_kv_disk_tier_on_an_existing_claim_or_an_empty_dir(chart) -> None:
    existing = render(chart, {"kvTiers": {"disk": {"enabled": True, "persistence": {"existingClaim": "kv-rwx"}}}})
    assert not [d for d in existing if d["kind"] == "PersistentVolumeClaim"]
    assert kv_disk_volume(existing) == {"name": "kv-sessions", "persistentVolumeClaim": {"claimName": "kv-rwx"}}
    docs = render(chart, VARIANTS["kv-tiers-emptydir"])
    assert not [d for d in docs if d["kind"] == "PersistentVolumeClaim"]
    assert kv_disk_volume(docs)["emptyDir"] == {"sizeLimit": "20Gi"}
    variables = env(server_container(docs))
    assert (variables["KVSERVE_KV_DISK_DIR"], variables["KVSERVE_KV_DISK_BYTES"]) == ("/kv", str(10 * 2**30))
    assert variables["KVSERVE_KV_PERSIST_INTERVAL_S"] == "2.5"
    # Persisting gets max(5, grace) s after the drain: 10 + 2 + 5 + 15.
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 32
    # Without a byte bound the server would take half the node's free space, past sizeLimit.
    with pytest.raises(helm.HelmError, match="kvTiers.disk.bytes"):
        render(chart, {"kvTiers": {"disk": {"enabled": True, "persistence": {"enabled": False}}}})
    unbounded = render(chart, {"kvTiers": {"disk": {"enabled": True, "persistence": {"enabled": False},
                                                    "emptyDir": {"sizeLimit": None}}}})
    assert kv_disk_volume(unbounded) == {"name": "kv-sessions", "emptyDir": {}}


def test_notes_warn_when_replicas_would_share_a_read_write_once_kv_claim(chart) -> None:
    def notes(values: dict[str, Any]) -> str:
        rendered = chart.render(values, name="demo", namespace="llm", is_install=True)
        (text,) = [t for path, t in rendered.items() if path.endswith("NOTES.txt")]
        return text

    disk = {"kvTiers": {"disk": {"enabled": True}}}
    assert "ReadWriteOnce claim for several replicas" in notes(disk | {"replicaCount": 2})
    assert "ReadWriteOnce claim" in notes(disk | {"autoscaling": {"enabled": True}})
    assert "WARNING" not in notes(disk)  # one replica
    assert "WARNING" not in notes(ALL_OPTIONS)  # ReadWriteMany


@pytest.mark.parametrize("bad", [
    {"no_such_option": 1},
    {"gpu": {"enabled": True, "count": 0}},
    {"kvserve": {"dtype": "fp8", "shutdownGraceSeconds": 30}},
    {"kvserve": {"kvCacheDtype": "fp4", "shutdownGraceSeconds": 30}},
    {"kvserve": {"gpuMemoryUtilization": 1.5, "shutdownGraceSeconds": 30}},
    {"kvserve": {"kvBudgetBytes": "8Gi", "shutdownGraceSeconds": 30}},
    {"kvserve": {"deterministic": "yes", "shutdownGraceSeconds": 30}},
    {"probes": {"liveness": {"path": "health"}}},
    {"ingress": {"sessionHeader": "X Session"}},
    {"kvTiers": {"hostBytes": "16Gi"}},
    {"kvTiers": {"hostBytes": -1}},
    {"kvTiers": {"swap": True}},
    {"kvTiers": {"disk": {"enabled": "yes"}}},
    {"kvTiers": {"disk": {"enabled": True, "bytes": "50Gi"}}},
    {"kvTiers": {"disk": {"enabled": True, "persistIntervalSeconds": 0}}},
    {"kvTiers": {"disk": {"enabled": True, "mountPath": "kv"}}},
    {"kvTiers": {"disk": {"enabled": True, "persistence": {"enabled": True, "accessModes": ["ReadOnlyMany"]}}}},
    {"lora": {"adapters": [{"name": "sql"}]}},
    {"lora": {"adapters": [{"name": "a,b", "path": "a"}]}},  # KVSERVE_LORA is comma-separated
    {"lora": {"adapters": [{"name": "org/sql", "path": "a"}]}},
    {"lora": {"adapters": [{"name": "sql", "path": "/elsewhere/sql"}]}},  # under mountPath only
    {"lora": {"adapters": [{"name": "sql", "path": "a", "rank": 8}]}},
    {"lora": {"enableLoading": "yes"}},
    {"lora": {"mountPath": "adapters"}},
    {"lora": {"maxLoras": 0}},
    {"lora": {"maxRank": 1024}},
    {"lora": {"volume": "lora-pvc"}},
])
def test_schema_rejects_bad_values(chart, bad: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="schema"):
        render(chart, bad)


def test_ci_values_pass_the_schema(chart) -> None:
    for values in VARIANTS.values():
        chart.validate_schema(chart.merge_values(values))


def test_seed_init_container_copies_missing_files_only(chart, tmp_path: Path) -> None:
    (seed,) = pod_spec(render(chart))["initContainers"]
    assert seed["command"][:2] == ["python", "-c"]
    source, target = tmp_path / "baked", tmp_path / "volume"
    (source / "converted/model-abc").mkdir(parents=True)
    (source / "converted/model-abc/config.json").write_text("{}")
    (source / "converted/model-abc/model.safetensors").write_text("weights")
    (target / "converted/model-abc").mkdir(parents=True)
    (target / "converted/model-abc/config.json").write_text("kept")
    subprocess.run([sys.executable, "-c", seed["command"][2], str(source), str(target)],
                   check=True, timeout=30)
    assert (target / "converted/model-abc/config.json").read_text() == "kept"
    assert (target / "converted/model-abc/model.safetensors").read_text() == "weights"
    assert sorted(p.name for p in (target / "converted/model-abc").iterdir()) == [
        "config.json", "model.safetensors"]


def test_kv_memory_settings_render_as_env(chart) -> None:
    default = env(server_container(render(chart)))
    assert default["KVSERVE_GPU_MEMORY_UTILIZATION"] == "0.9"
    assert not {"KVSERVE_KV_CACHE_DTYPE", "KVSERVE_KV_BUDGET_BYTES", "KVSERVE_MAX_MODEL_LEN"} & set(default)  # the server's defaults
    recipe = server_container(render(chart, VARIANTS["qwen2.5-coder-32b-h100"]))
    values = env(recipe)
    assert (values["KVSERVE_KV_CACHE_DTYPE"], values["KVSERVE_MAX_MODEL_LEN"], values["KVSERVE_MAX_RUNNING"]) == ("fp8", "32768", "8")
    assert values["KVSERVE_MODEL"] == "Qwen/Qwen2.5-Coder-32B-Instruct" and recipe["resources"]["limits"]["nvidia.com/gpu"] == 1
    # every value the chart renders is one the server accepts
    Settings(**{k.removeprefix("KVSERVE_").lower(): v for k, v in values.items()
                if k.startswith("KVSERVE_") and k not in ("KVSERVE_API_KEY_FILE",)})
    assert env(server_container(render(chart, ALL_OPTIONS)))["KVSERVE_KV_BUDGET_BYTES"] == "8589934592"


def test_exact_mode_renders_as_env(chart) -> None:
    """`kvserve.deterministic` turns on exact mode; off, the server's default stays unset."""
    assert "KVSERVE_DETERMINISTIC" not in env(server_container(render(chart)))
    values = env(server_container(render(chart, ALL_OPTIONS)))
    assert values["KVSERVE_DETERMINISTIC"] == "true"
    assert Settings(deterministic=values["KVSERVE_DETERMINISTIC"]).deterministic is True


def test_the_media_allow_list_renders_as_env(chart) -> None:
    """`kvserve.allowedMediaDomains` lets the server fetch images from those hosts; empty, none."""
    assert "KVSERVE_ALLOWED_MEDIA_DOMAINS" not in env(server_container(render(chart)))
    values = env(server_container(render(chart, {"kvserve": {"allowedMediaDomains": ["images.example.com", "*.cdn.example.org"],
                                                              "shutdownGraceSeconds": 30}})))
    assert values["KVSERVE_ALLOWED_MEDIA_DOMAINS"] == "images.example.com,*.cdn.example.org"
    assert Settings(allowed_media_domains=values["KVSERVE_ALLOWED_MEDIA_DOMAINS"]).allowed_media_domains == [
        "images.example.com", "*.cdn.example.org"]


LORA_VOLUME = {"persistentVolumeClaim": {"claimName": "lora-adapters", "readOnly": True}}


def test_lora_off_by_default(chart) -> None:
    for docs in (render(chart), render(chart, {"lora": {"maxLoras": 4, "volume": LORA_VOLUME}})):
        assert not [n for n in env(server_container(docs)) if "LORA" in n]
        assert "lora-adapters" not in {v["name"] for v in pod_spec(docs)["volumes"]}


def test_lora_adapters_from_a_volume(chart) -> None:
    docs = render(chart, ALL_OPTIONS)
    container, lora = server_container(docs), ALL_OPTIONS["lora"]
    variables = env(container)
    assert variables["KVSERVE_LORA"] == "sql=/adapters/sql-v1,support=/adapters/support/v3"
    assert (variables["KVSERVE_ENABLE_LORA_LOADING"], variables["KVSERVE_LORA_DIR"]) == ("true", "/adapters")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == lora["mountPath"]]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == mount["name"]]
    assert volume == {"name": mount["name"], **lora["volume"]}
    # what the server makes of them: the same adapters and limits
    settings = Settings(lora=variables["KVSERVE_LORA"], max_loras=variables["KVSERVE_MAX_LORAS"],
                        max_cpu_loras=variables["KVSERVE_MAX_CPU_LORAS"], max_lora_rank=variables["KVSERVE_MAX_LORA_RANK"])
    assert settings.lora_adapters() == [(a["name"], f"/adapters/{a['path']}") for a in lora["adapters"]]
    assert (settings.max_loras, settings.lora_capacity, settings.max_lora_rank) == (4, 16, 32)
    # the recipe: only what it sets, the server's defaults otherwise
    recipe = env(server_container(render(chart, VARIANTS["lora-adapters"])))
    assert recipe["KVSERVE_LORA"] == "sql=/adapters/sql-v1,support=/adapters/support-v3"
    without_limits = env(server_container(render(chart, {"lora": {"enableLoading": True, "volume": LORA_VOLUME}})))
    assert {n for n in without_limits if "LORA" in n} == {"KVSERVE_ENABLE_LORA_LOADING", "KVSERVE_LORA_DIR"}
    # maxCpuLoras unset follows maxLoras up, as the server's default does
    assert env(server_container(render(chart, {"lora": {"enableLoading": True, "volume": LORA_VOLUME, "maxLoras": 40}})))["KVSERVE_MAX_LORAS"] == "40"


def test_lora_adapters_on_the_models_volume(chart) -> None:
    docs = render(chart, {"lora": {"adapters": [{"name": "sql", "path": "sql-v1"}], "mountPath": "/data/models/adapters"}})
    assert env(server_container(docs))["KVSERVE_LORA"] == "sql=/data/models/adapters/sql-v1"
    assert "lora-adapters" not in {v["name"] for v in pod_spec(docs)["volumes"]}  # the models volume holds them
    with pytest.raises(helm.HelmError, match="must lie under models.mountPath"):
        render(chart, {"lora": {"adapters": [{"name": "sql", "path": "sql-v1"}]}})  # /adapters: no volume


@pytest.mark.parametrize("lora, match", [
    ({"adapters": [{"name": "sql", "path": "a"}, {"name": "sql", "path": "b"}]}, "given twice"),
    ({"adapters": [{"name": "sql", "path": "a/../../etc"}]}, "leaves lora.mountPath"),
    ({"enableLoading": True, "maxLoras": 8, "maxCpuLoras": 4}, r"maxCpuLoras \(4\) is below lora.maxLoras \(8\)"),
    ({"adapters": [{"name": f"a{i}", "path": f"a{i}"} for i in range(3)], "maxLoras": 1, "maxCpuLoras": 2}, "more than lora.maxCpuLoras"),
])
def test_lora_values_the_server_would_refuse_are_refused_at_render(chart, lora, match) -> None:
    with pytest.raises(helm.HelmError, match=match):
        render(chart, {"lora": {"volume": LORA_VOLUME} | lora})


def test_lora_is_refused_behind_the_router(chart) -> None:
    """SMG 1.13 knows each replica by its base model: an adapter's name is a 404 there, and
    its --model-alias would send the request to the base model without the adapter."""
    with pytest.raises(helm.HelmError, match="router.enabled"):
        render(chart, {"router": {"enabled": True}, "lora": {"enableLoading": True, "volume": LORA_VOLUME}})


def test_tensor_parallel_on_one_node_asks_for_its_gpus_and_shared_memory(chart) -> None:
    docs = render(chart, {"tensorParallel": {"size": 4}})
    container = server_container(docs)
    variables = env(container)
    assert variables["KVSERVE_TENSOR_PARALLEL_SIZE"] == "4" and "KVSERVE_NNODES" not in variables
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    (shm,) = [v for v in pod_spec(docs)["volumes"] if v["name"] == "dshm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert "dshm" not in [v["name"] for v in pod_spec(render(chart))["volumes"]]


def test_tensor_parallel_over_nodes_is_a_leader_worker_set(chart) -> None:
    """Each replica a LeaderWorkerSet group: the leader serves HTTP (the Service selects it
    alone), the workers join it at LWS's leader address with their index as node rank; every
    pod template validates as a Kubernetes PodTemplate."""
    values = {"tensorParallel": {"size": 8, "nodes": 2}, "replicaCount": 3}
    report = helm.lint(CHART, values, strict=True, namespace="llm")
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == [], report
    docs = render(chart, values)
    assert "Deployment" not in [d["kind"] for d in docs]
    lws = one(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 3
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    for role in ("leaderTemplate", "workerTemplate"):
        template = group[role]
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": template},
                                         version, strict=True)
        (container,) = [c for c in template["spec"]["containers"] if c["name"] == "kvserve"]
        variables = env(container)
        assert (variables["KVSERVE_TENSOR_PARALLEL_SIZE"], variables["KVSERVE_NNODES"], variables["KVSERVE_MASTER_PORT"]) == ("8", "2", "29500")
        assert container["args"] == ["serve", "--master-addr", "$(LWS_LEADER_ADDRESS)", "--node-rank", "$(LWS_WORKER_INDEX)"]
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
        assert ("readinessProbe" in container) == (role == "leaderTemplate")
        assert set(variables) - {"POD_NAME"} <= SETTINGS_ENV | {"HF_HOME", "HOME"}
    service = one(docs, "Service")
    assert service["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"
    with pytest.raises(Exception, match="not a multiple of tensorParallel.nodes"):
        render(chart, {"tensorParallel": {"size": 3, "nodes": 2}})
    with pytest.raises(Exception, match="autoscaling and router"):
        render(chart, {"tensorParallel": {"size": 4, "nodes": 2}, "router": {"enabled": True}})
