"""The what-if replay on small graphs whose answers are worked out by hand, and on real traces."""
from __future__ import annotations

import numpy as np
import pytest

from aiprof.diagnosis.graph import (
    COLL_END,
    COLL_START,
    END,
    LAUNCH,
    OTHER,
    STEP,
    SYNC,
    Graph,
    build_graph,
    queue_wait_ns,
)
from aiprof.diagnosis.job import joint_replay, start_offsets
from aiprof.diagnosis.profiler_cost import ProfilerCost
from aiprof.diagnosis.replay import Edit, combine, replay

US = 1000.0


def graph(actions: list[tuple], ops: list[tuple], lat: float = 0.0, **kw) -> Graph:
    """actions: (kind, gap_us, cost_us, wait_op); ops: (action, stream, dur_us). Times in µs."""
    n, m = len(actions), len(ops)
    kind = np.array([a[0] for a in actions], np.int8)
    gap = np.array([a[1] * US for a in actions])
    cost = np.array([a[2] * US for a in actions])
    g = Graph(rank=kw.get("rank", 0), lo=0, hi=0, step_number=np.array([0]), a_ts=np.arange(n), a_end=np.arange(n),
              a_kind=kind, a_row=np.where((kind == LAUNCH) | (kind == SYNC) | (kind == OTHER), 1, -1),
              a_wait=np.array([a[3] for a in actions], np.int64), a_name=["call"], a_code=np.zeros(n, np.int64),
              gap=gap, cost=cost, gap_raw=gap.copy(), cost_raw=cost.copy(), over=np.zeros(n), rt_over=np.zeros(n),
              o_action=np.array([o[0] for o in ops], np.int64), o_stream=np.array([o[1] for o in ops], np.int64),
              o_dur=np.array([o[2] * US for o in ops]), o_ts=np.zeros(m, np.int64), o_end=np.zeros(m, np.int64),
              o_delay=np.zeros(m), o_table=np.zeros(m, np.int8), o_row=np.arange(m), launch_latency_ns=lat * US,
              a_coll=kw.get("a_coll", np.full(n, -1, np.int64)), o_coll=kw.get("o_coll", np.full(m, -1, np.int64)),
              c_others=kw.get("others", {}), c_transfer=kw.get("transfer", {}))
    return g


def test_host_bound_chain():
    # step, then 3 launches 10 µs apart each costing 2 µs, kernels of 1 µs: the host decides
    g = graph([(STEP, 0, 0, -1), (LAUNCH, 10, 2, -1), (LAUNCH, 10, 2, -1), (LAUNCH, 10, 2, -1), (END, 0, 0, -1)],
              [(1, 7, 1), (2, 7, 1), (3, 7, 1)], lat=5)
    r = replay(g)
    # host: 10+2+10+2+10+2 = 36 µs; last kernel: launched at 34 (start of the 3rd call) + 5 latency + 1 = 40
    assert r.total_ns == pytest.approx(40 * US)
    assert r.host_ns == pytest.approx(36 * US)


def test_gpu_bound_chain_and_sync():
    # two 100 µs kernels launched back to back, then a device sync with a 3 µs cost
    g = graph([(STEP, 0, 0, -1), (LAUNCH, 1, 1, -1), (LAUNCH, 1, 1, -1), (SYNC, 1, 3, 1), (END, 0, 0, -1)],
              [(1, 7, 100), (2, 7, 100)], lat=2)
    r = replay(g)
    # kernel 1: 1+2 -> 103; kernel 2 queues behind it -> 203; the sync returns at 203 + 3
    assert r.total_ns == pytest.approx(206 * US)
    # without the wait, the host finishes at 1+1+1+1+1+3 = 8 µs, and the GPU still at 203
    e = Edit.for_graph(g)
    e.no_wait[3] = True
    assert replay(g, e).total_ns == pytest.approx(203 * US)


