"""Fetching image URLs without letting a request reach what the server can reach (SSRF).

Every hop of a fetch passes the same checks, from the start: the scheme is http or https; the
URL carries no user name; its host is on the allow list (an IP literal only when listed, and
never in a legacy numeric form such as `2130706433` or `0x7f.1`); every address the host
resolves to is public. The connection then goes to one of those checked addresses, never to a
second lookup, with the name in the Host header and in TLS's SNI (so the certificate is verified
against the name): a DNS answer that changes between check and connect (rebinding) cannot move
it. Redirects are followed by hand, each one a new hop. The body is read up to the per-image byte
cap, and one time-out covers resolution, connection, redirects and body.

vLLM's CVE-2025-6242 and CVE-2026-24779 are what goes wrong without these.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import re
import socket
import ssl
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

import certifi
import httpx

from server.api.errors import APIError

log = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolve = Callable[[str, int], Awaitable[Sequence[str]]]  # (host, port) -> its addresses, as text
AddressPolicy = Callable[[IPAddress], bool]

_METADATA = frozenset(map(ipaddress.ip_address, ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")))
_SHARED = ipaddress.ip_network("100.64.0.0/10")  # carrier-grade NAT, RFC 6598
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_LOCAL_NAT64 = ipaddress.ip_network("64:ff9b:1::/48")
_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*")
_NUMBER = re.compile(r"0x[0-9a-f]*|[0-9]+")  # a label that makes a host an IPv4 number (WHATWG URL)
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


@dataclass(frozen=True, slots=True)
class MediaLimits:
    """What one request's images may be; `allowed_domains` empty means only data: URLs."""

    max_image_bytes: int = 20 * 2**20  # one image's encoded bytes
    max_request_image_bytes: int = 50 * 2**20  # all images of one request together
    max_images: int = 16  # per request
    max_pixels: int = 6000 * 6000  # width x height of one image, checked from the header
    allowed_domains: tuple[str, ...] = ()  # see media_fetch.AllowList
    fetch_timeout_s: float = 10.0  # one fetch: resolution, connection, redirects and body
    max_redirects: int = 3

    def __post_init__(self) -> None:
        if isinstance(self.allowed_domains, str):
            raise ValueError(f"allowed_domains must be a sequence of host names, not the string "
                             f"{self.allowed_domains!r}")
        object.__setattr__(self, "allowed_domains", tuple(self.allowed_domains))
        for name in ("max_image_bytes", "max_request_image_bytes", "max_images", "max_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not self.fetch_timeout_s > 0:
            raise ValueError(f"fetch_timeout_s must be positive, got {self.fetch_timeout_s}")
        if self.max_redirects < 0:
            raise ValueError(f"max_redirects must be 0 or more, got {self.max_redirects}")
        AllowList.parse(self.allowed_domains)  # a bad entry fails at start-up, not per request


def format_bytes(n: int) -> str:
    """20971520 -> '20.0 MiB'; 1536 -> '1.5 KiB'; 12 -> '12 bytes'."""
    if n >= 2**20:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} bytes"


def is_public_address(ip: IPAddress) -> bool:
    """Whether `ip` is a public unicast address: not loopback, private, link-local, multicast,
    reserved, unspecified, shared (100.64/10) or a cloud metadata address. IPv4 carried inside
    IPv6 (mapped, 6to4, NAT64) is judged by the IPv4 address; Teredo and local NAT64 never pass."""
    if ip in _METADATA:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None or ip in _LOCAL_NAT64:
            return False
        inner = ip.ipv4_mapped or ip.sixtofour
        if inner is None and ip in _NAT64:
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if inner is not None:
            return is_public_address(inner)
    if ip in _SHARED:
        return False
    special = (ip.is_private, ip.is_loopback, ip.is_link_local, ip.is_multicast, ip.is_reserved, ip.is_unspecified)
    return ip.is_global and not any(special)


