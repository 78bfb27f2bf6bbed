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


class Clock:
    """A settable clock: session idleness is measured in seconds."""

    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _turn(bm, clock, session, tokens, n_blocks):
    """One finished request of `session` holding `n_blocks` full, named blocks of `tokens`; frees them at the
    clock's time and advances it."""
    blocks = bm.allocate(n_blocks)
    bm.commit_full_blocks(blocks, [], tokens, len(tokens))
    bm.free(blocks, session)
    clock.t += 1
    return blocks


def test_active_session_outlives_newer_sessions_and_plain_lru():
    clock = Clock()
    bm = BlockManager(num_blocks=6, block_size=2, session_idle_s=100, clock=clock)
    main = _turn(bm, clock, "main", [1] * 4, 2)  # freed first: plain LRU would evict it first
    sub = _turn(bm, clock, "sub", [2] * 4, 2)
    plain = _turn(bm, clock, None, [3] * 4, 2)
    assert bm.num_free == 6
    # the plain blocks go first, then the newer session's, and only then the main session's
    assert bm.allocate(2) == plain[::-1]  # a request's tail before its head
    assert bm.allocate(2) == sub[::-1]
    assert bm.match_prefix([1] * 4 + [0])[0] == main
    assert bm.allocate(2) == main[::-1]


def test_idle_session_goes_first_and_plain_requests_stay_lru():
    clock = Clock()
    bm = BlockManager(num_blocks=6, block_size=2, session_idle_s=10, clock=clock)
    old = _turn(bm, clock, "old", [1] * 4, 2)
    new = _turn(bm, clock, "new", [2] * 4, 2)
    plain = _turn(bm, clock, None, [3] * 4, 2)
    clock.t += 10  # "old" (last active at 0) is idle now; "new" (at 1) is not
    # the idle session ranks by its last-active time among plain blocks (freed at 2): it goes first
    assert bm.allocate(2) == old[::-1]
    bm.touch("new")
    assert bm.allocate(2) == plain[::-1]
    assert bm.allocate(2) == new[::-1]
    # no sessions: exactly the old LRU order
    bm = BlockManager(num_blocks=4, block_size=2)
    a = bm.allocate(2)
    bm.commit_full_blocks(a, [], [5] * 4, 4)
    b = bm.allocate(2)
    bm.commit_full_blocks(b, [], [6] * 4, 4)
    bm.free(b)
    bm.free(a)
    assert bm.allocate(4) == b[::-1] + a[::-1]


def test_session_blocks_revived_and_renamed_keep_counts():
    clock = Clock()
    bm = BlockManager(num_blocks=4, block_size=2, clock=clock)
    toks = [1, 2, 3, 4, 5]
    blocks = _turn(bm, clock, "s", toks, 2)
    hit, _ = bm.match_prefix(toks)
    assert hit == blocks
    bm.acquire_cached(hit)  # the session's next turn takes its blocks back from its free list
    assert bm.num_free == 2 and bm.num_used == 2
    bm.free(hit, "s")
    assert bm.num_free == 4 and len(bm.sessions["s"].free) == 2
    assert len(bm.allocate(4)) == 4 and bm.num_free == 0 and bm.num_session_free == 0


def test_a_lone_request_prefills_in_solo_steps():
    """Scheduler(solo_budget=N): a request alone takes N-token prefill steps; with a second one waiting, the step
    budget is max_num_batched_tokens again, shared."""
    from lanner import SamplingParams
    from lanner.engine.request import Request
    from lanner.engine.scheduler import Scheduler

    sched = Scheduler(BlockManager(num_blocks=64, block_size=16), max_num_seqs=4, max_num_batched_tokens=128,
                      max_queue_len=8, solo_budget=512)
    new = lambda name, n: Request(name, list(range(n)), SamplingParams(max_tokens=4), None, 4, [])
    sched.add(new("a", 700))
    assert [it.num_tokens for it in sched.schedule()] == [512]
    sched.running[0].num_computed = 512
    sched.add(new("b", 300))
    assert [it.num_tokens for it in sched.schedule()] == [128]  # a's rest gets the whole shared budget first
