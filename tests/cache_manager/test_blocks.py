"""BlockAllocator with hand-built requests: exact blocks in the documented order."""

import pytest

from cache_manager.blocks import BlockAllocator, NoBlocks


def test_appends_after_the_last_block_then_first_fit_then_scattered():
    a = BlockAllocator(10)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(2) == [3, 4]
    a.free([1])
    assert a.allocate(2, after=4) == [5, 6]  # right after the caller's last block
    assert a.allocate(2, after=2) == [7, 8]  # 3 is taken: the first run of 2 is 7-8
    assert a.allocate(2) == [1, 9]  # no run of 2 left: the lowest free blocks
    assert a.num_free == 0 and not a.can_allocate(1)


def test_refuses_what_it_does_not_have_and_double_frees():
    a = BlockAllocator(4)
    blocks = a.allocate(4)
    with pytest.raises(NoBlocks):
        a.allocate(1)
    a.free(blocks[:2])
    with pytest.raises(ValueError):
        a.free([0])
    assert a.num_free == 2 and a.allocate(0) == []
