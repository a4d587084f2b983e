"""speedcore.engine without a GPU: block manager, prefix cache, scheduler, per-step metadata."""
import numpy as np

from speedcore.engine.block_manager import BlockManager
from speedcore.engine.sampling_params import SamplingParams
from speedcore.engine.scheduler import Scheduler, build_step
from speedcore.engine.sequence import Sequence, Status

P = SamplingParams()


def seq(n, start=0):
    return Sequence(list(range(start, start + n)), P)


def run_step(sch, batch, sample=1000):
    """Pretend the model ran: cache the tokens, append a token to every sequence that reached its end."""
    done = sch.advance(batch)
    for s in done:
        s.token_ids.append(sample)
    return done


def test_block_manager_refcounts_and_prefix_cache():
    bm = BlockManager(8, 4)
    a = seq(10)
    assert bm.admissible(a, 100) == 10 and bm.admit(a) == 0
    bm.grow(a, 10)
    assert len(a.block_table) == 3 and bm.num_free_blocks == 5
    a.num_computed_tokens = 10
    bm.commit(a)
    assert a.num_hashed_blocks == 2 and len(bm.cached) == 2
    b = seq(9)  # the same first 8 tokens: two full blocks hit; the 9th token is computed
    assert bm.admissible(b, 100) == 1
    assert bm.admit(b) == 8 and b.block_table == a.block_table[:2]
    assert [bm.ref_count[x] for x in a.block_table] == [2, 2, 1]
    bm.grow(b, 1)
    assert bm.num_free_blocks == 4
    bm.release(a)
    assert bm.num_free_blocks == 5 and [bm.ref_count[x] for x in b.block_table] == [1, 1, 1]
    bm.release(b)
    assert bm.num_free_blocks == 8
    c = seq(12)  # freed blocks keep their contents: still a hit
    assert bm.admit(c) == 8 and bm.num_free_blocks == 6
    # a prompt of exactly two blocks hits only the first: its last token must be computed for its logits
    bm.release(c)
    d = seq(8)
    assert bm.admit(d) == 4


def test_prefix_cache_off_and_eviction():
    bm = BlockManager(3, 4, enable_prefix_caching=False)
    a = seq(8)
    bm.admit(a)
    bm.grow(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    assert not bm.cached
    bm.release(a)
    assert bm.admit(seq(8)) == 0
    bm = BlockManager(2, 4)
    a = seq(8)
    bm.admit(a), bm.grow(a, 8)
    a.num_computed_tokens = 8
    bm.commit(a)
    bm.release(a)
    b = seq(8, start=50)
    bm.admit(b), bm.grow(b, 8)  # takes both freed blocks: a's hashes are evicted
    assert not bm.cached and bm.admit(seq(8)) == 0 if bm.num_free_blocks == 0 else True
    assert bm.admissible(seq(8), 100) == 0


def test_scheduler_chunked_prefill_mixed_with_decode():
    bm = BlockManager(64, 4)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(6), seq(15, start=100)
    sch.add(a), sch.add(b)
    s1 = sch.schedule()
    assert s1.seqs == [a, b] and s1.num_tokens == [6, 4] and s1.num_decode == 0
    assert run_step(sch, s1) == [a]
    s2 = sch.schedule()  # a decodes (first), b's next chunk
    assert s2.seqs == [a, b] and s2.num_tokens == [1, 9] and s2.num_decode == 1
    assert run_step(sch, s2) == [a]
    s3 = sch.schedule()
    assert s3.num_tokens == [1, 2] and run_step(sch, s3) == [a, b]
    s4 = sch.schedule()
    assert s4.num_tokens == [1, 1] and s4.num_decode == 2
    sch.finish(a, "length")
    assert a.status == Status.FINISHED and not a.block_table and sch.running == [b]


def test_scheduler_fcfs_max_num_seqs():
    sch = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=100)
    seqs = [seq(3, start=10 * i) for i in range(4)]
    for s in seqs:
        sch.add(s)
    b = sch.schedule()
    assert b.seqs == seqs[:2]
    run_step(sch, b)
    sch.finish(seqs[0], "stop")
    b = sch.schedule()
    assert b.seqs == [seqs[1], seqs[2]] and b.num_decode == 1


