import pytest

from lanner.kvcache.block_manager import BlockManager, NoFreeBlocksError


def test_prefix_match_share_and_evict_lru():
    bm = BlockManager(num_blocks=6, block_size=4)
    toks = list(range(13))  # 3 full blocks + 1 token
    a = bm.allocate(4)
    hashes = []
    bm.commit_full_blocks(a, hashes, toks, num_verified=13)
    assert len(hashes) == 3
    blocks, _ = bm.match_prefix(toks)
    assert blocks == a[:3]  # the last token is never matched
    bm.acquire_cached(blocks)
    assert [bm.ref_count[b] for b in a] == [2, 2, 2, 1]
    bm.free(blocks)
    bm.free(a)
    assert bm.num_used == 0 and bm.num_free == 6
    # cached blocks survive until their space is needed, then the least recently freed goes first
    assert bm.match_prefix(toks)[0] == a[:3]
    bm.allocate(3)  # 3 plain free blocks
    got = bm.allocate(1)  # must evict a cached block: the tail (freed first) of the chain
    assert got == [a[2]]
    assert bm.match_prefix(toks)[0] == a[:2]
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(3)


def test_prefix_caching_off_and_divergent_suffix():
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    b = bm.allocate(2)
    bm.commit_full_blocks(b, [], [1, 2, 3, 4], 4)
    assert bm.match_prefix([1, 2, 3, 4, 5])[0] == []
    bm = BlockManager(num_blocks=8, block_size=2)
    b = bm.allocate(2)
    bm.commit_full_blocks(b, [], [1, 2, 3, 4], 4)
    assert bm.match_prefix([1, 2, 9, 9, 5])[0] == [b[0]]
    assert bm.match_prefix([7, 2, 3, 4, 5])[0] == []


def test_lone_request_gets_consecutive_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    x = bm.allocate(5)
    bm.free(x[2:3])
    bm.free(x[:2] + x[3:])
    y = bm.allocate(8)
    assert y == list(range(y[0], y[0] + 8))
