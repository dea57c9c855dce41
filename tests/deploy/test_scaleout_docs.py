"""The scale-out examples in docs/scale-out/: every Kubernetes object validates offline.

Standard objects go through `kubernetes-validate` (strict), like the Helm chart. It has no
schemas for CRDs, so the InferencePool and the InferenceModelRewrite are validated against the
openAPIV3Schema of their CRDs vendored in docs/scale-out/crd/ (the extension's v1.5.0 release);
the EndpointPickerConfig and the HTTPRoute are checked against their documented structure.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from server.settings import adapter_name_problem
from tests.deploy.helm_chart import KUBE_VERSIONS, render

DOCS = Path(__file__).resolve().parents[2] / "docs/scale-out"
CRD = yaml.safe_load((DOCS / "crd/inference.networking.k8s.io_inferencepools.yaml").read_text())
REWRITE_CRD = yaml.safe_load((DOCS / "crd/inference.networking.x-k8s.io_inferencemodelrewrites.yaml").read_text())
KVSERVE_GAUGES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                  "vllm:lora_requests_info")

# EndpointPickerConfig (inference.networking.x-k8s.io/v1alpha1), as the extension documents it:
# named plugin instances, and scheduling profiles that refer to them.
EPP_CONFIG_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "plugins", "schedulingProfiles"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "inference.networking.x-k8s.io/v1alpha1"},
        "kind": {"const": "EndpointPickerConfig"},
        "plugins": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["type"], "additionalProperties": False,
            "properties": {"type": {"type": "string"}, "name": {"type": "string"},
                           "parameters": {"type": "object"}}}},
        "schedulingProfiles": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["name", "plugins"], "additionalProperties": False,
            "properties": {"name": {"type": "string"}, "plugins": {"type": "array", "items": {
                "type": "object", "required": ["pluginRef"], "additionalProperties": False,
                "properties": {"pluginRef": {"type": "string"}, "weight": {"type": "number"}}}}}}},
    },
}


def objects(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DOCS / name).read_text()) if d]


def crd_schema(version: str, crd: dict[str, Any] = CRD) -> dict[str, Any]:
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    return served["schema"]["openAPIV3Schema"]


def validate_custom_resource(doc: dict[str, Any], crd: dict[str, Any]) -> None:
    group, version = doc["apiVersion"].split("/")
    assert (group, doc["kind"]) == (crd["spec"]["group"], crd["spec"]["names"]["kind"])
    # NOTE: the CRD's schema is OpenAPI v3 (structural); draft-04 semantics match it, and the
    # CEL rules (x-kubernetes-validations) are for the API server: not checked here.
    jsonschema.Draft4Validator(crd_schema(version, crd)).validate(doc)


def validate_inference_pool(pool: dict[str, Any]) -> None:
    validate_custom_resource(pool, CRD)


def test_standard_objects_validate() -> None:
    standard = [d for d in objects("inferencepool.yaml") if d["kind"] != "InferencePool"]
    assert sorted(d["kind"] for d in standard) == [
        "ConfigMap", "Deployment", "Role", "RoleBinding", "Service", "ServiceAccount"]
    for doc in standard:
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)


def test_inference_pool_validates_against_the_crd() -> None:
    (pool,) = [d for d in objects("inferencepool.yaml") if d["kind"] == "InferencePool"]
    validate_inference_pool(pool)
    bad = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 0}]}}
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_pool(bad)
    with pytest.raises(jsonschema.ValidationError):
        validate_inference_pool({**pool, "spec": {"selector": pool["spec"]["selector"]}})


def test_inference_pool_selects_the_chart_s_kvserve_pods(chart) -> None:
    """The pool's selector and port match what `helm install kvserve helm/kvserve` runs."""
    docs = {d["kind"]: d for d in objects("inferencepool.yaml")}
    pool = docs["InferencePool"]
    (deployment,) = [d for d in render(chart, name="kvserve") if d["kind"] == "Deployment"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (kvserve,) = deployment["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in kvserve["ports"]}
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    # The EPP it names: the Service's port, and the Deployment's --pool-name.
    picker = pool["spec"]["endpointPickerRef"]
    assert docs["Service"]["metadata"]["name"] == picker["name"]
    assert picker["port"]["number"] in [p["port"] for p in docs["Service"]["spec"]["ports"]]
    (epp,) = docs["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert f"--pool-name={pool['metadata']['name']}" in epp["args"]
    assert f"--pool-namespace={pool['metadata']['namespace']}" in epp["args"]
    # kvserve exports the EPP's default gauge names, so no metric flags (deprecated) are set.
    assert not [a for a in epp["args"] if "-metric=" in a]
    assert all(gauge in (DOCS / "README.md").read_text() for gauge in KVSERVE_GAUGES)


def test_endpoint_picker_config() -> None:
    (config_map,) = [d for d in objects("inferencepool.yaml") if d["kind"] == "ConfigMap"]
    config = yaml.safe_load(config_map["data"]["config.yaml"])
    jsonschema.Draft7Validator(EPP_CONFIG_SCHEMA).validate(config)
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    refs = [r["pluginRef"] for profile in config["schedulingProfiles"] for r in profile["plugins"]]
    assert set(refs) <= names
    assert "prefix-cache-scorer" in refs and "max-score-picker" in refs
    assert "lora-affinity-scorer" in refs  # reads vllm:lora_requests_info
    (deployment,) = [d for d in objects("inferencepool.yaml") if d["kind"] == "Deployment"]
    spec = deployment["spec"]["template"]["spec"]
    (volume,) = spec["volumes"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    (mount,) = spec["containers"][0]["volumeMounts"]
    assert f"--config-file={mount['mountPath']}/config.yaml" in spec["containers"][0]["args"]


def test_http_route_sends_the_api_to_the_pool() -> None:
    (route,) = objects("httproute.yaml")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1" and route["kind"] == "HTTPRoute"
    (pool,) = [d for d in objects("inferencepool.yaml") if d["kind"] == "InferencePool"]
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert backend == {"group": "inference.networking.k8s.io", "kind": "InferencePool",
                       "name": pool["metadata"]["name"]}
    assert route["metadata"]["namespace"] == pool["metadata"]["namespace"]
    assert rule["matches"][0]["path"] == {"type": "PathPrefix", "value": "/v1"}


def test_model_rewrite_validates_and_targets_adapters_the_chart_serves(chart) -> None:
    """lora.yaml's InferenceModelRewrite against its CRD; its pool is inferencepool.yaml's, the
    EPP may read it, and every name it rewrites to is an adapter name the chart and the server
    accept (rendered as the release its comment shows)."""
    (rewrite,) = objects("lora.yaml")
    validate_custom_resource(rewrite, REWRITE_CRD)
    with pytest.raises(jsonschema.ValidationError):  # a target without its name
        validate_custom_resource({**rewrite, "spec": {**rewrite["spec"], "rules": [{"targets": [{"weight": 1}]}]}}, REWRITE_CRD)
    (pool,) = [d for d in objects("inferencepool.yaml") if d["kind"] == "InferencePool"]
    assert rewrite["spec"]["poolRef"] == {"group": "inference.networking.k8s.io", "name": pool["metadata"]["name"]}
    assert rewrite["metadata"]["namespace"] == pool["metadata"]["namespace"]
    (role,) = [d for d in objects("inferencepool.yaml") if d["kind"] == "Role"]
    assert any("inferencemodelrewrites" in rule["resources"] and rule["apiGroups"] == [REWRITE_CRD["spec"]["group"]]
               for rule in role["rules"])
    targets = [t["modelRewrite"] for rule in rewrite["spec"]["rules"] for t in rule["targets"]]
    assert targets and not [t for t in targets if adapter_name_problem(t)]
    adapters = [{"name": t, "path": t} for t in targets]
    (deployment,) = [d for d in render(chart, {"lora": {"adapters": adapters, "volume": {"persistentVolumeClaim": {
        "claimName": "lora-adapters", "readOnly": True}}}}, name="kvserve") if d["kind"] == "Deployment"]
    (kvserve,) = deployment["spec"]["template"]["spec"]["containers"]
    served = {e["name"]: e.get("value") for e in kvserve["env"]}["KVSERVE_LORA"]
    assert [entry.partition("=")[0] for entry in served.split(",")] == targets
