"""Images in requests (server/api/media.py): decoding, data URLs, the caps, and a fuzz test that
nothing but an Image or a 400 ever comes out. Fetching is tested in test_media_fetch.py.

Every image is built in-process with Pillow; the oversized ones are hand-made headers over a few
bytes of body, so no test decodes more than a few thousand pixels.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import struct
import time
import warnings
import zlib

import PIL.Image
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.api.errors import APIError
from server.api.media import Fetcher, Image, MediaLimits, decode, load, parse_data_url

WHERE = "messages[1].content[2]"
LIMITS = MediaLimits()


@contextlib.contextmanager
def refused(code: str, where: str = WHERE):
    """Asserts that the block raises the 400 a client should see: `code`, `param` == `where`."""
    with pytest.raises(APIError) as caught:
        yield caught
    error = caught.value
    got = (error.status, error.code, error.param, error.rejection)
    assert got == (400, code, where, "bad_request"), error.message


def picture(width: int = 7, height: int = 5, mode: str = "RGB") -> PIL.Image.Image:
    """A small image whose every pixel differs from its neighbours (few colours, so GIF is exact)."""
    image = PIL.Image.new(mode, (width, height))
    colours = [(255, 0, 0, 255), (0, 128, 255, 128), (20, 200, 40, 0), (250, 250, 10, 255)]
    image.putdata([colours[(x + 2 * y) % 4][: len(mode)] for y in range(height) for x in range(width)])
    return image


def encode(image: PIL.Image.Image, fmt: str, **options) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int, body: bytes = b"\x00" * 16) -> bytes:
    """A PNG whose header claims `width` x `height` over `body` (too short for that size)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(body)) + chunk(b"IEND", b"")


@pytest.mark.parametrize("field, value", [("max_image_bytes", 0), ("max_images", 0), ("max_pixels", -1),
                                          ("fetch_timeout_s", 0.0), ("max_redirects", -1), ("allowed_domains", "a.com")])
def test_limits_are_validated(field, value):
    with pytest.raises(ValueError, match=field):
        MediaLimits(**{field: value})


# Decoding ---------------------------------------------------------------------------------------

LOSSLESS = {
    "PNG": lambda: encode(picture(), "PNG"),
    "WEBP": lambda: encode(picture(), "WEBP", lossless=True),
    "GIF": lambda: encode(picture(), "GIF"),
    "PNG RGBA": lambda: encode(picture(mode="RGBA"), "PNG"),
    "PNG L": lambda: encode(picture().convert("L"), "PNG"),
}


@pytest.mark.parametrize("name", LOSSLESS)
def test_lossless_formats_decode_to_the_same_rgb_pixels(name):
    data = LOSSLESS[name]()
    image = decode(data, WHERE, LIMITS)
    source = PIL.Image.open(io.BytesIO(data)).convert("RGB")  # alpha dropped, as transformers' convert_rgb
    assert (image.format, image.width, image.height, image.pixels.mode) == (name.split()[0], 7, 5, "RGB")
    assert image.nbytes == len(data)
    assert image.pixels.tobytes() == source.tobytes()


def test_jpeg_decodes():
    image = decode(encode(PIL.Image.new("RGB", (16, 9), (250, 20, 20)), "JPEG", quality=95), WHERE, LIMITS)
    assert (image.format, image.width, image.height, image.pixels.mode) == ("JPEG", 16, 9, "RGB")
    red, green, blue = image.pixels.getpixel((8, 4))
    assert red > 230 and green < 40 and blue < 40  # give or take JPEG's loss


def test_animated_gif_gives_its_first_frame():
    frames = [PIL.Image.new("RGB", (6, 4), colour) for colour in ((255, 0, 0), (0, 0, 255), (0, 255, 0))]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    image = decode(out.getvalue(), WHERE, LIMITS)
    assert (image.format, image.width, image.height) == ("GIF", 6, 4)
    assert image.pixels.getcolors() == [(24, (255, 0, 0))]