def test_scheduler_preemption_by_recompute():
    bm = BlockManager(4, 4)  # 16 slots
    sch = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=100, watermark=0)
    a, b = seq(8), seq(7, start=100)
    sch.add(a), sch.add(b)
    run_step(sch, sch.schedule())  # a: 9 tokens (3 blocks... 2 full + computed 8), b: 8 tokens
    assert bm.num_free_blocks == 0
    batch = sch.schedule()  # a needs a third block: b (the later arrival) is preempted
    assert batch.preempted == [b] and batch.seqs == [a] and b.status == Status.WAITING
    assert b.num_computed_tokens == 0 and not b.block_table and sch.waiting[0] is b and b.num_preemptions == 1
    run_step(sch, batch)
    sch.finish(a, "stop")
    batch = sch.schedule()  # b recomputes its prompt and its sampled token as one prefill (its first block is
    assert batch.seqs == [b] and batch.num_tokens == [4] and b.num_computed_tokens == 4  # still in the prefix cache)
    assert batch.num_decode == 0


def test_build_step_metadata():
    bm = BlockManager(16, 4)
    a, b = seq(5), seq(3, start=50)
    for s, n in ((a, 5), (b, 3)):
        bm.admit(s)
        bm.grow(s, n)
    a.num_computed_tokens = 4  # a decodes its 5th token; b prefills
    st = build_step([a, b], [1, 3], 1, 4)
    assert st.num_tokens == 4 and st.num_decode == 1 and st.num_prefill == 1 and not st.has_cached
    assert list(st["input_ids"]) == [4, 50, 51, 52] and list(st["positions"]) == [4, 0, 1, 2]
    ta, tb = a.block_table, b.block_table
    assert list(st["slot_mapping"]) == [ta[1] * 4, tb[0] * 4, tb[0] * 4 + 1, tb[0] * 4 + 2]
    assert list(st["seq_lens"]) == [5] and st["block_tables"].tolist() == [ta]
    assert list(st["cu_seqlens_q"]) == [0, 3] and list(st["cu_seqlens_k"]) == [0, 3]
    assert list(st["logits_idx"]) == [0, 3] and st.host.dtype == np.int32
    # a second chunk of b continues cached tokens: gather slots cover all its tokens so far
    b.token_ids += [53, 54]
    b.num_computed_tokens = 3
    bm.grow(b, 2)
    st = build_step([b], [2], 0, 4)
    assert st.has_cached and list(st["cu_seqlens_k"]) == [0, 5] and st.max_q == 2 and st.max_k == 5
    assert list(st["gather_slots"]) == [tb[0] * 4 + i for i in range(4)] + [b.block_table[1] * 4]
    # CUDA-graph layout: padded rows, block tables last at a fixed width
    st = build_step([a], [1], 1, 4, graph_batch=4, table_width=6)
    assert list(st["slot_mapping"]) == [ta[1] * 4, -1, -1, -1] and list(st["seq_lens"]) == [5, 0, 0, 0]
    assert list(st["input_ids"]) == [4, 0, 0, 0] and list(st["positions"]) == [4, 0, 0, 0]
    assert st["block_tables"].shape == (4, 6) and st.offsets["block_tables"][0] == 16
    assert st["block_tables"][0].tolist() == ta + [0] * (6 - len(ta)) and not st["block_tables"][1:].any()
    st = build_step([a], [1], 1, 4, graph_batch=8, graph_rows=2, table_width=6)  # bucket 2 of graphs up to 8
    assert st.host.size == 4 * 8 + 2 * 6 and st["block_tables"].shape == (2, 6)


