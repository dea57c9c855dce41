"""How an embedding model turns its hidden states into one vector, read from the checkpoint's own
configuration (plain data, no torch): a sentence-transformers checkpoint's `modules.json`, its
pooling module's `config.json` and whether a `Normalize` module follows; else the default of the
model's kind (`default_spec`).

NOTE: only the modules kvserve computes exactly as sentence-transformers does are accepted (the
transformer, Pooling, Normalize); any other (Dense, LayerNorm, a custom module) is refused at
start-up by name rather than served as a different vector.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# sentence-transformers' older pooling config: one boolean per mode (in its concatenation order)
LEGACY_MODE_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
SERVED_MODULES = ("Transformer", "Pooling", "Normalize")


class PoolingConfigError(ValueError):
    """The checkpoint's pooling configuration names something kvserve does not compute."""


@dataclass(frozen=True, slots=True)
class PoolingSpec:
    """Pooling modes (their vectors concatenated in this order), then an L2 normalization or not."""

    modes: tuple[str, ...]
    normalize: bool
    source: str  # where it was read from, for the log: "modules.json" or the default's reason

    def __post_init__(self) -> None:
        bad = [m for m in self.modes if m not in POOLING_MODES]
        if not self.modes or bad:
            raise PoolingConfigError(f"pooling modes {list(self.modes)}: expected one or more of {', '.join(POOLING_MODES)}")

    def describe(self) -> str:
        return f"{'+'.join(self.modes)} pooling{', L2-normalized' if self.normalize else ''} ({self.source})"


def modes_of(config: dict) -> tuple[str, ...]:
    """The modes of a sentence-transformers Pooling config, new (`pooling_mode`) or legacy keys."""
    mode = config.get("pooling_mode")
    if mode is not None:
        return (mode,) if isinstance(mode, str) else tuple(mode)
    return tuple(m for key, m in LEGACY_MODE_KEYS.items() if config.get(key)) or ("mean",)


def read_modules(read: Callable[[str], str | None]) -> PoolingSpec | None:
    """The spec of a sentence-transformers checkpoint; None when it has no `modules.json`.
    `read(relative path)` gives a file's text from the checkpoint (None: no such file)."""
    text = read("modules.json")
    if text is None:
        return None
    modes: tuple[str, ...] = ()
    normalize = False
    for module in json.loads(text):
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in SERVED_MODULES:
            raise PoolingConfigError(f"modules.json: the module {module.get('name', '?')!r} ({module.get('type')}) is not one "
                                     f"kvserve computes (it serves {', '.join(SERVED_MODULES)})")
        if normalize:
            raise PoolingConfigError(f"modules.json: the module {module.get('type')} after Normalize is not one kvserve computes")
        if kind == "Pooling":
            path = str(Path(module.get("path") or "") / "config.json")
            config = read(path)
            if config is None:
                raise PoolingConfigError(f"modules.json names a Pooling module without {path}")
            modes = modes_of(json.loads(config))
        elif kind == "Normalize":
            normalize = True
    if not modes:
        raise PoolingConfigError("modules.json has no Pooling module: the token vectors would not become one vector")
    return PoolingSpec(modes, normalize, "modules.json")


def default_spec(is_decoder: bool) -> PoolingSpec:
    """Without a sentence-transformers configuration: a decoder embeds as Qwen3-Embedding does
    (its last token, normalized); an encoder by the mean of its tokens, as sentence-transformers
    builds one by default."""
    if is_decoder:
        return PoolingSpec(("lasttoken",), True, "a decoder without modules.json: last token, as Qwen3-Embedding")
    return PoolingSpec(("mean",), False, "an encoder without modules.json: mean, as sentence-transformers' default")