def test_exif_orientation_makes_the_picture_upright():
    exif = PIL.Image.Exif()
    exif[0x0112] = 6  # stored sideways: turn 90 degrees clockwise to view
    image = decode(encode(picture(8, 4), "JPEG", exif=exif), WHERE, LIMITS)
    assert (image.width, image.height) == (4, 8)


def test_digest_identifies_the_picture_not_the_file():
    png = decode(encode(picture(), "PNG"), WHERE, LIMITS)
    webp = decode(encode(picture(), "WEBP", lossless=True), WHERE, LIMITS)
    assert png.digest == webp.digest and len(png.digest) == 64
    changed = picture()
    changed.putpixel((3, 2), (1, 2, 3))
    assert decode(encode(changed, "PNG"), WHERE, LIMITS).digest != png.digest
    # the same bytes of pixels in another shape are another picture
    wide, tall = PIL.Image.new("RGB", (6, 1), (9, 9, 9)), PIL.Image.new("RGB", (1, 6), (9, 9, 9))
    assert decode(encode(wide, "PNG"), WHERE, LIMITS).digest != decode(encode(tall, "PNG"), WHERE, LIMITS).digest


def test_the_format_is_sniffed_not_declared():
    data = parse_data_url(data_url(encode(picture(), "PNG"), "image/jpeg"), WHERE, LIMITS)
    assert decode(data, WHERE, LIMITS).format == "PNG"


@pytest.mark.parametrize("url", [
    "data:image/png;base64,{}",
    "DATA:IMAGE/PNG;BASE64,{}",
    "data:image/png;name=cat.png;base64,{}",
])
def test_data_urls_give_their_bytes(url):
    data = encode(picture(), "PNG")
    assert parse_data_url(url.format(base64.b64encode(data).decode()), WHERE, LIMITS) == data


# Refusals ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("url, words", [
    ("data:image/png;base64,iVBO@@==", "not valid base64"),
    ("data:image/png;base64,iVBO Rw0K", "not valid base64"),  # whitespace
    ("data:image/png;base64,iVBORw0", "not valid base64"),  # unpadded
    ("data:image/png;base64,iVBO-_0K", "not valid base64"),  # URL-safe alphabet
    ("data:image/png;base64,iVBOé", "not valid base64"),
    ("data:image/png,%89PNG", "not base64-encoded"),
    ("data:text/plain;base64,aGVsbG8=", "'text/plain'"),
    ("data:application/octet-stream;base64,aGVsbG8=", "image/*"),
    ("data:;base64,aGVsbG8=", "no media type"),
    ("data:image/png;base64", "not a data URL"),
    ("https://example.com/cat.png", "not a data URL"),
])
def test_bad_data_urls_are_refused(url, words):
    with refused("invalid_image") as caught:
        parse_data_url(url, WHERE, LIMITS)
    assert words in caught.value.message and WHERE in caught.value.message


@pytest.mark.parametrize("data, words", [
    (b"", "empty"),
    (b"hello, world: certainly no image here", "not an image"),
    (encode(picture(), "PNG")[:60], "corrupt or truncated"),
    (encode(picture(64, 64), "JPEG")[:300], "corrupt or truncated"),
    (encode(picture(), "GIF")[:40], "corrupt or truncated"),
    (encode(picture(), "BMP"), "BMP, which is not supported"),
    (encode(picture(), "TIFF"), "TIFF, which is not supported"),
    (png_header(0, 5), "PNG"),
    (png_header(70_000, 1), "longer than 65,535"),
])
def test_bad_image_bytes_are_refused(data, words):
    with refused("invalid_image") as caught:
        decode(data, WHERE, LIMITS)
    assert words in caught.value.message
    assert PIL.ImageFile.LOAD_TRUNCATED_IMAGES is False


