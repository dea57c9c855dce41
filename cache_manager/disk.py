"""Session files of the disk tier: one safetensors file per session, written atomically.

A file holds the session's KV (`kv.export`: ``k.i``/``v.i`` per layer) and its token ids
(``tokens``, int64), plus a small JSON header in the safetensors metadata (key ``kvserve``):

    {"format": "kvserve-session/1", "fingerprint": <model fingerprint>, "principal": <sha256 of
     the principal>, "session_id": <the client's id>, "n_tokens": N, "kv_dtype": <the
     --kv-cache-dtype the KV is stored in; absent in older files: "auto">, "checksum": <sha256 of
     the tensors' bytes, in name order>}

* The name derives from a hash of (hashed principal, session id), never from client strings.
* Writes go to a temporary file in the same directory, are fsynced, then renamed over the final
  name (and the directory fsynced): a reader sees the old file or the new one, never half of
  one. A process killed mid-write leaves only a ``*.tmp`` file, which `scan` deletes.
* `read` checks everything before a tensor is used: the header parses, the format, model
  fingerprint, KV dtype, principal and session id are this caller's, the checksum matches. Any
  mismatch raises `BadFile` with a reason; the caller deletes the file and recomputes (a file of
  another --kv-cache-dtype is "foreign": recomputed, never read as this one's format).

The model fingerprint covers the config, the dtype, kvserve's cache layout version and a
sample of every weight tensor, so a file written by another model, another fine-tune of the
same architecture or another dtype is never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from cache_manager.kv import LAYOUT_VERSION, layout

FORMAT = "kvserve-session/1"
SUFFIX = ".kv"
TMP_SUFFIX = ".tmp"
_HEADER_LIMIT = 1 << 20  # a session file's safetensors header is a few KB
FAILURE_REASONS = ("truncated", "corrupt", "foreign", "principal", "io")


class BadFile(Exception):
    """A session file that must not be loaded; `reason` is one of FAILURE_REASONS."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Header:
    fingerprint: str
    principal: str  # hashed
    session_id: str
    n_tokens: int
    kv_dtype: str = "auto"
    checksum: str = ""


def hash_principal(principal: str) -> str:
    """The principal as files know it: hashed, but a scope after it (a LoRA adapter's,
    `|lora:NAME:KEY`) stays readable, so that dropping the scope finds its sessions in every
    tier (CacheManager.drop_scope)."""
    base, sep, scope = principal.partition("|")
    return hashlib.sha256(b"kvserve-principal\0" + base.encode()).hexdigest()[:32] + sep + scope


def file_name(principal_hash: str, session_id: str) -> str:
    """The file of one session: a hash, so no client string reaches the file system."""
    digest = hashlib.sha256(f"{principal_hash}\0{session_id}".encode()).hexdigest()[:40]
    return digest + SUFFIX


