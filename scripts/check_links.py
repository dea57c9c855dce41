"""Check the external (http/https) links of README.md and docs/**/*.md; exit 1 if any is broken.

    python scripts/check_links.py                       # README.md and docs/**/*.md
    python scripts/check_links.py --timeout 5 -j 16 docs/architecture.md

Each distinct URL is asked once, HEAD first and GET when HEAD fails (servers that refuse or
mishandle HEAD), several at a time. Links inside code (fenced blocks, `inline code`) and to
local or placeholder hosts (localhost, example.com, cluster-internal names) are not checked:
they are commands and examples, not references. Needs the network, so CI does not run it;
tests/docs/test_reference.py tests `extract_links` offline.
"""

from __future__ import annotations

import argparse
import re
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent
USER_AGENT = "kvserve-link-check/1"
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.DOTALL)
# a URL as markdown ends it: at whitespace, a quote, <>[] or an unbalanced ")" ([text](url), <url>, bare)
URL = re.compile(r"https?://(?:[^\s()<>\[\]`'\"]|\([^\s()<>]*\))+")
TRAILING = ".,;:!?*_'\""
LOCAL_HOSTS = ("localhost", "127.0.0.1", "0.0.0.0", "::1", "[::1]")
PLACEHOLDER_HOSTS = frozenset({"example.com", "example.org", "example.net"})
PLACEHOLDER_SUFFIXES = (".example.com", ".example.org", ".example.net", ".local", ".svc", ".internal")


def _checkable(url: str) -> bool:
    """Whether `url` names a public page: not a local host, a placeholder domain or a template."""
    if "{" in url or "<" in url or "$" in url:
        return False
    host = (urlsplit(url).hostname or "").lower()
    if not host or "." not in host or host in LOCAL_HOSTS or host.startswith("127."):
        return False
    return host not in PLACEHOLDER_HOSTS and not host.endswith(PLACEHOLDER_SUFFIXES)


def extract_links(markdown: str) -> list[str]:
    """The external links of a markdown text, once each, in order of first appearance; links in
    code blocks and spans, and to local or placeholder hosts, are left out."""
    text = FENCE.sub("", markdown)
    text = CODE_SPAN.sub("", text)
    urls = []
    for match in URL.finditer(text):
        url = match.group(0).rstrip(TRAILING)
        if url not in urls and _checkable(url):
            urls.append(url)
    return urls


def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md"] if (root / "README.md").exists() else []
    return files + sorted((root / "docs").rglob("*.md"))


def check(url: str, timeout: float) -> str | None:
    """None when `url` answers below 400 (HEAD, else GET); otherwise why not."""
    target = url.split("#", 1)[0]
    error = None
    for method in ("HEAD", "GET"):
        request = urllib.request.Request(target, method=method, headers={"User-Agent": USER_AGENT, "Accept": "*/*"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                if method == "GET":
                    response.read(1024)
                return None
        except urllib.error.HTTPError as exc:
            if exc.code == 429:
                return None  # rate-limited: the page exists
            error = f"HTTP {exc.code}"
        except (urllib.error.URLError, TimeoutError, OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}"
    return error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="*", type=Path, help="markdown files (default: README.md and docs/**/*.md)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds per request (default 10)")
    parser.add_argument("-j", "--concurrency", type=int, default=8, help="requests at once (default 8)")
    args = parser.parse_args(argv)
    where: dict[str, list[str]] = {}
    for path in args.files or markdown_files():
        name = path.resolve().relative_to(ROOT).as_posix() if path.resolve().is_relative_to(ROOT) else str(path)
        for url in extract_links(path.read_text(encoding="utf-8")):
            where.setdefault(url, []).append(name)
    with ThreadPoolExecutor(max_workers=max(1, args.concurrency)) as pool:
        results = dict(zip(where, pool.map(lambda u: check(u, args.timeout), where)))
    broken = {url: why for url, why in results.items() if why is not None}
    for url, why in sorted(broken.items()):
        print(f"{', '.join(where[url])}: {url} -> {why}", file=sys.stderr)
    print(f"{len(where)} links checked, {len(broken)} broken")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
