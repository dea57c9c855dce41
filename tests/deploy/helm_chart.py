"""The Helm chart as the deploy tests render it: real Helm (the Go SDK inside
`helm-python-sdk`, no cluster), release `demo` in namespace `llm` unless a test names another.
The `chart` fixture (conftest.py) loads it once per test module."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from kubernetes_validate.utils import latest_version

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm/kvserve"
ALL_OPTIONS = yaml.safe_load((CHART / "ci/all-options-values.yaml").read_text())
KUBE_VERSIONS = ["1.27.0", latest_version()]  # Chart.yaml: kubeVersion >=1.27


def render(chart, values: dict[str, Any] | None = None, *, name: str = "demo") -> list[dict[str, Any]]:
    """Every object `helm template` renders, in file order."""
    rendered = chart.render(values or {}, name=name, namespace="llm", is_install=True)
    docs = []
    for path, text in sorted(rendered.items()):
        if path.endswith(".yaml"):
            docs += [d for d in yaml.safe_load_all(text) if d]
    return docs