def test_edits_remove_host_time_drop_and_shorten_ops():
    g = graph([(STEP, 0, 0, -1), (LAUNCH, 50, 5, -1), (SYNC, 0, 1, 0), (LAUNCH, 20, 5, -1), (SYNC, 0, 1, 1),
               (END, 0, 0, -1)], [(1, 7, 30), (3, 7, 30)], lat=0)
    base = replay(g).total_ns  # 50+5 -> op0 ends 80 (launched at 50), sync ->81; +20 -> 101, op1 131, +1 = 132
    assert base == pytest.approx(132 * US)
    e = Edit.for_graph(g)
    e.gap_remove[1] = 50 * US  # the 50 µs of host work before the first launch gone
    assert replay(g, e).total_ns == pytest.approx(82 * US)
    e2 = Edit.for_graph(g)
    e2.drop_op[0] = True  # no first kernel: its sync does not wait
    assert replay(g, e2).total_ns == pytest.approx((50 + 5 + 1 + 20) * US + 30 * US + 1 * US)
    e3 = Edit.for_graph(g)
    e3.op_dur[:] = 10 * US  # both kernels three times faster
    assert replay(g, e3).total_ns == pytest.approx((50 + 10 + 1 + 20 + 10 + 1) * US)
    # edits combine
    both = combine(g, [e, e3])
    assert replay(g, both).total_ns == pytest.approx((0 + 10 + 1 + 20 + 10 + 1) * US)


def test_graph_replay_packs_kernels():
    # ten 1 µs kernels, each launch costing 8 µs on the host: a CUDA graph spaces them 0.25 µs apart
    acts = [(STEP, 0, 0, -1)] + [(LAUNCH, 0, 8, -1)] * 10 + [(END, 0, 0, -1)]
    g = graph(acts, [(i + 1, 7, 1) for i in range(10)], lat=4)
    # the last launch starts at 72 µs (its kernel ends at 72 + 4 + 1) and returns at 80: the host ends last
    assert replay(g).total_ns == pytest.approx(80 * US)
    e = Edit.for_graph(g)
    e.cost_remove[:] = g.cost
    e.packed[:] = True
    e.packed_gap_ns = 250.0
    assert replay(g, e).total_ns == pytest.approx((10 * 1 + 9 * 0.25) * US)


def test_min_step_is_reported_by_the_pricer_not_the_replay():
    g = graph([(STEP, 0, 0, -1), (OTHER, 100, 0, -1), (END, 0, 0, -1)], [])
    e = Edit.for_graph(g)
    e.gap_remove[1] = 100 * US
    e.min_step_ns = 40 * US
    assert replay(g, e).total_ns == 0.0 and e.min_step_ns == 40 * US


def test_collectives_couple_two_ranks():
    # rank 0 arrives at its all-reduce at 10 µs, rank 1 after 60 µs of host work; transfer 5 µs.
    r0 = graph([(STEP, 0, 0, -1), (COLL_START, 10, 0, -1), (COLL_END, 0, 0, -1), (OTHER, 1, 0, -1), (END, 0, 0, -1)],
               [], rank=0, a_coll=np.array([-1, 0, 0, -1, -1]), others={0: 60 * US}, transfer={0: 5 * US})
    r1 = graph([(STEP, 0, 0, -1), (COLL_START, 60, 0, -1), (COLL_END, 0, 0, -1), (OTHER, 1, 0, -1), (END, 0, 0, -1)],
               [], rank=1, a_coll=np.array([-1, 0, 0, -1, -1]), others={0: 10 * US}, transfer={0: 5 * US})

    class F:  # the facts joint_replay reads
        def __init__(self, g):
            self.graph, self.rank, self.extra = g, g.rank, {}

    facts = [F(r0), F(r1)]
    res = joint_replay(facts)
    # both leave the collective at 60 + 5 = 65 µs, then 1 µs of host work
    assert res[0].host_ns == pytest.approx(66 * US) and res[1].host_ns == pytest.approx(66 * US)
    # remove rank 1's 60 µs of host work: now rank 0 is last (10 µs): both at 10 + 5 + 1
    e = Edit.for_graph(r1)
    e.gap_remove[1] = 60 * US
    res = joint_replay(facts, {1: e})
    assert res[0].host_ns == pytest.approx(16 * US) and res[1].host_ns == pytest.approx(16 * US)
    # rank 0's waiting went away although its own graph did not change
    assert res[0].arrivals[0] == pytest.approx(10 * US)