def fingerprint(model, dtype: torch.dtype, mode: str = "") -> str:
    """Identifies the weights and the KV layout a session file was computed with, and the
    numerics (`mode`: "deterministic" for exact mode, whose KV bits differ from the default's).

    NOTE: a strided sample of up to 256 values per weight tensor, not a hash of all weights:
    any other checkpoint differs in the samples, and a 30 GB model is fingerprinted in
    milliseconds.
    """
    h = hashlib.sha256()
    # an MLA model's latent and its decompressed heads are two layouts of the same weights
    kind = " latent" if layout(model.config).latent else ""
    h.update(f"{FORMAT}|layout {LAYOUT_VERSION}{kind}|{dtype}|{mode}".encode())
    h.update(model.config.to_json_string(use_diff=False).encode())
    with torch.no_grad():
        for name, param in model.state_dict().items():
            param = param.detach()
            if hasattr(param, "to_local"):  # a tensor-parallel shard: rank 0's, read without a collective
                param = param.to_local()
            if type(param) is not torch.Tensor and hasattr(param, "dequantize"):
                param = param.dequantize()  # a quantized weight (torchao's tensor subclasses)
            flat = param.reshape(-1)
            sample = flat[:: max(1, flat.numel() // 256)][:256].to("cpu", torch.float64)
            h.update(f"{name}{tuple(param.shape)}{param.dtype}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()[:32]


def checksum(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous()
        h.update(name.encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def write(directory: Path, name: str, header: Header, tokens: list[int], kv_tensors: dict[str, torch.Tensor]) -> int:
    """Write one session file atomically (temp file, fsync, rename, fsync of the directory).

    `kv_tensors` must be on the CPU. Returns the file's size. On any error (a full disk, say)
    the temporary file is removed and the error raised; the old file, if any, is untouched.
    """
    tensors = {"tokens": torch.tensor(tokens, dtype=torch.int64), **{k: t.contiguous() for k, t in kv_tensors.items()}}
    fields = {"format": FORMAT, **{k: getattr(header, k) for k in Header.__slots__}, "checksum": checksum(tensors)}
    tmp = directory / f"{name}.{uuid.uuid4().hex}{TMP_SUFFIX}"
    try:
        _save(tensors, tmp, {"kvserve": json.dumps(fields)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
            size = os.fstat(f.fileno()).st_size
        os.replace(tmp, directory / name)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    return size


def _save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    """`save_file`, whose I/O errors (a full disk, a file size limit) arrive as SafetensorError
    with the OS error only in the message: raised as the OSError they are."""
    try:
        save_file(tensors, path, metadata=metadata)
    except SafetensorError as exc:
        code = re.search(r"\(os error (\d+)\)", str(exc))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from exc


def read_header(path: Path) -> Header:
    """The header alone (for indexing at start): raises BadFile."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise BadFile("truncated", "shorter than a safetensors header")
            (size,) = struct.unpack("<Q", head)
            if size > _HEADER_LIMIT:
                raise BadFile("corrupt", "header length out of range")
            raw = f.read(size)
    except OSError as exc:
        raise BadFile("io", str(exc)) from exc
    if len(raw) < size:
        raise BadFile("truncated", "header cut short")
    return _parse_header(raw)


def read(path: Path, expected: Header) -> tuple[list[int], dict[str, torch.Tensor]]:
    """Token ids and KV tensors (CPU) of a file whose header matches `expected` (fingerprint,
    principal, session id); raises BadFile for anything else.

    NOTE: the tensors map the file (no copy until the caller copies them into a cache).
    """
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            header = _header(f.metadata())
            if header.fingerprint != expected.fingerprint:
                raise BadFile("foreign", "written by another model, dtype or kvserve cache layout")
            if header.kv_dtype != expected.kv_dtype:
                raise BadFile("foreign", f"KV stored as {header.kv_dtype!r}, not {expected.kv_dtype!r} (--kv-cache-dtype)")
            if (header.principal, header.session_id) != (expected.principal, expected.session_id):
                raise BadFile("principal", "the file belongs to another principal or session")
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except OSError as exc:
        raise BadFile("io", str(exc)) from exc
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise BadFile("truncated", str(exc)) from exc
    if checksum(tensors) != header.checksum:
        raise BadFile("corrupt", "checksum mismatch")
    tokens = tensors.pop("tokens", None)
    if tokens is None or tokens.dtype != torch.int64 or tokens.dim() != 1 or tokens.numel() != header.n_tokens:
        raise BadFile("corrupt", "token ids missing or of the wrong length")
    return tokens.tolist(), tensors


def _parse_header(raw: bytes) -> Header:
    try:
        meta = json.loads(raw).get("__metadata__")
    except (ValueError, AttributeError) as exc:
        raise BadFile("corrupt", f"unreadable header: {exc}") from exc
    return _header(meta)


def _header(meta: dict | None) -> Header:
    try:
        fields = json.loads((meta or {})["kvserve"])
        if fields.get("format") != FORMAT:
            raise BadFile("foreign", f"format {fields.get('format')!r}")
        return Header(
            fingerprint=str(fields["fingerprint"]),
            principal=str(fields["principal"]),
            session_id=str(fields["session_id"]),
            n_tokens=int(fields["n_tokens"]),
            kv_dtype=str(fields.get("kv_dtype", "auto")),
            checksum=str(fields["checksum"]),
        )
    except BadFile:
        raise
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise BadFile("corrupt", f"unreadable header: {exc}") from exc


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
