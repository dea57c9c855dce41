"""The refusal of a model the engine cannot serve, named by the feature it lacks.

A leaf module (no torch, nothing of the engine): the layer patches raise it mid-forward, the
families check raises it at load, and the CLI maps it to its exit status."""

from __future__ import annotations


class UnsupportedModel(ValueError):
    """The model has a feature the engine cannot model: `feature` names it (a short slug,
    e.g. "dynamic-rope"), the message says what it is."""

    def __init__(self, feature: str, message: str) -> None:
        super().__init__(f"kvserve cannot serve this model: {message} [{feature}]")
        self.feature = feature
