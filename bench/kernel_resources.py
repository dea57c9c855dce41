"""What the paged attention kernel and its store ask of an H200 (issue 47), measured without
one: the Triton kernels built ahead of time for sm_90 by Triton's own compiler and ptxas (both
ship in the triton wheel), as `paged_kernel.launches` and `store_launch` make them and Triton's
JIT specialises them, for the attention shapes of the models kvserve serves, over decode rows
(one query a row) and over rows of a CHUNK-token chunk (prefill chunks, forced and drafted
tokens: as many query rows a program as its tile holds). Per kernel: the shared memory a
program takes (an H200 gives one block at most SHARED_LIMIT bytes: a kernel past it fails at
its first launch), and ptxas's registers and spilled bytes per thread.

    .venv/bin/python -m bench.kernel_resources [--shapes NAME ...] [--json]

Run it without TRITON_INTERPRET: the interpreter's kernels are not compiled.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

import torch

SHARED_LIMIT = 227 * 1024  # sm_90's most shared memory for one block (opted in)
ARCH = 90

# name: (query heads per KV head, key width, value width, dtype, extras); a latent pool's key is
# the rotary key and its value the latent (server/engine/mla.py); "kv": the pool's format
# (`kv.KV_DTYPES`: fp8 codes and a scale a slot)
SHAPES = {
    "qwen2.5-1.5b": (6, 128, 128, torch.bfloat16, {}),
    "qwen2.5-32b": (5, 128, 128, torch.bfloat16, {}),
    "llama-3.1-70b": (8, 128, 128, torch.bfloat16, {}),
    "gemma-2-9b": (2, 256, 256, torch.bfloat16, dict(softcap=True)),
    "gpt-oss-20b": (8, 64, 64, torch.bfloat16, dict(sinks=True)),
    "falcon-7b-mqa": (71, 64, 64, torch.bfloat16, {}),
    "deepseek-v2-lite-latent": (16, 64, 512, torch.bfloat16, dict(latent=True)),
    "deepseek-v3-latent": (128, 64, 512, torch.bfloat16, dict(latent=True)),
    "qwen2.5-32b-fp8-kv": (5, 128, 128, torch.bfloat16, dict(kv="fp8")),
    "deepseek-v3-latent-fp8-kv": (128, 64, 512, torch.bfloat16, dict(latent=True, kv="fp8")),
    "qwen2.5-32b-fp32": (5, 128, 128, torch.float32, {}),
    "deepseek-v3-latent-fp32": (128, 64, 512, torch.float32, dict(latent=True)),
}
BLOCKS = 64  # the bucket's blocks a row may hold, in the launch built (their number changes no constant)
CHUNK = 64  # a multi-token row's tokens: every shape's tile of query rows as full as it gets


def build(launch) -> dict:
    """One launch (`paged_kernel.Launch`) compiled for sm_90 as Triton's JIT would compile it on
    the card: each argument specialised by Triton's own rule (a pointer or an integer that is a
    multiple of 16 marked so, an integer 1 made a constant, a float left alone). Returns
    {"shared": bytes, "registers": per thread, "spilled": bytes stored per thread}."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler.compiler import ASTSource

    kernel = launch.kernel
    options = {k: launch.constants[k] for k in ("num_warps", "num_stages") if k in launch.constants}
    constexprs = {k: v for k, v in launch.constants.items() if k not in options}
    signature, attrs = {}, {}
    runtime = [name for name in kernel.arg_names if name not in constexprs]
    for name, value in zip(runtime, launch.args, strict=True):
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            constexprs[name] = key
            continue
        signature[name] = kind
        if key == "D":
            attrs[(kernel.arg_names.index(name),)] = [["tt.divisibility", 16]]
    signature.update({name: "constexpr" for name in constexprs})
    signature = {name: signature[name] for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=GPUTarget("cuda", ARCH, 32), options=options)
    ptxas = get_ptxas(ARCH).path  # the one that built the kernel: the legacy ptxas reads older PTX only
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        report = subprocess.run([ptxas, f"-arch=sm_{ARCH}a", "-v", ptx.name, "-o", os.devnull], capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    return {"shared": compiled.metadata.shared, "registers": int(registers[1]) if registers else None, "spilled": int(spilled[1]) if spilled else 0}


def measure(name: str, width: int = 1) -> dict:
    """Both kernels of a split step for SHAPES[name] (the superset of an unsplit one), launched
    over one row of `width` tokens in a pool of BLOCKS blocks, built but not run."""
    from cache_manager.kv import BLOCK_SIZE, SCALE_DTYPE, kv_format
    from server.engine import paged_kernel

    groups, dk, dv, dtype, extras = SHAPES[name]
    latent = extras.get("latent", False)
    kv_heads = 1 if latent else 2
    q = torch.zeros(1, kv_heads, groups * width, dk + dv if latent else dk, dtype=dtype)
    fmt = kv_format(extras.get("kv", "auto"))
    slots = (BLOCKS + 1) * BLOCK_SIZE
    keys, values = (torch.zeros(kv_heads, slots, d, dtype=fmt.storage_dtype(dtype)) for d in (dk, dv))
    scales = [torch.zeros(kv_heads, slots, dtype=SCALE_DTYPE) for _ in range(2)] if fmt.quantized else [None, None]
    tables, positions = torch.zeros(1, BLOCKS, dtype=torch.long), torch.zeros(1, width, dtype=torch.long)
    sinks = torch.zeros(kv_heads * groups) if extras.get("sinks") else None
    _, (attend, merge) = paged_kernel.launches(q, keys, values, tables, positions, BLOCK_SIZE, 0.1, 50.0 if extras.get("softcap") else None,
                                               sinks, None, None, *scales, fmt.name, splits=2)
    new_keys, new_values = torch.zeros(kv_heads, width, dk, dtype=dtype), torch.zeros(kv_heads, width, dv, dtype=dtype)
    store = paged_kernel.store_launch(new_keys, new_values, keys, values, torch.zeros(width, dtype=torch.long), *scales, fmt.name)
    return {"rows_a_program": attend.constants["BLOCK_M"], "attention": build(attend), "merge": build(merge), "store": build(store)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--json", action="store_true", help="one JSON object of every shape's figures")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("bench.kernel_resources builds the kernels for a GPU: run it without TRITON_INTERPRET=1")
    figures = {name: {"decode": measure(name), "chunk": measure(name, CHUNK)} for name in args.shapes}
    if args.json:
        print(json.dumps(figures))
        return
    print(f"sm_{ARCH} (H100/H200), shared memory limit {SHARED_LIMIT // 1024} KB a block; chunks of {CHUNK} tokens")
    print(f"{'shape':26} {'rows':>6} {'rows/prog':>9} {'kernel':>9} {'shared KB':>9} {'fits':>5} {'regs':>5} {'spilled B':>9}")
    for name, both in figures.items():
        for rows, got in both.items():
            for kernel in ("attention", "merge", "store"):
                k = got[kernel]
                print(f"{name:26} {rows:>6} {got['rows_a_program']:>9} {kernel:>9} {k['shared'] / 1024:>9.1f} "
                      f"{'yes' if k['shared'] <= SHARED_LIMIT else 'NO':>5} {k['registers']:>5} {k['spilled']:>9}")


if __name__ == "__main__":
    main()