def test_byte_cap_is_exact():
    data = encode(picture(), "PNG")
    assert decode(data, WHERE, MediaLimits(max_image_bytes=len(data))).nbytes == len(data)
    with refused("image_too_large") as caught:
        decode(data, WHERE, MediaLimits(max_image_bytes=len(data) - 1))
    assert f"{len(data) - 1} bytes per image" in caught.value.message


def test_data_url_size_is_checked_before_decoding_base64():
    limits = MediaLimits(max_image_bytes=300)
    assert len(parse_data_url(data_url(b"x" * 300), WHERE, limits)) == 300
    with refused("image_too_large"):
        parse_data_url(data_url(b"x" * 301), WHERE, limits)
    # not base64 at all: refused for its length, so nothing was decoded first
    with refused("image_too_large") as caught:
        parse_data_url("data:image/png;base64," + "!" * 10_000, WHERE, limits)
    assert "300 bytes per image" in caught.value.message


def test_pixel_cap_is_checked_from_the_header_before_decoding():
    # 5000x5000 over 16 bytes of body: decoding would fail as truncated, the cap answers first
    with refused("image_too_large") as caught:
        decode(png_header(5000, 5000), WHERE, MediaLimits(max_pixels=1000 * 1000))
    assert "5000x5000 = 25,000,000 pixels" in caught.value.message and "1,000,000 pixels" in caught.value.message
    with refused("invalid_image"):  # the same file under a cap it fits: now it is decoded, and truncated
        decode(png_header(500, 500), WHERE, MediaLimits(max_pixels=1000 * 1000))


@pytest.mark.parametrize("width, height", [(100_000, 100_000), (10_000, 9_500)])
def test_pillows_decompression_bomb_checks_become_image_too_large(width, height):
    """Above Pillow's own limit (MAX_IMAGE_PIXELS, about 89 million), its error (100000x100000)
    or warning (10000x9500) is refused too, without leaving a warnings filter behind."""
    filters = list(warnings.filters)
    started = time.monotonic()
    with refused("image_too_large") as caught:
        decode(png_header(width, height), WHERE, LIMITS)
    assert "36,000,000 pixels" in caught.value.message
    # a cap above Pillow's: its warning still refuses (else this truncated body would be invalid_image)
    with refused("image_too_large") as caught:
        decode(png_header(width, height), WHERE, MediaLimits(max_pixels=200_000_000))
    assert "Pillow's decompression-bomb limit" in caught.value.message
    assert time.monotonic() - started < 1.0
    assert warnings.filters == filters


# load ------------------------------------------------------------------------------------------

def run(coroutine):
    return asyncio.run(coroutine)


def test_load_decodes_each_part_in_order():
    parts = [(f"messages[0].content[{i}]", data_url(encode(picture(i + 1, 2), fmt)))
             for i, fmt in enumerate(["PNG", "GIF", "WEBP"])]
    images = run(load(parts, LIMITS))
    assert [(image.format, image.width) for image in images] == [("PNG", 1), ("GIF", 2), ("WEBP", 3)]
    assert all(isinstance(image, Image) for image in images)


def test_image_count_is_capped_first():
    parts = [(f"input[0].content[{i}]", "not even a URL") for i in range(3)]
    with refused("too_many_images", "input[0].content[2]") as caught:
        run(load(parts, MediaLimits(max_images=2)))
    assert "3 images" in caught.value.message and "limit is 2" in caught.value.message


def test_request_total_is_capped():
    data = encode(picture(), "PNG")
    parts = [(f"messages[0].content[{i}]", data_url(data)) for i in range(3)]
    assert len(run(load(parts[:2], MediaLimits(max_request_image_bytes=2 * len(data))))) == 2
    with refused("image_too_large", "messages[0].content[1]") as caught:
        run(load(parts, MediaLimits(max_request_image_bytes=2 * len(data) - 1)))
    assert "for all images of one request" in caught.value.message


