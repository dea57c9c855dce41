"""Where a GGUF file's conversion is kept: named by the file's content, so a second install of
the same file (another venv, another CI clone) reuses the conversion instead of adding a copy,
and a different file never reads another's."""

from __future__ import annotations

import os
import shutil

from server.model_loader import gguf_fingerprint


def test_a_gguf_fingerprint_follows_its_content_not_its_path_or_mtime(tmp_path):
    first = tmp_path / "a" / "model.gguf"
    first.parent.mkdir()
    first.write_bytes(os.urandom(40 << 20))
    copy = tmp_path / "b" / "model.gguf"
    copy.parent.mkdir()
    shutil.copyfile(first, copy)
    os.utime(copy, ns=(1, 1))
    assert gguf_fingerprint(copy) == gguf_fingerprint(first)

    data = bytearray(first.read_bytes())
    between = (len(data) - (1 << 20)) * 9 // 17 + 5  # inside the ninth of the 1 MiB samples
    for offset in (0, between, len(data) - 1):  # the header, a sample between, the tail
        changed = tmp_path / f"changed-{offset}.gguf"
        data[offset] ^= 1
        changed.write_bytes(data)
        data[offset] ^= 1
        assert gguf_fingerprint(changed) != gguf_fingerprint(first), offset
    shorter = tmp_path / "shorter.gguf"
    shorter.write_bytes(data[:-1])
    assert gguf_fingerprint(shorter) != gguf_fingerprint(first)