async def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to (the system resolver, run in a thread)."""
    infos = await asyncio.to_thread(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass(frozen=True, slots=True)
class Host:
    """A URL's host as compared and connected to: `text` lower-case, IDNA-encoded, without a
    trailing dot (an IP literal in its canonical form); `address` set for an IP literal."""

    text: str
    address: IPAddress | None = None

    @classmethod
    def parse(cls, raw: str) -> Host:
        """`raw` (a URL's host or an allow-list entry) normalised; ValueError, saying why, for what
        is neither a host name nor an IP address, and for numeric forms other than a.b.c.d."""
        bare = raw.strip()
        if bare.startswith("[") and bare.endswith("]"):
            bare = bare[1:-1]
        try:
            address = ipaddress.ip_address(bare)
            return cls(str(address), address)
        except ValueError:
            pass
        try:
            name = httpx.URL("http://placeholder/").copy_with(host=bare).raw_host.decode("ascii")
        except (httpx.InvalidURL, UnicodeError) as exc:
            raise ValueError(f"{raw!r} is not a valid host name") from exc
        name = name.lower().removesuffix(".")
        if _NUMBER.fullmatch(name.rsplit(".", 1)[-1]):
            try:
                meaning = f" (it means {socket.inet_ntoa(socket.inet_aton(name))})"
            except OSError:
                meaning = ""
            raise ValueError(f"{raw!r}{meaning} is an IP address in a numeric form other than a.b.c.d, "
                             "which is not accepted")
        if len(name) > 253 or not _NAME.fullmatch(name):
            raise ValueError(f"{raw!r} is not a valid host name")
        return cls(name)


@dataclass(frozen=True, slots=True)
class AllowList:
    """The hosts image URLs may name (`--allowed-media-domains`): "example.com" is that host
    alone, "*.example.com" its subdomains but not itself, an IP literal that address alone."""

    names: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com" for "*.example.com"
    addresses: frozenset[str]

    @classmethod
    def parse(cls, entries: Iterable[str]) -> AllowList:
        """The allow list of `entries`; ValueError naming the first entry that is not a host name,
        a "*." wildcard of one, or an IP address."""
        names, suffixes, addresses = set(), [], set()
        for entry in entries:
            wildcard = entry.strip().startswith("*.")
            try:
                host = Host.parse(entry.strip().removeprefix("*.") if wildcard else entry)
            except ValueError as exc:
                raise ValueError(f"allowed media domain {exc}") from None
            if host.address is not None and wildcard:
                raise ValueError(f"allowed media domain {entry!r}: a wildcard needs a host name, not an IP address")
            if wildcard:
                suffixes.append("." + host.text)
            else:
                (addresses if host.address is not None else names).add(host.text)
        return cls(frozenset(names), tuple(suffixes), frozenset(addresses))

    def permits(self, host: Host) -> bool:
        if host.address is not None:
            return host.text in self.addresses
        return host.text in self.names or host.text.endswith(self.suffixes)


@dataclass(frozen=True, slots=True)
class _Hop:
    """One checked request: the URL as written, its host, and the addresses it may connect to."""

    url: httpx.URL
    host: Host
    addresses: tuple[IPAddress, ...]

    @property
    def host_header(self) -> str:
        text = f"[{self.host.text}]" if ":" in self.host.text else self.host.text
        return text if self.url.port is None else f"{text}:{self.url.port}"


@functools.cache
def _default_tls_context() -> ssl.SSLContext:
    """httpx's own default (certifi's roots), built once instead of per client."""
    return ssl.create_default_context(cafile=certifi.where())


def _show(url: str) -> str:
    return url if len(url) <= 100 else url[:97] + "..."


class Fetcher:
    """Safe fetching of http(s) image URLs under one request's `MediaLimits` (module docstring).

    `resolve` and `is_allowed_address` default to the system resolver and `is_public_address`,
    `tls_context` to certifi's roots; tests inject them to map names to a local server, permit
    exactly its address and trust its certificate."""

    def __init__(self, limits: MediaLimits, resolve: Resolve | None = None,
                 is_allowed_address: AddressPolicy | None = None, tls_context: ssl.SSLContext | None = None) -> None:
        self._limits = limits
        self._allow = AllowList.parse(limits.allowed_domains)
        self._resolve = resolve or resolve_host
        self._is_allowed_address = is_allowed_address or is_public_address
        self._tls_context = tls_context

    async def fetch(self, url: str, where: str) -> bytes:
        """The body of `url`, following at most `max_redirects` redirects; a 400 APIError
        (image_url_not_allowed, image_fetch_failed, image_too_large) for anything refused."""
        seconds = self._limits.fetch_timeout_s
        try:
            async with asyncio.timeout(seconds):
                for _ in range(self._limits.max_redirects + 1):
                    hop = await self._check(url, where)
                    body, location = await self._get(hop, where)
                    if location is None:
                        return body
                    log.debug("image at %s: %s redirects to %s", where, _show(url), _show(location))
                    url = location
        except TimeoutError:
            raise APIError(400, f"fetching the image at {where} ({_show(url)}) took longer than the time-out of "
                           f"{seconds:g} s", code="image_fetch_failed", param=where, rejection="bad_request") from None
        raise APIError(400, f"the image URL at {where} redirected more than {self._limits.max_redirects} times "
                       f"(last to {_show(url)})", code="image_fetch_failed", param=where, rejection="bad_request")

    async def _check(self, url: str, where: str) -> _Hop:
        """`url` checked from the start (scheme, user name, allow list, resolution, addresses)."""
        try:
            parsed = httpx.URL(url)
            port = parsed.port
        except (httpx.InvalidURL, TypeError, ValueError):
            raise APIError(400, f"the image URL at {where} is not a valid URL: {_show(url)}",
                           code="image_url_not_allowed", param=where, rejection="bad_request") from None
        if parsed.scheme not in ("http", "https"):
            scheme = f"{parsed.scheme}:" if parsed.scheme else "no scheme"
            raise APIError(400, f"the image URL at {where} uses {scheme}; only http and https URLs are fetched "
                           "(or send the image inline as a data: URL)",
                           code="image_url_not_allowed", param=where, rejection="bad_request")
        if parsed.userinfo:
            raise APIError(400, f"the image URL at {where} carries a user name or password (user@host), which is "
                           "not accepted", code="image_url_not_allowed", param=where, rejection="bad_request")
        if not parsed.raw_host or (port is not None and not 0 < port < 65536):
            raise APIError(400, f"the image URL at {where} has no valid host and port: {_show(url)}",
                           code="image_url_not_allowed", param=where, rejection="bad_request")
        try:
            host = Host.parse(parsed.raw_host.decode("ascii"))
        except ValueError as exc:
            raise APIError(400, f"the image URL at {where} has a host that is not accepted: {exc}",
                           code="image_url_not_allowed", param=where, rejection="bad_request") from None
        if not self._allow.permits(host):
            raise APIError(400, f"the image URL at {where} names host {host.text!r}, which is not in the server's "
                           "--allowed-media-domains", code="image_url_not_allowed", param=where, rejection="bad_request")
        if host.address is not None:
            addresses: tuple[IPAddress, ...] = (host.address,)
        else:
            addresses = await self._lookup(host, port or (443 if parsed.scheme == "https" else 80), where)
        for address in addresses:
            if not self._is_allowed_address(address):
                log.info("image at %s: host %s resolves to %s, which is not public; refused", where, host.text, address)
                raise APIError(400, f"the image URL at {where} names host {host.text!r}, which resolves to an "
                               "address that is not public; only public addresses are fetched",
                               code="image_url_not_allowed", param=where, rejection="bad_request")
        return _Hop(parsed, host, addresses)

    async def _lookup(self, host: Host, port: int, where: str) -> tuple[IPAddress, ...]:
        try:
            found = await self._resolve(host.text, port)
            addresses = tuple(ipaddress.ip_address(text) for text in found)
        except (OSError, ValueError, UnicodeError):
            addresses = ()
        if not addresses:
            raise APIError(400, f"the host {host.text!r} of the image URL at {where} could not be resolved",
                           code="image_fetch_failed", param=where, rejection="bad_request")
        return addresses

    async def _get(self, hop: _Hop, where: str) -> tuple[bytes, str | None]:
        """One GET of `hop` on one of its checked addresses: (body, None), or (b"", the
        redirect's absolute URL). An address that refuses the connection moves on to the next."""
        headers = {"Host": hop.host_header, "Accept": "image/*", "Accept-Encoding": "identity",
                   "User-Agent": "kvserve"}
        extensions = {"sni_hostname": hop.host.text} if hop.host.address is None and hop.url.scheme == "https" else {}
        failure: Exception = httpx.ConnectError("no address answered")
        # NOTE: a client per hop, so no pooled connection verified for one name serves another;
        # trust_env=False, so no proxy from the environment resolves the name on its own.
        tls = self._tls_context or _default_tls_context()
        async with httpx.AsyncClient(verify=tls, trust_env=False, follow_redirects=False,
                                     timeout=self._limits.fetch_timeout_s) as client:
            for address in hop.addresses:
                target = hop.url.copy_with(host=str(address))
                try:
                    async with client.stream("GET", target, headers=headers, extensions=extensions) as response:
                        return await self._read(response, hop, where)
                except httpx.ConnectError as exc:
                    failure = exc
                except httpx.HTTPError as exc:
                    raise self._failed(hop, where, exc) from None
        raise self._failed(hop, where, failure)

    async def _read(self, response: httpx.Response, hop: _Hop, where: str) -> tuple[bytes, str | None]:
        status, url = response.status_code, _show(str(hop.url))
        if status in _REDIRECTS:
            location = response.headers.get("location")
            if not location:
                raise APIError(400, f"{url} (at {where}) answered HTTP {status} without a Location",
                               code="image_fetch_failed", param=where, rejection="bad_request")
            return b"", str(hop.url.join(location))
        if not 200 <= status < 300:
            raise APIError(400, f"fetching the image at {where} ({url}) failed: the server answered HTTP {status}",
                           code="image_fetch_failed", param=where, rejection="bad_request")
        encoding = response.headers.get("content-encoding", "identity")
        if encoding.strip().lower() != "identity":
            raise APIError(400, f"{url} (at {where}) sent a compressed body (Content-Encoding: {encoding}); images "
                           "are fetched uncompressed", code="image_fetch_failed", param=where, rejection="bad_request")
        cap = self._limits.max_image_bytes
        too_large = APIError(400, f"the image at {where} ({url}) is larger than {format_bytes(cap)}, the limit "
                             "per image", code="image_too_large", param=where, rejection="bad_request")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cap:
            raise too_large
        chunks, size = [], 0
        async for chunk in response.aiter_raw():
            size += len(chunk)
            if size > cap:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks), None

    @staticmethod
    def _failed(hop: _Hop, where: str, exc: Exception) -> APIError:
        reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return APIError(400, f"fetching the image at {where} ({_show(str(hop.url))}) failed: {reason}",
                        code="image_fetch_failed", param=where, rejection="bad_request")
