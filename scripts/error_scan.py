"""The errors the server answers with, read off server/'s source by an AST scan: every `APIError(...)`
call whose status and code can be read, the hand-written error bodies, validation errors passed on
with OpenAI's own code, and the run-time LoRA routes' refusals. scripts/docs_reference.py renders
the result as docs/reference/errors.md; tests/docs/test_reference.py asks that nothing goes unread.
"""

from __future__ import annotations

import ast
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _text(node: ast.AST | None) -> str:
    """A message expression as a reader sees it: f-string values as `{expr}`."""
    if node is None:
        return ""
    if isinstance(node, ast.Constant):
        return str(node.value)
    if isinstance(node, ast.JoinedStr):
        return "".join(_text(v) for v in node.values)
    if isinstance(node, ast.FormattedValue):
        expr = ast.unparse(node.value)
        return "{" + (expr if len(expr) <= 24 else "…") + "}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _text(node.left) + _text(node.right)
    return "{" + ast.unparse(node) + "}"


def _excerpt(text: str, limit: int = 90) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def _local_dicts(function: ast.AST) -> dict[str, dict]:
    """name -> {key: value node} of the dict literals assigned in `function`."""
    out = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            d = node.value
            if all(isinstance(k, ast.Constant) for k in d.keys):
                out[node.targets[0].id] = {k.value: v for k, v in zip(d.keys, d.values)}
    return out


def _dict_get(node: ast.AST, dicts: dict) -> dict | None:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and isinstance(node.func.value, ast.Name):
        return dicts.get(node.func.value.id)
    return None


def _api_error_rows(call: ast.Call, function: ast.AST) -> list[tuple[int, str, str]] | None:
    """(status, code, message) of one `APIError(...)` call; None when its status or code is not
    read off the source (literals, `a if c else b` of literals, or a local dict's `.get`)."""
    status = call.args[0] if call.args else None
    message = call.args[1] if len(call.args) > 1 else None
    code = next((k.value for k in call.keywords if k.arg == "code"), None)
    if isinstance(status, ast.Constant) and isinstance(code, ast.Constant):
        return [(status.value, code.value, _text(message))]
    if isinstance(status, ast.Constant) and isinstance(code, ast.IfExp) and all(isinstance(b, ast.Constant) for b in (code.body, code.orelse)):
        return [(status.value, b.value, _text(message)) for b in (code.body, code.orelse)]
    dicts = _local_dicts(function)
    codes, messages = _dict_get(code, dicts), _dict_get(message, dicts) or {}
    if codes is not None and all(isinstance(v, ast.Constant) for v in codes.values()):
        return [(key, value.value, _text(messages.get(key))) for key, value in codes.items()]
    return None


def _functions(tree: ast.Module):
    """(function or module, node) for every node, the function being the innermost one."""
    def walk(node, owner):
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else owner
            yield inner, child
            yield from walk(child, inner)
    yield from walk(tree, tree)


def _lora_refusals(sources: dict[str, ast.Module]) -> list[tuple[int, str, str, str]]:
    """The run-time LoRA routes' refusals, made by `_refuse(metrics, action, reason, message)`
    with a code built from the reason: the real `_refuse` called with each reason the source
    passes it (and each `AdapterError` reason for the `exc.reason` it passes on)."""
    rel = "server/api/routes/lora_admin.py"
    if rel not in sources:
        return []
    from server.api.routes import lora_admin

    counter = types.SimpleNamespace(labels=lambda *a: types.SimpleNamespace(inc=lambda *a: None))
    stub = types.SimpleNamespace(lora_loads=counter)
    adapter_reasons = {}  # the first AdapterError(reason, message) of each reason, and where
    for where, tree in sources.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "AdapterError" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                adapter_reasons.setdefault(node.args[0].value, (_text(node.args[1]) if len(node.args) > 1 else "", where))
    rows = []
    for node in ast.walk(sources[rel]):
        if not (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_refuse" and len(node.args) >= 4):
            continue
        status = next((k.value.value for k in node.keywords if k.arg == "status" and isinstance(k.value, ast.Constant)), None)
        reason = node.args[2]
        given = [(reason.value, _text(node.args[3]), rel)] if isinstance(reason, ast.Constant) else [
            (r, m, w) for r, (m, w) in adapter_reasons.items()]
        for r, message, where in given:
            error = lora_admin._refuse(stub, "load", r, message, status)
            rows.append((error.status, error.code, message, where))
    return rows


def error_codes() -> tuple[dict[tuple[int, str], dict], list[str]]:
    """(status, code) -> {messages, where} for every error the server answers with, and the
    `APIError(...)` calls the scan could not read (tests/docs wants none)."""
    from server.api import errors

    found: dict[tuple[int, str], dict] = {}
    unread = []
    sources = {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text()) for p in sorted((ROOT / "server").rglob("*.py"))}
    # validation errors with OpenAI's own code: PydanticCustomError(code, message)
    custom = {n.args[0].value: _text(n.args[1]) for tree in sources.values() for n in ast.walk(tree)
              if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "PydanticCustomError"
              and len(n.args) > 1 and isinstance(n.args[0], ast.Constant)}

    def add(status: int, code: str, message: str, where: str) -> None:
        entry = found.setdefault((status, code), {"messages": set(), "where": set()})
        if message:
            entry["messages"].add(_excerpt(message))
        entry["where"].add(where)

    for rel, tree in sources.items():
        for function, node in _functions(tree):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "id", getattr(node.func, "attr", None))
            if name == "APIError":
                if getattr(function, "name", None) == "_refuse":
                    continue  # its codes: _lora_refusals()
                rows = _api_error_rows(node, function)
                if rows is None:
                    code = next((k.value for k in node.keywords if k.arg == "code"), None)
                    if isinstance(code, ast.Subscript) and rel == "server/api/errors.py":
                        # NOTE: validation errors passed on with OpenAI's own code (errors._OPENAI_CODES)
                        rows = [(node.args[0].value, c, custom.get(c, "")) for c in sorted(errors._OPENAI_CODES)]
                    else:
                        unread.append(f"{rel}:{node.lineno}")
                        continue
                for status, code, message in rows:
                    add(status, code, message, rel)
            # an error body written by hand: a JSONResponse(..., status_code=N) holding {"code": "..."}
            status = next((k.value.value for k in node.keywords if k.arg == "status_code" and isinstance(k.value, ast.Constant)), None)
            if status is not None and status >= 400:
                for d in ast.walk(node):
                    if isinstance(d, ast.Dict):
                        items = {k.value: v for k, v in zip(d.keys, d.values) if isinstance(k, ast.Constant)}
                        if isinstance(items.get("code"), ast.Constant) and items["code"].value:
                            add(status, items["code"].value, _text(items.get("message")), rel)
    for status, code, message, where in _lora_refusals(sources):
        add(status, code, message, where)
    return dict(sorted(found.items())), unread
