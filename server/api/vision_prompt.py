"""A chat turn with images, as the engine takes it: the images read (server/api/media.py), the
conversation rendered by the chat template with an image part where each was, the model's
processor expanding each into its placeholder tokens (one run, or one per tile), and each
picture's placeholders keyed by its content (server/engine/vision.py): token ids whose reuse
compares pictures, and the spans the encoder computes their features from.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from transformers import ProcessorMixin

from server.api import media
from server.api.errors import APIError
from server.api.protocol import ImagePart
from server.engine.vision import ImageSpan, key_ids


@dataclass
class Vision:
    """What a vision-language model's serving context holds for its images."""

    processor: ProcessorMixin  # the model's AutoProcessor
    placeholder: int  # the token id of an image's placeholder run (server/engine/vision.image_token_id)
    limits: media.MediaLimits = field(default_factory=media.MediaLimits)
    fetcher: media.Fetcher | None = None  # with limits.allowed_domains: remote images fetched through it
    settings: str = ""  # the image processor's settings, part of every picture's digest
    # a picture's span (runs, digest, encoder inputs) as the model takes it: its rope grid where
    # positions are 3-D, whether it attends to itself whole (server/engine/vision.Encoder.span)
    span: Callable[[tuple[tuple[int, int], ...], str, Mapping[str, torch.Tensor]], ImageSpan] = ImageSpan

    def __post_init__(self) -> None:
        if not self.settings:
            image_processor = getattr(self.processor, "image_processor", None)
            settings = image_processor.to_dict() if image_processor is not None else {}
            self.settings = json.dumps(settings, sort_keys=True, default=str)
        if self.fetcher is None and self.limits.allowed_domains:
            self.fetcher = media.Fetcher(self.limits)


def refuse_images(model_id: str, images: list[ImagePart]) -> None:
    """An image sent to a model that takes none: a 400 naming the first."""
    if images:
        raise APIError(400, f"the model {model_id!r} takes no images here (a text-only model, or a vision-language family whose "
                       "images kvserve does not feed yet: docs/guides/images.md); send text parts only",
                       code="images_not_supported", param=images[0].where, rejection="bad_request")


async def read(vision: Vision, images: list[ImagePart]) -> list[media.Image]:
    """The request's images, read and checked (each failure a 400 naming its part)."""
    return await media.load([(p.where, p.image_url.url) for p in images], vision.limits, vision.fetcher)


def tokens(vision: Vision, text: str, images: list[media.Image], prompt_param: str) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """(prompt ids, the pictures' spans) of the rendered `text` holding one image marker per
    image: the processor expands each marker into the picture's placeholders (one run, or one
    per tile between the family's tile markers); each picture's positions get its key ids. Runs
    off the event loop (the processor is slow)."""
    processor = vision.processor
    encoded = processor(text=[text], images=[image.pixels for image in images], return_tensors="pt", add_special_tokens=False)
    ids = encoded["input_ids"][0].tolist()  # its length is checked where every prompt's is (resolve_max_tokens)
    runs = _runs(ids, vision.placeholder)
    spans = []
    for image in images:
        # the picture alone through the processor: its encoder inputs, and how many placeholders it takes
        alone = processor(text=[processor.image_token], images=[image.pixels], return_tensors="pt", add_special_tokens=False)
        count = sum(1 for token in alone["input_ids"][0].tolist() if token == vision.placeholder)
        mine = []
        while count > 0 and runs:
            start, length = runs.pop(0)
            mine.append((start, min(length, count)))
            if length > count:  # two pictures' placeholders side by side
                runs.insert(0, (start + count, length - count))
            count -= mine[-1][1]
        if count or not mine:
            break
        inputs = {k: v for k, v in alone.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")}
        digest = hashlib.sha256(f"{image.digest}\n{vision.settings}".encode()).hexdigest()
        spans.append(vision.span(tuple(mine), digest, inputs))
    if len(spans) != len(images) or runs:
        raise APIError(400, f"the chat template placed the request's {len(images)} images otherwise than the model's processor "
                       "expands them; images are taken where the model's template renders them", code="invalid_value",
                       param=prompt_param, rejection="bad_request")
    for span in spans:
        keys = iter(key_ids(span.digest, span.length))
        for start, length in span.runs:
            ids[start : start + length] = [next(keys) for _ in range(length)]
    return ids, tuple(spans)


def _runs(ids: list[int], placeholder: int) -> list[tuple[int, int]]:
    """(start, length) of each run of `placeholder` in `ids`."""
    runs: list[tuple[int, int]] = []
    for i, token in enumerate(ids):
        if token != placeholder:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


async def render(vision: Vision, text_of, images: list[ImagePart], prompt_param: str) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """`tokens` of the text `text_of()` renders (the chat template, run in the same thread)."""
    read_images = await read(vision, images)

    def run() -> tuple[list[int], tuple[ImageSpan, ...]]:
        return tokens(vision, text_of(), read_images, prompt_param)

    return await asyncio.to_thread(run)
