"""Fetching image URLs (server/api/media_fetch.py) against real HTTP servers on loopback that
count the connections they accept, so "refused without a connection" is measured, not assumed.

Only the resolver (names such as images.test mapped to the servers) and, where a test says so,
the address predicate (permitting exactly a test server's address) are injected; nothing else
is replaced. A name that only the injected resolver knows can be fetched only if the fetcher
connects to the address it checked, never resolving the name again.
"""

from __future__ import annotations

import ipaddress
import shutil
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from server.api.media import Fetcher, MediaLimits, decode, load
from server.api.media_fetch import AllowList, Host, is_public_address
from tests.server.test_media import encode, picture, refused

pytestmark = pytest.mark.anyio

WHERE = "messages[1].content[2]"
PNG = encode(picture(), "PNG")


class _Handler(BaseHTTPRequestHandler):
    """Routes: /image.png, /redirect?to=URL, /hops/N (N relative redirects, then the image),
    /large (no length, 1 MiB), /declared-large, /slow (a byte per 50 ms), /missing, /gzip,
    /no-location."""

    server: CountingServer

    def do_GET(self) -> None:
        self.server.hosts.append(self.headers.get("Host"))
        path, _, query = self.path.partition("?")
        if path == "/image.png":
            return self._send(200, PNG)
        if path == "/redirect":
            return self._send(302, headers={"Location": urllib.parse.parse_qs(query)["to"][0]})
        if path.startswith("/hops/"):
            left = int(path.rsplit("/", 1)[1])
            return self._send(302, headers={"Location": f"/hops/{left - 1}"}) if left else self._send(200, PNG)
        if path == "/large":
            return self._send(200, b"\x00" * 2**20, length=False)
        if path == "/declared-large":
            return self._send(200, b"\x00" * 10, headers={"Content-Length": str(10**9)}, length=False)
        if path == "/slow":
            self._send(200, b"", headers={"Content-Length": "100"}, length=False)
            for _ in range(100):
                time.sleep(0.05)
                self.wfile.write(b"\x00")
                self.wfile.flush()
            return None
        if path == "/gzip":
            return self._send(200, PNG, headers={"Content-Encoding": "gzip"})
        return self._send(302 if path == "/no-location" else 404, b"")

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, length: bool = True) -> None:
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        for start in range(0, len(body), 2**16):
            self.wfile.write(body[start:start + 2**16])

    def log_message(self, *args) -> None:
        pass


class CountingServer(ThreadingHTTPServer):
    """An HTTP/1.0 server on `host` that counts the connections it accepts."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, host: str, tls: ssl.SSLContext | None = None) -> None:
        super().__init__((host, 0), _Handler)
        self.connections = 0
        self.hosts: list[str | None] = []
        self.server_names: list[str | None] = []  # TLS SNI, as the client sent it
        self._lock = threading.Lock()
        if tls is not None:
            tls.sni_callback = lambda sock, name, context: self.server_names.append(name)
            self.socket = tls.wrap_socket(self.socket, server_side=True)

    @property
    def port(self) -> int:
        return self.server_address[1]

    @property
    def address(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Address(self.server_address[0])

    def verify_request(self, request, client_address) -> bool:
        with self._lock:
            self.connections += 1
        return True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that hung up mid-body (the caps and the time-out do that on purpose)


def _serve(host: str, tls: ssl.SSLContext | None = None):
    server = CountingServer(host, tls)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def site():
    """The allowed image server, on 127.0.0.1."""
    yield from _serve("127.0.0.1")


@pytest.fixture(scope="module")
def other():
    """A second server, on 127.0.0.2: where refused redirects would have gone."""
    yield from _serve("127.0.0.2")


@pytest.fixture(scope="module")
def tls_site(tmp_path_factory):
    """An https server on 127.0.0.1 whose self-signed certificate names images.test; yields it
    and a client context that trusts that certificate alone."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make the test certificate")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=images.test",
                    "-addext", "subjectAltName=DNS:images.test"], check=True, capture_output=True)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    for server in _serve("127.0.0.1", tls):
        yield server, ssl.create_default_context(cafile=str(cert))


def resolver(table: dict[str, list[str]], lookups: list[str] | None = None):
    """A resolver that knows only `table` (and records each lookup in `lookups`)."""
    async def resolve(host: str, port: int) -> list[str]:
        if lookups is not None:
            lookups.append(host)
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return table[host]
    return resolve


