"""The block pool and prefix cache (pure)."""

from __future__ import annotations

from pdserve_sim.kvcache import BlockPool, block_hashes


def test_block_hashes_identify_prefixes() -> None:
    a = block_hashes(list(range(40)), 16)
    b = block_hashes([*range(32), 99, 98], 16)
    c = block_hashes([7, *range(1, 40)], 16)
    assert len(a) == 2 and a == b  # the partial last block has no hash; equal prefixes hash equal
    assert c[0] != a[0] and c[1] != a[1]  # a block's hash depends on everything before it


def test_cached_blocks_are_reused_until_evicted() -> None:
    pool = BlockPool(4, 16)
    hashes = block_hashes(list(range(32)), 16)
    blocks = pool.allocate(2)
    assert blocks == [0, 1] and pool.num_free == 2 and pool.usage == 0.5
    for block, h in zip(blocks, hashes, strict=True):
        pool.register(block, h)
    pool.release(blocks)
    assert pool.num_free == 4 and pool.usage == 0.0
    # Freed blocks keep their content: a lookup hits both.
    hit = pool.lookup(hashes)
    assert hit == [0, 1] and pool.num_unreferenced(hit) == 2
    pool.acquire(hit)
    assert pool.num_free == 2
    pool.release(hit)
    # Fresh blocks are handed out before cached ones; then the least recently freed cached block goes.
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [1]  # released in reverse: block 1 (the tail) was freed first
    assert pool.lookup(hashes) == [0]  # block 1 was evicted, so only the first block still hits
    assert pool.allocate(2) is None  # only one block left


def test_a_hit_stops_at_the_first_miss() -> None:
    pool = BlockPool(8, 4)
    hashes = block_hashes(list(range(12)), 4)
    blocks = pool.allocate(3)
    assert blocks is not None
    pool.register(blocks[0], hashes[0])
    pool.register(blocks[2], hashes[2])  # block 1's hash was never registered
    assert pool.lookup(hashes) == [blocks[0]]