class _F:  # the facts joint_replay reads
    def __init__(self, g):
        self.graph, self.rank, self.extra = g, g.rank, {}


def _coll_chain(rank: int, order: list[int], late_us: float) -> Graph:
    """A rank launching one GPU collective per 1 µs call (ids in ``order``), 5 µs transfers;
    the recording had the other rank arrive ``late_us`` later (a GPU backlog)."""
    n = len(order)
    acts = [(STEP, 0, 0, -1)] + [(LAUNCH, 0, 1, -1)] * n + [(END, 0, 0, -1)]
    return graph(acts, [(i + 1, 7, 5) for i in range(n)], rank=rank, o_coll=np.array(order, np.int64),
                 others={c: (late_us + 5 * c) * US for c in order}, transfer={c: 5 * US for c in order})


def test_joint_replay_follows_a_long_chain_of_collectives():
    # 20 all-reduces back to back on each rank; the recording says the other rank arrived ~1 ms
    # late at each (it ran a backlog). Replayed together both arrive at once: collective k ends
    # at 5 (k+1) µs, the last at 100 µs. Replaying round by round would need 20 rounds.
    facts = [_F(_coll_chain(r, list(range(20)), 1000.0)) for r in (0, 1)]
    res = joint_replay(facts)
    assert res[0].total_ns == pytest.approx(100 * US) and res[1].total_ns == pytest.approx(100 * US)
    # alone, with the recorded arrivals, a rank waits for the backlog
    assert replay(facts[0].graph).total_ns > 1000 * US


def test_joint_replay_never_deadlocks_on_crossed_collectives():
    # the windows cut the collectives in different orders: rank 0 reaches 0 then 1, rank 1 the
    # reverse; no schedule satisfies both, and the replay still ends (earliest arrival released
    # with the recorded arrival of the other rank)
    facts = [_F(_coll_chain(0, [0, 1], 50.0)), _F(_coll_chain(1, [1, 0], 50.0))]
    res = joint_replay(facts)
    assert set(res) == {0, 1} and all(r.total_ns > 0 for r in res.values())


def test_launches_blocked_on_a_full_queue_are_waiting_not_host_work():
    # four launches of one API: two cost 5 µs with the GPU idle; two took 3 ms while the GPU ran
    # 2 ms behind (their ops started long after the calls returned): their excess is waiting
    a_ts = np.array([0, 100, 200, 5_000], np.int64) * 1000
    a_end = a_ts + np.array([5, 5, 3_000, 3_000]) * 1000
    kind = np.full(4, LAUNCH, np.int8)
    o_ts = np.array([10, 110, 5_200, 10_000], np.int64) * 1000
    w = queue_wait_ns(a_ts, a_end, kind, np.full(4, -1), np.zeros(4, np.int64), np.arange(4), o_ts)
    assert w.tolist() == pytest.approx([0, 0, 2_995_000, 2_995_000])
    # a slow launch whose op started at once (lazy module loading) is the call's own cost
    o_ts2 = o_ts.copy()
    o_ts2[2] = a_end[2] + 10_000
    w2 = queue_wait_ns(a_ts, a_end, kind, np.full(4, -1), np.zeros(4, np.int64), np.arange(4), o_ts2)
    assert w2[2] == 0 and w2[3] > 0


def test_queue_blocked_launches_on_the_sockets_job():
    """The real sockets capture: its launches blocked 7-8 ms each behind slow all-reduces; the
    graph keeps a launch's typical cost for them. The healthy GPU-bound job has a handful of
    0.1-0.2 ms launches while its GPU ran behind: under 1 % of its window."""
    from aiprof.analysis.steps import find_steps
    from aiprof.trace.store import open_capture
    from tests.conftest import DATA

    for name, blocked in (("slow_transport2_fault_rank0", True), ("healthy_gpt2", False)):
        rt = open_capture(str(DATA / "diagnosis" / f"{name}.json.gz")).ranks[0]
        g = build_graph(rt, find_steps(rt), ProfilerCost.none())
        launch_ms = (g.a_end - g.a_ts)[g.a_kind == LAUNCH] / 1e6
        cost_ms = g.cost_raw[g.a_kind == LAUNCH] / 1e6
        waited = float((launch_ms - cost_ms).sum())
        if blocked:
            assert (launch_ms > 2).sum() >= 10 and cost_ms.max() < 0.2 and waited > 100
        else:
            assert waited < 0.01 * (g.hi - g.lo) / 1e6