def only(*servers: CountingServer):
    """An address predicate that permits exactly these servers' addresses."""
    return lambda ip: ip in {server.address for server in servers}


NAMES = {"images.test": ["127.0.0.1"], "a.cdn.test": ["127.0.0.1"], "x.y.cdn.test": ["127.0.0.1"],
         "cdn.test": ["127.0.0.1"], "unlisted.test": ["127.0.0.2"], "internal.test": ["127.0.0.2"],
         "other.test": ["127.0.0.2"], "xn--bcher-kva.test": ["127.0.0.1"]}
ALLOWED = ("images.test", "*.cdn.test", "internal.test", "other.test", "bücher.test")


def image_url(server: CountingServer, host: str = "images.test", path: str = "/image.png") -> str:
    return f"http://{host}:{server.port}{path}"


def fetcher(allowed=ALLOWED, predicate=None, lookups=None, **limits) -> Fetcher:
    return Fetcher(MediaLimits(allowed_domains=allowed, **{"fetch_timeout_s": 3.0, **limits}),
                   resolve=resolver(NAMES, lookups), is_allowed_address=predicate)


# Good fetches ----------------------------------------------------------------------------------

async def test_an_allowed_url_is_fetched_from_the_checked_address(site):
    lookups: list[str] = []
    url = f"http://images.test:{site.port}/image.png"
    body = await fetcher(predicate=only(site), lookups=lookups).fetch(url, WHERE)
    assert body == PNG and decode(body, WHERE, MediaLimits()).format == "PNG"
    assert lookups == ["images.test"]  # resolved once; the system resolver does not know the name
    assert site.hosts[-1] == f"images.test:{site.port}"


@pytest.mark.parametrize("host", ["a.cdn.test", "x.y.cdn.test", "IMAGES.test.", "bücher.test", "xn--bcher-kva.test"])
async def test_allow_list_matches_names_normalised(site, host):
    assert await fetcher(predicate=only(site)).fetch(f"http://{host}:{site.port}/image.png", WHERE) == PNG


async def test_load_fetches_through_the_fetcher(site):
    limits = MediaLimits(allowed_domains=ALLOWED)
    images = await load([(WHERE, f"http://images.test:{site.port}/image.png")], limits, fetcher(predicate=only(site)))
    assert [(image.format, image.width, image.height) for image in images] == [("PNG", 7, 5)]


async def test_https_verifies_the_name_on_the_checked_address(tls_site):
    """The connection goes to 127.0.0.1, yet TLS sends and verifies the URL's name."""
    server, trust = tls_site
    limits = MediaLimits(allowed_domains=ALLOWED)
    fetcher = Fetcher(limits, resolve=resolver({"images.test": ["127.0.0.1"], "other.test": ["127.0.0.1"]}),
                      is_allowed_address=only(server), tls_context=trust)
    assert await fetcher.fetch(f"https://images.test:{server.port}/image.png", WHERE) == PNG
    assert (server.server_names[-1], server.hosts[-1]) == ("images.test", f"images.test:{server.port}")
    with refused("image_fetch_failed") as caught:  # the same server, under a name its certificate lacks
        await fetcher.fetch(f"https://other.test:{server.port}/image.png", WHERE)
    assert "CERTIFICATE_VERIFY_FAILED" in caught.value.message and server.server_names[-1] == "other.test"


# Refused before any connection ------------------------------------------------------------------

@pytest.mark.parametrize("host, words", [
    ("127.0.0.1", "not in the server's --allowed-media-domains"), ("[::1]", "not in the server's"),
    ("[::ffff:127.0.0.1]", "not in the server's"), ("2130706433", "means 127.0.0.1"), ("0x7f.1", "means 127.0.0.1"),
    ("127.1", "means 127.0.0.1"), ("0177.0.0.1", "not a valid URL"), ("0x7f000001", "means 127.0.0.1"),
])
async def test_ip_literals_are_refused_without_a_connection(site, host, words):
    lookups: list[str] = []
    before = site.connections
    with refused("image_url_not_allowed") as caught:
        await fetcher(lookups=lookups).fetch(f"http://{host}:{site.port}/image.png", WHERE)
    assert words in caught.value.message
    assert (site.connections, lookups) == (before, [])


