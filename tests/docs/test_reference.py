"""docs/reference/ is generated from the code (scripts/docs_reference.py) and must match it.

No model is loaded: the pages come from `Settings`, the CLI parser, the app's OpenAPI document, a
`Metrics()` registry, `server.exits` and an AST scan of server/.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REGENERATE = "python scripts/docs_reference.py"


def _script(name: str):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


docs_reference = _script("docs_reference")
check_links = _script("check_links")
error_scan = _script("error_scan")


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    return docs_reference.pages()


def test_committed_pages_are_current(pages):
    problems = docs_reference.stale(pages)
    assert not problems, f"docs/reference is out of date ({'; '.join(problems)}): run `{REGENERATE}` and commit the result"


def test_every_page_starts_with_the_generated_note(pages):
    for name, text in pages.items():
        assert text.splitlines()[0] == docs_reference.NOTE, name
        assert str(Path.home()) not in text or str(Path.home()) == "/", f"{name} names this machine's home directory"


def test_stale_lists_changed_missing_and_extra_pages(pages, tmp_path):
    for name, text in pages.items():
        (tmp_path / name).write_text(text)
    assert docs_reference.stale(pages, tmp_path) == []
    (tmp_path / "api.md").write_text("edited by hand\n")
    (tmp_path / "metrics.md").unlink()
    (tmp_path / "notes.md").write_text("")
    assert docs_reference.stale(pages, tmp_path) == ["api.md: stale", "metrics.md: missing", "notes.md: not generated (remove it)"]


def test_every_setting_appears_once(pages):
    from server.settings import Settings

    page = pages["configuration.md"]
    for name in Settings.model_fields:
        assert page.count(f"### `{name}`\n") == 1, name
    grouped = [f for names in docs_reference.GROUPS.values() for f in names]
    assert len(grouped) == len(set(grouped)), "a field is in two groups"
    assert set(grouped) <= set(Settings.model_fields), f"GROUPS names no field: {set(grouped) - set(Settings.model_fields)}"


def test_every_route_appears(pages):
    page = pages["api.md"]
    for app in docs_reference.build_apps():
        doc = app.openapi()
        for path, methods in doc["paths"].items():
            for method in methods:
                assert f"## `{method.upper()} {path}`\n" in page, f"{method.upper()} {path}"


def test_extensions_name_existing_fields():
    """EXTENSIONS names only fields of its models, and every field the protocol source marks with
    an `# extensions` comment (the fields after it in a class body)."""
    from server.api import protocol, protocol_responses

    models = {name: getattr(protocol, name, None) or getattr(protocol_responses, name) for name in docs_reference.EXTENSIONS}
    for name, fields in docs_reference.EXTENSIONS.items():
        model = models[name]
        assert fields <= set(model.model_fields), f"{name}: no such fields {fields - set(model.model_fields)}"
        marked = set()
        for cls in model.__mro__:
            if cls.__module__ not in (protocol.__name__, protocol_responses.__name__):
                continue
            after = inspect.getsource(cls).split("# extensions", 1)[1:]
            marked |= {m for m in re.findall(r"^    (\w+):", after[0], re.MULTILINE) if m in model.model_fields} if after else set()
        assert marked <= fields, f"{name}: fields under '# extensions' missing from EXTENSIONS: {marked - fields}"


def _server_sources() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "server").rglob("*.py")))


def test_headers_are_the_servers():
    source = _server_sources()
    listed = {h for h, *_ in docs_reference.HEADERS}
    for header in listed:
        assert header.lower() in source.lower(), f"{header} is not in server/"
    literals = set()
    for path in sorted((ROOT / "server").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(r"[Xx]-[A-Za-z][A-Za-z-]+", node.value):
                literals.add(node.value.lower())
    known = {h.lower() for h in listed | docs_reference.INTERNAL_HEADERS}
    assert literals <= known, f"headers in server/ missing from docs_reference.HEADERS: {literals - known}"


def test_every_error_call_is_read():
    _, unread = error_scan.error_codes()
    assert unread == [], f"APIError calls whose status or code the scan cannot read: {unread}"


def test_every_exit_status_appears(pages):
    from server import exits

    page = pages["exit-status.md"]
    for name, value in vars(exits).items():
        if name.isupper() and isinstance(value, int):
            assert f"| {value} | `{name}` |" in page, name


def test_every_metric_appears(pages):
    from server.metrics import Metrics

    page = pages["metrics.md"]
    metrics = Metrics()
    for _, step in docs_reference._watch_steps(metrics):
        step()
    names = {family.name for family in metrics.registry.collect()}
    assert names
    for name in names:
        assert f"| `{name}" in page, name
    if hasattr(metrics, "lora_requests_info"):
        assert "vllm:lora_requests_info" in names


def test_link_extraction_offline():
    text = """See [the docs](https://docs.example.org.invalid/a_(b)) and <https://pypi.org/project/x/>,
also https://github.com/owner/repo#readme. and [local](http://127.0.0.1:8000/v1), `curl https://in.code/x`,
[again](https://pypi.org/project/x/ "title") or http://localhost:9000 and https://example.com/x.

```bash
curl https://fenced.example.net/never
```
"""
    assert check_links.extract_links(text) == [
        "https://docs.example.org.invalid/a_(b)",
        "https://pypi.org/project/x/",
        "https://github.com/owner/repo#readme",
    ]