def test_joint_replay_starts_every_rank_at_its_first_common_step():
    # rank 0's window was recorded 1 ms before rank 1's (it ran ahead while waiting on the GPU
    # for rank 1): replayed, both start step 0 together; rank 1 arrives after 40 µs of host
    # work, rank 0 at once: both leave the all-reduce at 40 + 5 µs
    def one(rank: int, host_us: float, lo_ns: int) -> Graph:
        g = graph([(STEP, 0, 0, -1), (COLL_START, host_us, 0, -1), (COLL_END, 0, 0, -1), (END, 0, 0, -1)], [],
                  rank=rank, a_coll=np.array([-1, 0, 0, -1]), others={0: 0.0}, transfer={0: 5 * US})
        g.lo = lo_ns
        g.a_ts = g.a_ts + lo_ns
        return g

    facts = [_F(one(0, 0, 0)), _F(one(1, 40, 1_000_000))]
    assert start_offsets(facts) == {0: 0.0, 1: -1_000_000.0}
    res = joint_replay(facts)
    assert res[0].host_ns == pytest.approx(45 * US) and res[1].host_ns == pytest.approx(45 * US)


def test_a_sync_on_work_from_before_the_window_is_waiting():
    """straggler2 on two H200s: rank 0 starts its window in a 56 ms cudaEventSynchronize on the
    all-reduce it launched before the capture (waiting for rank 1). That is the GPU backlog, not
    host work: the graph keeps a few µs of it."""
    from aiprof.analysis.steps import find_steps
    from aiprof.trace.store import open_capture
    from tests.conftest import DATA

    rt = open_capture(str(DATA / "diagnosis" / "straggler2_fault_rank0.json.gz")).ranks[0]
    g = build_graph(rt, find_steps(rt), ProfilerCost.none())
    ev = [i for i in range(g.n_actions) if g.action_name(i) == "cudaEventSynchronize"]
    first = max(ev, key=lambda i: g.a_end[i] - g.a_ts[i])
    assert g.a_end[first] - g.a_ts[first] > 40e6 and g.a_ts[first] - g.lo < 1e6
    assert g.a_wait[first] < 0  # it waited for no op of the window
    assert g.cost_raw[first] < 0.1e6


def test_unedited_replay_reproduces_a_real_trace(gpt2_stall):
    """With no profiler deflation the replay of the recorded graph ends where the trace ends."""
    from aiprof.analysis.steps import find_steps
    from aiprof.trace.store import open_capture

    rt = open_capture(str(gpt2_stall)).ranks[0]
    steps = find_steps(rt)
    g = build_graph(rt, steps, ProfilerCost.none())
    r = replay(g)
    host_end = float(steps.end.max() - steps.start.min())
    assert r.host_ns == pytest.approx(host_end, rel=0.01)
    # each replayed step matches the recorded one (the first four; the last one ends with the GPU)
    rec = (steps.end - steps.start).astype(float)
    assert np.allclose(r.step_ns[:-1], rec[:-1], rtol=0.02)
    # and with the profiler's cost removed it is shorter (this trace is host-heavy)
    assert replay(build_graph(rt, steps)).total_ns < r.total_ns