async def test_a_listed_ip_literal_still_needs_an_allowed_address(site):
    url = f"http://127.0.0.1:{site.port}/image.png"
    before = site.connections
    with refused("image_url_not_allowed") as caught:
        await fetcher(allowed=("127.0.0.1",)).fetch(url, WHERE)
    assert "not public" in caught.value.message and site.connections == before
    assert await fetcher(allowed=("127.0.0.1",), predicate=only(site)).fetch(url, WHERE) == PNG


@pytest.mark.parametrize("address", ["10.0.0.5", "169.254.169.254", "::ffff:127.0.0.1", "127.0.0.1", "100.64.0.1",
                                     "fd00:ec2::254", "0.0.0.0"])
async def test_names_resolving_to_internal_addresses_are_refused(site, address):
    """Refused as not allowed: had a connection been tried, 10.0.0.5 would be a fetch failure."""
    before = site.connections
    resolve = resolver({"images.test": [address]})
    with refused("image_url_not_allowed") as caught:
        await Fetcher(MediaLimits(allowed_domains=ALLOWED), resolve=resolve).fetch(image_url(site), WHERE)
    assert "not public" in caught.value.message and address not in caught.value.message
    assert site.connections == before


async def test_every_resolved_address_must_be_allowed(site):
    before = site.connections
    resolve = resolver({"images.test": ["127.0.0.1", "10.0.0.5"]})
    limits = MediaLimits(allowed_domains=ALLOWED)
    with refused("image_url_not_allowed"):
        await Fetcher(limits, resolve=resolve, is_allowed_address=only(site)).fetch(image_url(site), WHERE)
    assert site.connections == before


async def test_the_system_resolver_and_the_public_check_refuse_localhost(site):
    before = site.connections
    with refused("image_url_not_allowed"):
        await Fetcher(MediaLimits(allowed_domains=("localhost",))).fetch(image_url(site, "localhost"), WHERE)
    assert site.connections == before


@pytest.mark.parametrize("host", ["evil.test", "cdn.test", "images.test.evil.test", "notimages.test", "images.testx"])
async def test_hosts_off_the_list_are_refused_before_resolution(site, host):
    lookups: list[str] = []
    before = site.connections
    with refused("image_url_not_allowed") as caught:
        await fetcher(predicate=only(site), lookups=lookups).fetch(f"http://{host}:{site.port}/image.png", WHERE)
    assert "--allowed-media-domains" in caught.value.message
    assert (site.connections, lookups) == (before, [])


@pytest.mark.parametrize("url", ["file:///etc/passwd", "ftp://images.test/image.png", "gopher://images.test:70/",
                                 "data:image/png;base64,AAAA", "http://user:secret@images.test:{port}/image.png",
                                 "http://images.test@127.0.0.1:{port}/image.png", "http://images.test:99999/",
                                 "http://exa mple.test/", "//images.test:{port}/image.png"])
async def test_other_schemes_user_names_and_bad_urls_are_refused(site, url):
    before = site.connections
    with refused("image_url_not_allowed"):
        await fetcher(predicate=only(site)).fetch(url.format(port=site.port), WHERE)
    assert site.connections == before


# Redirects -------------------------------------------------------------------------------------

def redirect(site: CountingServer, to: str) -> str:
    return f"http://images.test:{site.port}/redirect?to={urllib.parse.quote(to, safe='')}"


@pytest.mark.parametrize("target", ["http://127.0.0.2:{port}/image.png", "http://unlisted.test:{port}/image.png",
                                    "http://internal.test:{port}/image.png", "http://localhost:{port}/image.png",
                                    "file:///etc/passwd"])
async def test_a_redirect_to_a_refused_target_never_connects(site, other, target):
    """images.test (allowed) redirects; the target (other, on 127.0.0.2) gets no connection."""
    before = site.connections, other.connections
    with refused("image_url_not_allowed"):
        await fetcher(predicate=only(site)).fetch(redirect(site, target.format(port=other.port)), WHERE)
    assert (site.connections, other.connections) == (before[0] + 1, before[1])


async def test_redirects_to_allowed_targets_are_followed(site, other):
    before = other.connections
    body = await fetcher(predicate=only(site, other)).fetch(redirect(site, image_url(other, "other.test")), WHERE)
    assert body == PNG and other.connections == before + 1 and other.hosts[-1] == f"other.test:{other.port}"


