"""Images in requests: each content part's data: URL decoded (or its http(s) URL fetched, see
server/api/media_fetch.py), checked against `MediaLimits`, and decoded into one RGB `Image`.

The format is sniffed from the bytes (never taken from a declared type) and only PNG, JPEG, WEBP
and GIF are decoded. Width and height are read from the header and checked before any pixel is
decoded, so a small file that claims a gigapixel image costs nothing. Every refusal is a 400
`APIError` whose `param` is the content part's JSON path (`where`) and whose message names what
was wrong and the limit.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import io
import re
import threading
import warnings
from dataclasses import dataclass, field

import PIL.Image

from server.api.errors import APIError
from server.api.media_fetch import Fetcher, MediaLimits, format_bytes

__all__ = ["FORMATS", "MAX_SIDE", "Fetcher", "Image", "MediaLimits", "decode", "load", "parse_data_url"]

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
MAX_SIDE = 65_535  # the longest side JPEG and GIF can express; a longer one is no picture
_ALIASES = {"MPO": "JPEG"}  # a JPEG with extra frames (phone cameras), which Pillow opens as MPO
# Leading bytes, so that a 400 can say "BMP is not supported" or "a truncated PNG", not "no image".
_SIGNATURES = (
    (b"\x89PNG\r\n\x1a\n", "PNG"), (b"\xff\xd8\xff", "JPEG"), (b"GIF87a", "GIF"), (b"GIF89a", "GIF"),
    (b"BM", "BMP"), (b"II*\x00", "TIFF"), (b"MM\x00*", "TIFF"), (b"\x00\x00\x01\x00", "ICO"),
    (b"%PDF", "PDF"), (b"8BPS", "PSD"), (b"\xff\x0a", "JPEG XL"), (b"<svg", "SVG"), (b"<?xml", "SVG"),
)
# EXIF orientation -> the transpose that makes the picture upright (what a photo viewer shows).
_UPRIGHT = {
    2: PIL.Image.Transpose.FLIP_LEFT_RIGHT, 3: PIL.Image.Transpose.ROTATE_180,
    4: PIL.Image.Transpose.FLIP_TOP_BOTTOM, 5: PIL.Image.Transpose.TRANSPOSE,
    6: PIL.Image.Transpose.ROTATE_270, 7: PIL.Image.Transpose.TRANSVERSE, 8: PIL.Image.Transpose.ROTATE_90,
}
_ORIENTATION = 0x0112
_SCHEME = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*):")
# NOTE: warnings.catch_warnings swaps the process-wide filter list (Python 3.11); two decoding
# threads inside it at once could restore each other's copy and leave our filter installed for
# good, so one thread at a time opens a header under it (cheap: no pixels are decoded there).
# Meanwhile only DecompressionBombWarning is affected, for any thread: it becomes an error.
_WARNINGS_LOCK = threading.Lock()


@dataclass(frozen=True, slots=True)
class Image:
    """One decoded image: `pixels` fully loaded, RGB, upright; `digest` identifies the picture
    (sha256 over size and RGB pixels), whatever file format carried it."""

    pixels: PIL.Image.Image = field(compare=False, repr=False)
    digest: str
    format: str  # "PNG" | "JPEG" | "WEBP" | "GIF"
    nbytes: int  # encoded size

    @property
    def width(self) -> int:
        return self.pixels.width

    @property
    def height(self) -> int:
        return self.pixels.height


def _too_large(where: str, size: int, limits: MediaLimits) -> APIError:
    return APIError(400, f"the image at {where} is {format_bytes(size)}; the limit is "
                    f"{format_bytes(limits.max_image_bytes)} per image",
                    code="image_too_large", param=where, rejection="bad_request")


def parse_data_url(url: str, where: str, limits: MediaLimits) -> bytes:
    """The bytes of a `data:image/...;base64,...` URL. The media type must be image/* (the real
    format is sniffed later); the payload must be strict base64 (standard alphabet, padded, no
    whitespace); its length is checked against `max_image_bytes` before anything is decoded."""
    head, comma, payload = url.partition(",")
    if head[:5].lower() != "data:" or not comma:
        raise APIError(400, f"the image URL at {where} is not a data URL of the form data:image/png;base64,<data>",
                       code="invalid_image", param=where, rejection="bad_request")
    media_type, *params = head[5:].split(";")
    media_type = media_type.strip().lower()
    if not media_type.startswith("image/"):
        declared = repr(media_type[:60]) if media_type else "no media type"
        raise APIError(400, f"the data URL at {where} declares {declared}; an image part needs an image/* type, "
                       "e.g. data:image/png;base64,<data>", code="invalid_image", param=where, rejection="bad_request")
    if not params or params[-1].strip().lower() != "base64":
        raise APIError(400, f"the data URL at {where} is not base64-encoded; write data:{media_type[:60]};base64,<data>",
                       code="invalid_image", param=where, rejection="bad_request")
    if len(payload) > 4 * -(-limits.max_image_bytes // 3):
        raise _too_large(where, len(payload) * 3 // 4, limits)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"the data URL at {where} is not valid base64 (the standard alphabet A-Z a-z 0-9 + /, "
                       "padded with =, without spaces or line breaks)",
                       code="invalid_image", param=where, rejection="bad_request") from None
    if len(data) > limits.max_image_bytes:
        raise _too_large(where, len(data), limits)
    return data


def decode(data: bytes, where: str, limits: MediaLimits) -> Image:
    """`data` decoded into an `Image` after every check: the byte cap, a supported format sniffed
    from the bytes, a size within `max_pixels` (from the header, before decoding) and sides
    within `MAX_SIDE`; corrupt or truncated data is refused. Animated images give their first
    frame; an EXIF orientation is applied; alpha is dropped (`.convert("RGB")`)."""
    if not data:
        raise APIError(400, f"the image at {where} is empty", code="invalid_image", param=where, rejection="bad_request")
    if len(data) > limits.max_image_bytes:
        raise _too_large(where, len(data), limits)
    opened = _open(data, where, limits)
    kind = _ALIASES.get(opened.format or "", opened.format or "")
    try:
        with opened:
            _check_size(opened.size, where, limits)
            opened.load()
            _check_size(opened.size, where, limits)  # NOTE: a GIF frame may extend past its screen
            rgb = opened.convert("RGB")
            method = _UPRIGHT.get(_orientation(opened))
    except APIError:
        raise
    except PIL.Image.DecompressionBombError as exc:
        raise _bomb(where, limits) from exc
    except Exception as exc:
        reason = f" ({str(exc)[:120]})" if str(exc) else ""
        raise APIError(400, f"the {kind} image at {where} is corrupt or truncated{reason}",
                       code="invalid_image", param=where, rejection="bad_request") from exc
    if method is not None:
        rgb = rgb.transpose(method)
    digest = hashlib.sha256(f"{rgb.width}x{rgb.height}\n".encode())
    digest.update(rgb.tobytes())
    return Image(rgb, digest.hexdigest(), kind, len(data))


def _open(data: bytes, where: str, limits: MediaLimits) -> PIL.Image.Image:
    """The lazily opened image (header read, no pixels decoded), refused unless PNG, JPEG, WEBP or
    GIF; Pillow's decompression-bomb warning and error become image_too_large."""
    try:
        with _WARNINGS_LOCK, warnings.catch_warnings():
            warnings.simplefilter("error", PIL.Image.DecompressionBombWarning)
            return PIL.Image.open(io.BytesIO(data), formats=FORMATS)
    except (PIL.Image.DecompressionBombError, PIL.Image.DecompressionBombWarning) as exc:
        raise _bomb(where, limits) from exc
    except Exception as exc:  # UnidentifiedImageError, and whatever a broken header raises
        kind = _sniff(data)
        if kind in FORMATS:
            raise APIError(400, f"the {kind} image at {where} is corrupt or truncated",
                           code="invalid_image", param=where, rejection="bad_request") from exc
        if kind is not None:
            raise APIError(400, f"the image at {where} is {kind}, which is not supported; send PNG, JPEG, WEBP or GIF",
                           code="invalid_image", param=where, rejection="bad_request") from exc
        raise APIError(400, f"the data at {where} is not an image in a supported format (PNG, JPEG, WEBP or GIF)",
                       code="invalid_image", param=where, rejection="bad_request") from exc


def _sniff(data: bytes) -> str | None:
    """The format `data` starts like, if one of `_SIGNATURES` (or WEBP, HEIF/AVIF); else None."""
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    if data[4:8] == b"ftyp":
        return "HEIF/AVIF"
    head = data[:32].lstrip()
    return next((kind for magic, kind in _SIGNATURES if head.startswith(magic)), None)


def _check_size(size: tuple[int, int], where: str, limits: MediaLimits) -> None:
    width, height = size
    if width < 1 or height < 1:
        raise APIError(400, f"the image at {where} has no pixels ({width}x{height})",
                       code="invalid_image", param=where, rejection="bad_request")
    if width * height > limits.max_pixels:
        raise APIError(400, f"the image at {where} is {width}x{height} = {width * height:,} pixels; the limit is "
                       f"{limits.max_pixels:,} pixels (width x height) per image",
                       code="image_too_large", param=where, rejection="bad_request")
    if max(width, height) > MAX_SIDE:
        raise APIError(400, f"the image at {where} is {width}x{height}; a side longer than {MAX_SIDE:,} pixels "
                       "is not accepted", code="invalid_image", param=where, rejection="bad_request")


def _bomb(where: str, limits: MediaLimits) -> APIError:
    """Pillow refused the size before we saw it: above its own limit (`Image.MAX_IMAGE_PIXELS`)."""
    pil_limit = PIL.Image.MAX_IMAGE_PIXELS
    if pil_limit is None or pil_limit >= limits.max_pixels:
        said = f"more than {limits.max_pixels:,} pixels"
    else:
        said = f"more than {pil_limit:,} pixels, Pillow's decompression-bomb limit"
    return APIError(400, f"the image at {where} declares {said}; the limit is {limits.max_pixels:,} pixels "
                    "(width x height) per image", code="image_too_large", param=where, rejection="bad_request")


def _orientation(image: PIL.Image.Image) -> int | None:
    # NOTE: a broken EXIF block does not make the picture unreadable; it is shown as stored.
    try:
        return image.getexif().get(_ORIENTATION)
    except Exception:
        return None


async def load(urls: list[tuple[str, str]], limits: MediaLimits, fetcher: Fetcher | None = None) -> list[Image]:
    """The images of one request's (where, url) pairs, in order. The count cap is checked first
    (too_many_images names the first part over it); then each part in turn: a data: URL is
    decoded, an http(s) URL fetched through `fetcher` (one for `limits` by default) only when
    `limits.allowed_domains` is set, the request's total bytes checked, the image decoded in a
    thread so that the event loop keeps serving. Parts are handled one at a time, so at most one
    image's bytes beyond the request's total are ever held."""
    if len(urls) > limits.max_images:
        where = urls[limits.max_images][0]
        raise APIError(400, f"the request has {len(urls)} images; the limit is {limits.max_images} per request "
                       f"({where} is the first over it)", code="too_many_images", param=where, rejection="bad_request")
    images: list[Image] = []
    total = 0
    for where, url in urls:
        match = _SCHEME.match(url)
        scheme = match.group(1).lower() if match else ""
        if scheme == "data":
            data = await asyncio.to_thread(parse_data_url, url, where, limits)
        elif scheme in ("http", "https"):
            if not limits.allowed_domains:
                raise APIError(400, f"the image at {where} is a remote URL, and this server fetches none: send it "
                               "inline as a data: URL, or start the server with --allowed-media-domains naming the "
                               "hosts it may fetch from", code="image_url_not_allowed", param=where, rejection="bad_request")
            fetcher = fetcher or Fetcher(limits)
            data = await fetcher.fetch(url, where)
        else:
            shown = f"the scheme {scheme[:20]}:" if scheme else "no scheme"
            raise APIError(400, f"the image URL at {where} has {shown}; only data: URLs (and http or https URLs "
                           "where the server allows them) are accepted",
                           code="image_url_not_allowed", param=where, rejection="bad_request")
        total += len(data)
        if total > limits.max_request_image_bytes:
            raise APIError(400, f"the images up to {where} add up to {format_bytes(total)}; the limit is "
                           f"{format_bytes(limits.max_request_image_bytes)} for all images of one request",
                           code="image_too_large", param=where, rejection="bad_request")
        images.append(await asyncio.to_thread(decode, data, where, limits))
    return images