def test_build_step_many_decode_rows_against_per_row_reference():
    """Hundreds of decode rows (ragged block tables, shuffled pages) beside prefill chunks: every field row by row
    as its definition says, eager and CUDA-graph layouts."""
    rng = np.random.default_rng(3)
    bs, dec, pre = 16, [], []
    for i in range(300):
        n = int(rng.integers(1, 900))
        s = Sequence(rng.integers(0, 5000, n + 1).tolist(), P)
        s.num_computed_tokens = n
        s.block_table = rng.permutation(1 << 16)[:-(-(n + 1) // bs)].tolist()
        dec.append(s)
    for n, c in ((37, 0), (100, 64)):
        s = Sequence(rng.integers(0, 5000, c + n).tolist(), P)
        s.num_computed_tokens = c
        s.block_table = rng.permutation(1 << 16)[:-(-(c + n) // bs)].tolist()
        pre.append((s, n))
    width = max(len(s.block_table) for s in dec)
    slot = lambda s, p: s.block_table[p // bs] * bs + p % bs  # noqa: E731

    st = build_step(dec + [s for s, _ in pre], [1] * len(dec) + [n for _, n in pre], len(dec), bs)
    want_ids = [s.token_ids[s.num_computed_tokens] for s in dec]
    want_pos = [s.num_computed_tokens for s in dec]
    want_slots = [slot(s, s.num_computed_tokens) for s in dec]
    for s, n in pre:
        c = s.num_computed_tokens
        want_ids += s.token_ids[c:c + n]
        want_pos += list(range(c, c + n))
        want_slots += [slot(s, p) for p in range(c, c + n)]
    assert st["input_ids"].tolist() == want_ids and st["positions"].tolist() == want_pos
    assert st["slot_mapping"].tolist() == want_slots
    assert st["seq_lens"].tolist() == [s.num_computed_tokens + 1 for s in dec]
    tables = st["block_tables"]
    assert tables.shape == (len(dec), width)
    for i, s in enumerate(dec):
        L = len(s.block_table)
        assert tables[i, :L].tolist() == s.block_table and not tables[i, L:].any()

    mb, rows = 512, 304
    st = build_step(dec, [1] * len(dec), len(dec), bs, graph_batch=mb, graph_rows=rows, table_width=width + 3)
    pad = mb - len(dec)
    assert st["input_ids"].tolist() == want_ids[:len(dec)] + [0] * pad
    assert st["positions"].tolist() == want_pos[:len(dec)] + [0] * pad
    assert st["slot_mapping"].tolist() == want_slots[:len(dec)] + [-1] * pad
    assert st["seq_lens"].tolist() == [s.num_computed_tokens + 1 for s in dec] + [0] * pad
    tables = st["block_tables"]
    assert tables.shape == (rows, width + 3) and not tables[len(dec):].any()
    for i, s in enumerate(dec):
        L = len(s.block_table)
        assert tables[i, :L].tolist() == s.block_table and not tables[i, L:].any()


def test_build_step_kept_tables_follow_growth_and_replacement():
    """The int32 tables kept between steps: appended blocks appear, a table replaced by another list of the same
    length (preemption and re-admission) is read afresh, through the block manager's own moves."""
    bm = BlockManager(64, 4)
    a, b = seq(6), seq(3, start=40)
    for s in (a, b):
        bm.admit(s)
        bm.grow(s, len(s))
        s.num_computed_tokens = len(s) - 1

    def check():
        st = build_step([a, b], [1, 1], 2, 4, graph_batch=2, table_width=16)
        for i, s in enumerate((a, b)):
            row = st["block_tables"][i]
            assert row[:len(s.block_table)].tolist() == s.block_table and not row[len(s.block_table):].any()

    check()
    for _ in range(9):  # decode: every 4th token takes a new block
        for s in (a, b):
            s.num_computed_tokens += 1
            s.token_ids.append(7)
            bm.grow(s, 1)
        check()
    n = len(a.block_table)
    bm.release(a)
    bm.grow(b, 4 * n)  # b takes a's freed blocks: a's next table has other pages, same length
    b.num_computed_tokens = len(b) - 1
    bm.admit(a)
    bm.grow(a, len(a) - a.num_computed_tokens)
    a.num_computed_tokens = len(a) - 1
    assert len(a.block_table) == n
    check()