def test_remote_urls_are_refused_while_fetching_is_off():
    lookups: list[str] = []

    async def resolve(host: str, port: int) -> list[str]:
        lookups.append(host)
        return ["93.184.216.34"]

    fetcher = Fetcher(LIMITS, resolve=resolve)
    with refused("image_url_not_allowed") as caught:
        run(load([(WHERE, "https://example.com/cat.png")], LIMITS, fetcher))
    assert "--allowed-media-domains" in caught.value.message and "data: URL" in caught.value.message
    assert lookups == []


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://example.com/x.png", "javascript:alert(1)", "/x.png"])
def test_other_schemes_are_refused(url):
    with refused("image_url_not_allowed"):
        run(load([(WHERE, url)], MediaLimits(allowed_domains=("example.com",))))


def test_decoding_leaves_the_event_loop_free():
    """A large image decodes in a thread: a 1 ms ticker keeps ticking meanwhile."""
    big = PIL.Image.effect_noise((1500, 1500), 64).convert("RGB")
    url = data_url(encode(big, "PNG", compress_level=1))

    async def main() -> int:
        ticks = 0
        done = asyncio.Event()

        async def ticker() -> None:
            nonlocal ticks
            while not done.is_set():
                await asyncio.sleep(0.001)
                ticks += 1

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        await load([(WHERE, url)], MediaLimits(max_image_bytes=64 * 2**20, max_request_image_bytes=64 * 2**20))
        done.set()
        await task
        return ticks

    assert run(main()) >= 5  # on the loop itself, the ticker would get one tick in


# Fuzzing ---------------------------------------------------------------------------------------

FUZZ_LIMITS = MediaLimits(max_pixels=128 * 128, max_image_bytes=64 * 2**10)
SEEDS = [encode(picture(9, 6), "PNG"), encode(picture(9, 6), "JPEG"), encode(picture(9, 6), "WEBP"),
         encode(picture(9, 6), "WEBP", lossless=True), encode(picture(9, 6), "GIF"), png_header(9, 6)]
FUZZ = settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def image_or_400(call) -> None:
    """`call()` gives an RGB Image or raises a 400 about this part; anything else fails."""
    try:
        image = call()
    except APIError as error:
        assert (error.status, error.param, error.rejection) == (400, WHERE, "bad_request")
        assert error.code in {"invalid_image", "image_too_large"}
        return
    assert isinstance(image, Image) and image.pixels.mode == "RGB"


@st.composite
def mutated(draw) -> bytes:
    """A real image with bytes overwritten, inserted or cut."""
    data = bytearray(draw(st.sampled_from(SEEDS)))
    for _ in range(draw(st.integers(1, 6))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["set", "insert", "cut"]))
        if edit == "set" and at < len(data):
            data[at] = draw(st.integers(0, 255))
        elif edit == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[at:at + draw(st.integers(1, 64))]
    return bytes(data)


@FUZZ
@given(st.one_of(st.binary(max_size=512), mutated()))
def test_fuzzed_bytes_give_an_image_or_a_400(data):
    image_or_400(lambda: decode(data, WHERE, FUZZ_LIMITS))


@FUZZ
@given(st.one_of(
    st.text(max_size=200),
    st.builds("{}{}{}{}".format,
              st.sampled_from(["data:", "DATA:", "data", "data:;", "http:"]),
              st.sampled_from(["image/png", "image/gif", "text/plain", "", "image/", "image/png;x=y"]),
              st.sampled_from([";base64,", ",", ";base64", ";BASE64,", ";base64;,"]),
              st.one_of(st.text(max_size=80), mutated().map(lambda b: base64.b64encode(b).decode())))))
def test_fuzzed_data_urls_give_an_image_or_a_400(url):
    image_or_400(lambda: decode(parse_data_url(url, WHERE, FUZZ_LIMITS), WHERE, FUZZ_LIMITS))
