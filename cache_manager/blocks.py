"""Which blocks of the KV pool are free: pure bookkeeping, no torch.

The pool (cache_manager/kv.py) is `num_blocks` blocks of `block_size` token slots each, per
layer. A sequence holds a list of blocks (its block table); slot `b * block_size + i` holds its
token at position `j * block_size + i` when `b` is its j-th block.

Allocation prefers runs of consecutive blocks, in this order:
1. right after the sequence's last block (growing a sequence appends in place);
2. the first run of free blocks long enough for the whole request (first fit);
3. the lowest free blocks, wherever they are.
A sequence whose blocks are consecutive is read as one view of the pool on CPU (no gather);
any other block table is gathered, with the same result.
"""

from __future__ import annotations

FREE, USED = 1, 0


class NoBlocks(Exception):
    """Fewer free blocks than asked for."""


class BlockAllocator:
    """Free and used blocks of one pool. Engine thread only (no lock)."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        self.num_blocks = num_blocks
        # NOTE: one byte per block, so runs are found by bytes.find at C speed
        self._free = bytearray([FREE]) * num_blocks
        self.num_free = num_blocks

    def can_allocate(self, n: int) -> bool:
        return 0 <= n <= self.num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` free blocks, marked used: consecutive where possible (see the module's order);
        `after` is the last block the caller already holds. Raises NoBlocks."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n == 0:
            return []
        if n > self.num_free:
            raise NoBlocks(f"{n} blocks asked for, {self.num_free} free")
        run = bytes([FREE]) * n
        start = -1
        if after is not None and self._free.startswith(run, after + 1):
            start = after + 1
        if start < 0:
            start = self._free.find(run)
        if start >= 0:
            blocks = list(range(start, start + n))
            self._free[start : start + n] = bytes(n)
        else:
            blocks, i = [], 0
            while len(blocks) < n:
                i = self._free.index(FREE, i)
                blocks.append(i)
                self._free[i] = USED
                i += 1
        self.num_free -= n
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Give `blocks` back; freeing a block that is already free is a bug (ValueError)."""
        for b in blocks:
            if self._free[b] == FREE:
                raise ValueError(f"block {b} is already free")
            self._free[b] = FREE
        self.num_free += len(blocks)
