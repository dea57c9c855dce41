"""Fixtures of the deploy tests."""

import helm_python as helm
import pytest

from tests.deploy.helm_chart import CHART


@pytest.fixture(scope="module")
def chart():
    """The loaded chart (tests/deploy/helm_chart.py renders it)."""
    with helm.Chart.load(CHART) as loaded:
        yield loaded