async def test_redirects_are_capped(site):
    before = site.connections
    hops = fetcher(predicate=only(site), max_redirects=3)
    assert await hops.fetch(f"http://images.test:{site.port}/hops/3", WHERE) == PNG
    assert site.connections == before + 4
    with refused("image_fetch_failed") as caught:
        await hops.fetch(f"http://images.test:{site.port}/hops/4", WHERE)
    assert "more than 3 times" in caught.value.message
    assert site.connections == before + 8  # four hops; the fifth was never requested


# Caps, time-out and failures -------------------------------------------------------------------

@pytest.mark.parametrize("path", ["/large", "/declared-large"])
async def test_a_body_over_the_cap_is_refused(site, path):
    with refused("image_too_large") as caught:
        await fetcher(predicate=only(site), max_image_bytes=100_000).fetch(image_url(site, path=path), WHERE)
    assert "97.7 KiB" in caught.value.message


async def test_a_slow_server_runs_into_the_total_time_out(site):
    started = time.monotonic()
    with refused("image_fetch_failed") as caught:
        await fetcher(predicate=only(site), fetch_timeout_s=0.3).fetch(f"http://images.test:{site.port}/slow", WHERE)
    assert "0.3 s" in caught.value.message
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("path, words", [("/missing", "HTTP 404"), ("/gzip", "compressed"),
                                         ("/no-location", "without a Location")])
async def test_failed_answers_are_refused(site, path, words):
    with refused("image_fetch_failed") as caught:
        await fetcher(predicate=only(site)).fetch(f"http://images.test:{site.port}{path}", WHERE)
    assert words in caught.value.message


async def test_unreachable_and_unknown_hosts_fail():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # nothing listens there once closed
    with refused("image_fetch_failed"):
        await fetcher(predicate=lambda ip: True).fetch(f"http://images.test:{port}/image.png", WHERE)
    with refused("image_fetch_failed") as caught:
        await fetcher(allowed=("nowhere.test",)).fetch("http://nowhere.test/image.png", WHERE)
    assert "could not be resolved" in caught.value.message


# The address check and the allow list ----------------------------------------------------------

@pytest.mark.parametrize("address, public", [
    ("8.8.8.8", True), ("93.184.216.34", True), ("2606:4700:4700::1111", True), ("::ffff:8.8.8.8", True),
    ("64:ff9b::808:808", True), ("2002:808:808::1", True),
    ("127.0.0.1", False), ("10.0.0.5", False), ("172.16.0.1", False), ("192.168.1.1", False),
    ("169.254.169.254", False), ("100.64.0.1", False), ("100.100.100.200", False), ("0.0.0.0", False),
    ("224.0.0.1", False), ("240.0.0.1", False), ("255.255.255.255", False), ("::1", False), ("::", False),
    ("fe80::1", False), ("fc00::1", False), ("fd00:ec2::254", False), ("ff02::1", False), ("2001:db8::1", False),
    ("::ffff:127.0.0.1", False), ("::ffff:10.0.0.1", False), ("2002:7f00:1::", False), ("64:ff9b::7f00:1", False),
    ("64:ff9b:1::808:808", False), ("2001:0:4136:e378:8000:63bf:3fff:fdd2", False), ("::127.0.0.1", False),
])
def test_public_addresses(address, public):
    assert is_public_address(ipaddress.ip_address(address)) is public


def test_allow_list_parsing():
    allow = AllowList.parse(["Example.COM.", "*.cdn.example", "bücher.example", "[::1]", "93.184.216.34"])
    assert allow.permits(Host.parse("example.com")) and not allow.permits(Host.parse("www.example.com"))
    assert allow.permits(Host.parse("a.cdn.example")) and not allow.permits(Host.parse("cdn.example"))
    assert allow.permits(Host.parse("xn--bcher-kva.example")) and allow.permits(Host.parse("::1"))
    assert allow.permits(Host.parse("93.184.216.34")) and not allow.permits(Host.parse("93.184.216.35"))


@pytest.mark.parametrize("entry", ["*", "*.10.0.0.1", "a/b", "user@host", "0x7f.1", "2130706433", "a..b", ""])
def test_bad_allow_list_entries_fail_at_start_up(entry):
    with pytest.raises(ValueError, match="allowed media domain"):
        MediaLimits(allowed_domains=(entry,))