def test_an_op_that_starts_as_another_streams_op_ends_waited_for_it():
    # worked by hand (µs): op 0 on stream 7 runs [0, 100]; op 1 (stream 8, launched after it) could
    # start at 10 but starts at 105.8, 5.8 µs after op 0 ends, as FSDP2's compute stream does after
    # its all-gather's copy-out on an H100: a wait; op 2 (stream 8) starts 60 µs late with no other
    # stream's op ending then: no wait; op 3 starts late as op 2 (its own stream) ends: no cross wait
    from aiprof.diagnosis.graph import _implicit_waits

    us = np.array
    o_ts = (us([0.0, 105.8, 300.0, 400.0]) * US).astype(np.int64)
    o_end = (us([100.0, 200.0, 350.0, 450.0]) * US).astype(np.int64)
    stream = us([7, 8, 8, 8])
    ready = us([0.0, 10.0, 240.0, 340.0]) * US
    first = us([True, False, False, False])
    assert _implicit_waits(o_ts, o_end, stream, ready, first) == {1: 0}


def test_an_op_issued_earlier_queues_in_its_new_order():
    # FSDP1's backward without prefetch: all-gather 1 (stream 2), unit 1's compute (stream 1), its
    # reduce-scatter (stream 3), then all-gather 2, which the communicator runs after that
    # reduce-scatter, and unit 2's compute; every call 1 µs after the one before, no launch latency
    g = graph([(STEP, 0, 0, -1), (LAUNCH, 1, 0, -1), (LAUNCH, 1, 0, -1), (LAUNCH, 1, 0, -1), (LAUNCH, 1, 0, -1),
               (LAUNCH, 1, 0, -1), (END, 0, 0, -1)],
              [(1, 2, 100), (2, 1, 50), (3, 3, 100), (4, 2, 100), (5, 1, 50)])
    g.o_deps = {1: [0], 2: [1], 3: [2], 4: [3]}
    ends: list = []
    # AG1 1-101, C1 101-151, RS1 151-251, AG2 251-351, C2 351-401
    assert replay(g, op_ends=ends).total_ns == pytest.approx(401 * US)
    assert ends == pytest.approx([101 * US, 151 * US, 251 * US, 351 * US, 401 * US])
    # prefetched: all-gather 2 issued with all-gather 1 (after it on its stream), the reduce-scatter
    # after it on the communicator, unit 2's compute waiting for it alone
    e = Edit(launch_at={3: 1}, deps={3: [], 2: [1, 3], 4: [3]})
    ends = []
    # AG1 1-101, AG2 101-201, C1 101-151, RS1 201-301 (after AG2), C2 201-251: the window ends at 301
    assert replay(g, e, op_ends=ends).total_ns == pytest.approx(301 * US)
    assert ends == pytest.approx([101 * US, 151 * US, 301 * US, 201 * US, 251 * US])  # the graph's numbering
    # combined with another edit, the re-issue and its waits stay
    other = Edit.for_graph(g)
    other.op_dur[1] = 10 * US
    both = combine(g, [e, other])
    assert both.launch_at == {3: 1} and both.deps[2] == [1, 3]
    # C1 101-111: RS1 still waits for AG2 (201-301)
    assert replay(g, both).total_ns == pytest.approx(301 * US)


def test_host_time_is_put_back_only_where_the_host_sets_the_step():
    from aiprof.diagnosis.facts import HOST_BOUND_MIN_SHARE, fit_deflation

    # a host-bound step: 100 ms of host, less the profiler's cost (alpha x 30 ms), over a 40 ms GPU
    def host_bound(alpha: float, beta: float) -> float:
        return max(beta * (100.0 - 30.0 * alpha), 40.0)

    # the unprofiled step is 85 ms, slower than the replay with the measured cost (70 ms): less deflation
    alpha, beta = fit_deflation(host_bound, 85.0)
    assert 0 < alpha < 1 and beta == 1.0 and host_bound(alpha, beta) == pytest.approx(85.0, rel=0.01)

    # a comm-bound step: 100 ms of collectives, the host (at most 98 ms profiled) hidden under them;
    # the unprofiled step measured 103 ms: the miss is the collectives', the measured cost stays
    def comm_bound(alpha: float, beta: float) -> float:
        return max(beta * (98.0 - 30.0 * alpha), 100.0)

    assert (comm_bound(0, 1) - comm_bound(1, 1)) / 103.0 < HOST_BOUND_MIN_SHARE
    assert fit_deflation(comm_bound, 103.0) == (1.0, 1.0)
