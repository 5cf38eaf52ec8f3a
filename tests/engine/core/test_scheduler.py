"""Scheduler driven without a model: chunked prefill, budgets, prefix hits, preemption, abort."""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.scheduler import Scheduler
from engine.messages import EngineCoreOutput, FinishReason
from engine.request import Request, RequestStatus
from engine.worker.messages import ModelRunnerOutput, SchedulerOutput
from tests.helpers.factories import make_request, make_scheduler

ABORTED = RequestStatus.FINISHED_ABORTED


def step(
    sched: Scheduler, token: int = 7, abort: tuple[str, ...] = ()
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine step; ``abort`` ends requests after the batch ran, before its update."""
    out = sched.schedule()
    ids = [rid for rid, sample in zip(out.req_ids, out.sample) if sample]
    sched.finish_requests(list(abort), ABORTED)
    return out, sched.update_from_output(out, ModelRunnerOutput(ids, [token] * len(ids)))


def rows(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request id, first position, number of tokens, sample) per row."""
    return list(zip(out.req_ids, out.num_computed_tokens, map(len, out.token_ids), out.sample))


def run_to_end(sched: Scheduler, max_steps: int = 200) -> dict[str, list[EngineCoreOutput]]:
    outputs: dict[str, list[EngineCoreOutput]] = defaultdict(list)
    for _ in range(max_steps):
        if not sched.has_requests():
            return outputs
        for o in step(sched)[1]:
            outputs[o.request_id].append(o)
    raise AssertionError("the workload did not finish")


def test_chunked_prefill_spreads_a_long_prompt_over_steps() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    r = make_request(20, max_tokens=2, request_id="a")
    sched.add_request(r)
    seen = [rows(step(sched)[0]) for _ in range(4)]
    assert seen == [
        [("a", 0, 8, False)],
        [("a", 8, 8, False)],
        [("a", 16, 4, True)],
        [("a", 20, 1, True)],
    ]
    assert r.status == RequestStatus.FINISHED_LENGTH and r.output_token_ids == [7, 7]
    assert not sched.has_requests() and sched.kv_cache.pool.num_free_blocks == 64


def test_decodes_and_prefill_chunks_share_a_step() -> None:
    sched = make_scheduler(block_size=4, max_num_batched_tokens=8)
    sched.add_request(make_request(4, max_tokens=10, request_id="dec"))
    step(sched)
    long = make_request(20, max_tokens=1, request_id="long")
    sched.add_request(long)
    out, _ = step(sched)
    assert rows(out) == [("dec", 4, 1, True), ("long", 0, 7, False)]
    assert (out.num_decode_tokens, out.num_prefill_tokens) == (1, 7)
    out, _ = step(sched)
    assert rows(out) == [("dec", 5, 1, True), ("long", 7, 7, False)]
    assert out.token_ids[1] == long.prompt_token_ids[7:14]


def test_budget_and_max_num_seqs_cap_admission() -> None:
    sched = make_scheduler(max_num_batched_tokens=10, max_num_seqs=2)
    reqs = [make_request(6, max_tokens=3) for _ in range(4)]
    for r in reqs:
        sched.add_request(r)
    out, _ = step(sched)
    assert [(rid, n) for rid, _, n, _ in rows(out)] == [
        (reqs[0].request_id, 6),
        (reqs[1].request_id, 4),
    ]
    assert len(sched.running) == 2 and sched.num_waiting == 2
    outputs = run_to_end(sched)
    assert all(len(r.output_token_ids) == 3 for r in reqs) and len(outputs) == 4


@pytest.mark.parametrize(("caching", "hit"), [(True, 16), (False, 0)])
def test_prefix_hits_count_as_computed(caching: bool, hit: int) -> None:
    sched = make_scheduler(block_size=4, enable_caching=caching)
    a = make_request(16, max_tokens=1)
    sched.add_request(a)
    step(sched)
    b = make_request([*a.prompt_token_ids, 1, 2, 3], max_tokens=1)
    sched.add_request(b)
    out, outputs = step(sched)
    assert rows(out) == [(b.request_id, hit, 19 - hit, True)]
    assert out.token_ids[0] == b.prompt_token_ids[hit:]
    assert out.num_prefix_hit_tokens == hit and b.num_cached_tokens == hit
    assert a.num_cached_tokens == 0
    assert outputs[0].num_cached_tokens == hit


def test_preempted_request_recomputes_and_finishes() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    a, b = make_request(6, max_tokens=6), make_request(6, max_tokens=6)
    sched.add_request(a)
    sched.add_request(b)
    assert [step(sched)[0].num_preemptions for _ in range(3)] == [0, 0, 0]
    out, _ = step(sched)  # A's ninth token needs a fifth block: B (admitted last) goes
    assert out.num_preemptions == 1 and out.req_ids == [a.request_id]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and b.request_id not in sched.kv_cache.req_blocks
    assert sched.num_preemptions_total == 1
    outputs = run_to_end(sched)
    for r in (a, b):
        assert r.output_token_ids == [7] * 6 and r.status == RequestStatus.FINISHED_LENGTH
        assert outputs[r.request_id][-1].finish_reason == FinishReason.LENGTH
    assert sched.kv_cache.pool.num_free_blocks == 4


def test_fcfs_preempts_the_latest_admitted() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4)
    a, b, c = make_request(4, max_tokens=8), make_request(3, max_tokens=8), make_request(3)
    for r in (a, b, c):
        sched.add_request(r)
    step(sched)
    out, _ = step(sched)  # A needs a second block; C, not B, is preempted
    assert out.num_preemptions == 1
    assert out.req_ids == [a.request_id, b.request_id]
    assert c.status == RequestStatus.PREEMPTED and b.status == RequestStatus.RUNNING
    assert list(sched.waiting) == [c]


def test_priority_admits_lower_value_first() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    prios = {"p5": 5, "p0": 0, "p5-late": 5, "p1": 1}
    for rid, prio in prios.items():
        sched.add_request(make_request(4, max_tokens=1, request_id=rid, priority=prio))
    order = [step(sched)[0].req_ids for _ in range(4)]
    assert order == [["p0"], ["p1"], ["p5"], ["p5-late"]]


@pytest.mark.parametrize(
    ("b_prio", "b_arrival", "c_prio", "c_arrival", "victim"),
    [(3, 10, 1, 20, "b"), (2, 10, 2, 5, "b"), (1, 10, 3, 20, "c")],
)
def test_priority_preempts_the_worst_priority_and_arrival(
    b_prio: int, b_arrival: int, c_prio: int, c_arrival: int, victim: str
) -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, policy="priority")
    reqs = {
        "a": make_request(2, max_tokens=8, request_id="a", arrival_ns=0),
        "b": make_request(2, max_tokens=8, request_id="b", priority=b_prio, arrival_ns=b_arrival),
        "c": make_request(3, max_tokens=8, request_id="c", priority=c_prio, arrival_ns=c_arrival),
    }
    for rid in "abc":  # admitted one step apart: running is [a, b, c]
        sched.add_request(reqs[rid])
        out, _ = step(sched)
        assert out.num_preemptions == 0
    out, _ = step(sched)  # a's fifth token needs a block
    assert out.num_preemptions == 1
    assert reqs[victim].status == RequestStatus.PREEMPTED
    assert out.req_ids == [rid for rid in "abc" if rid != victim]
    assert [r.request_id for r in sched.running] == out.req_ids


def test_preempting_an_already_scheduled_request_refunds_its_tokens() -> None:
    sched = make_scheduler(num_blocks=3, block_size=4, policy="priority")
    a = make_request(1, max_tokens=8, priority=5)
    b, c = make_request(3, max_tokens=8), make_request(2, max_tokens=8, priority=1)
    for r in (a, b, c):  # admitted one step apart: running is [a, b, c]
        sched.add_request(r)
        step(sched)
    sched.max_num_batched_tokens = 2
    out, _ = step(sched)  # a is scheduled, then b's fifth token needs a's only block
    assert out.num_preemptions == 1 and a.status == RequestStatus.PREEMPTED
    assert rows(out) == [(b.request_id, 4, 1, True), (c.request_id, 2, 1, True)]


def test_block_of_a_row_undone_by_preemption_is_not_a_prefix_hit() -> None:
    # Priority policy. In step 2, V's decode of position 3 completes V's block and
    # allocate_slots hashes it; then R's chunk finds no blocks, so V (worst priority,
    # already scheduled) and then R are preempted. V's row never runs: position 3 of
    # that block is never written, yet the block stays in the prefix cache.
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=9, policy="priority")
    sched.add_request(make_request(7, max_tokens=10))
    v = make_request(3, max_tokens=10, priority=5)
    sched.add_request(v)
    step(sched)
    sched.add_request(make_request(13, max_tokens=8, priority=3))
    step(sched)
    out, _ = step(sched)
    assert out.num_preemptions == 2 and v.all_token_ids[3:] == [7]
    w = make_request([*v.all_token_ids, 99], max_tokens=1)
    sched.add_request(w)
    out, _ = step(sched)
    assert w.request_id in out.req_ids
    assert out.num_prefix_hit_tokens == 0  # a hit would attend to KV never written


def test_abort_waiting_running_and_preempted_requests() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4, max_num_seqs=2)
    a, b, c = (make_request(6, max_tokens=6) for _ in range(3))
    for r in (a, b, c):
        sched.add_request(r)
    for _ in range(4):
        step(sched)
    statuses = [r.status for r in (a, b, c)]
    assert statuses == [RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.WAITING]
    ids = [a.request_id, b.request_id, c.request_id]
    done = sched.finish_requests([*ids, "unknown"], ABORTED)
    assert done == [a, b, c]
    for r in (a, b, c):
        assert r.status == ABORTED and r.status.finish_reason == FinishReason.ABORT
        assert r.request_id not in sched.kv_cache.req_blocks
    assert not sched.has_requests() and sched.num_waiting == 0 and sched.running == []
    assert sched.kv_cache.pool.num_free_blocks == 4
    assert sched.finish_requests(ids, ABORTED) == []  # already gone
    out = sched.schedule()
    assert out.req_ids == [] and sorted(out.finished_req_ids) == sorted(ids[:2])


def test_output_of_a_request_aborted_during_the_step_is_dropped() -> None:
    sched = make_scheduler()
    a, b = make_request(5), make_request(5)
    sched.add_request(a)
    sched.add_request(b)
    out, outputs = step(sched, abort=(a.request_id,))
    assert out.req_ids == [a.request_id, b.request_id]
    assert [o.request_id for o in outputs] == [b.request_id]
    assert a.output_token_ids == [] and a.status == ABORTED
    assert sched.kv_cache.block_ids(a.request_id) == []


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "stop_reason", "num_out"),
    [
        ({"max_tokens": 3}, [5, 5, 5, 5], FinishReason.LENGTH, None, 3),
        ({}, [5, 2, 5], FinishReason.STOP, None, 2),  # eos
        ({"stop_token_ids": [8]}, [5, 8, 5], FinishReason.STOP, 8, 2),
        ({"min_tokens": 3}, [2, 2, 2, 2], FinishReason.STOP, None, 3),
        ({"min_tokens": 3, "stop_token_ids": [8]}, [8, 8, 8], FinishReason.STOP, 8, 3),
        ({"max_tokens": 3, "ignore_eos": True}, [2, 2, 2, 2], FinishReason.LENGTH, None, 3),
    ],
)
def test_finish_reasons(
    params: dict[str, object],
    tokens: list[int],
    reason: FinishReason,
    stop_reason: int | None,
    num_out: int,
) -> None:
    sched = make_scheduler()
    r = make_request(5, eos_token_ids=(2,), **{"max_tokens": 9, **params})
    sched.add_request(r)
    outputs = []
    for tok in tokens:
        outputs += step(sched, token=tok)[1]
        if not sched.has_requests():
            break
    assert [o.finish_reason for o in outputs] == [None] * (num_out - 1) + [reason]
    assert outputs[-1].stop_reason == stop_reason
    assert r.output_token_ids == tokens[:num_out]
    assert not sched.has_requests() and sched.kv_cache.pool.num_free_blocks == 64


# -- property test -------------------------------------------------------------

LAST_EVENT = 15  # requests arrive and aborts happen at steps 0..LAST_EVENT
BANK = [list(range(100, 124)), list(range(100, 108)) + list(range(200, 216)), [3] * 24]


Workload = tuple[dict[str, Any], list[tuple[list[int], int, int, int]], list[tuple[int, int, bool]]]


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    """Scheduler kwargs; (prompt, max_tokens, priority, arrival step) each; (step, index, mid)."""
    bs = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 10))
    cap = num_blocks * bs
    reqs = []
    for _ in range(draw(st.integers(1, 8))):
        plen = draw(st.integers(1, min(24, cap - 1)))
        shared = draw(st.integers(0, plen))
        tail = draw(st.lists(st.integers(0, 2), min_size=plen - shared, max_size=plen - shared))
        prompt = BANK[draw(st.integers(0, 2))][:shared] + tail
        max_tokens = draw(st.integers(1, min(12, cap - plen)))  # prompt + max_tokens <= cap
        reqs.append((prompt, max_tokens, draw(st.integers(0, 2)), draw(st.integers(0, 6))))
    aborts = draw(
        st.lists(
            st.tuples(st.integers(0, LAST_EVENT), st.integers(0, len(reqs) - 1), st.booleans()),
            max_size=3,
        )
    )
    # KV groups (a sliding window frees blocks behind it): as many blocks per group as one
    # group would have, and the null block.
    windows = draw(st.sampled_from([(0,), (0,), (0, 3), (0, 5, 5), (4,)]))
    cfg = {
        "block_size": bs,
        "num_blocks": num_blocks * len(windows) + (1 if any(windows) else 0),
        "kv_windows": windows,
        "max_num_batched_tokens": draw(st.integers(1, 20)),
        "max_num_seqs": draw(st.integers(1, 5)),
        "policy": draw(st.sampled_from(["fcfs", "priority"])),
        "enable_caching": draw(st.booleans()),
    }
    return cfg, reqs, aborts


def sampled_token(r: Request) -> int:
    return 50 + r.num_tokens % 3  # a function of the sequence, so recomputation agrees


@settings(max_examples=200, deadline=None)
@given(w=workloads())
def test_random_workloads_run_to_completion(w: Workload) -> None:
    cfg, specs, aborts = w
    bs, budget, max_seqs = cfg["block_size"], cfg["max_num_batched_tokens"], cfg["max_num_seqs"]
    sched = make_scheduler(**cfg)
    kv, pool = sched.kv_cache, sched.kv_cache.pool
    reqs = [make_request(list(p), max_tokens=m, priority=prio) for p, m, prio, _ in specs]
    by_id = {r.request_id: r for r in reqs}
    arrive = {r.request_id: a for r, (_, _, _, a) in zip(reqs, specs)}
    tokens = {r.request_id: list(r.prompt_token_ids) for r in reqs}  # what each must contain
    slots: dict[int, list[int | None]] = {}  # the KV the "model" wrote in each block
    # Token identity, per request: each row of n tokens advances num_computed_tokens by n;
    # an admission starts it at the hit tokens h_k, a preemption drops it from c_k to 0. So
    #   sum(scheduled) == sum_k c_k + num_computed_at_end - sum_k h_k,
    # and a finished request ends at prompt + outputs - 1 (the last sample is never run):
    #   sum(scheduled) == prompt - h_0 + sum_k (c_k - h_{k+1}) + outputs - 1.
    scheduled: Counter[str] = Counter()
    computed_at_preempt: Counter[str] = Counter()
    hit: Counter[str] = Counter()
    first_hit: dict[str, int] = {}
    ever_scheduled: set[str] = set()
    reported_finished: set[str] = set()
    finished: set[str] = set()
    aborted: set[str] = set()

    def abort(step_no: int, mid_step: bool) -> None:
        for s, idx, mid in aborts:
            if s == step_no and mid == mid_step:
                for r in sched.finish_requests([reqs[idx].request_id], ABORTED):
                    assert r.status == ABORTED and r.request_id not in kv.req_blocks
                    aborted.add(rid := r.request_id)
                    assert (
                        scheduled[rid]
                        == computed_at_preempt[rid] + r.num_computed_tokens - hit[rid]
                    )

    for step_no in range(1000):
        for r in reqs:
            if arrive[r.request_id] == step_no:
                sched.add_request(r)
        abort(step_no, mid_step=False)
        if not sched.has_requests():
            if step_no > LAST_EVENT:
                break
            continue
        before = {
            rid: (r.status, r.num_computed_tokens, r.num_preemptions)
            for rid, r in sched.requests.items()
        }
        out = sched.schedule()
        reported_finished.update(out.finished_req_ids)

        # Budget, max_num_seqs, and block accounting.
        assert sum(len(t) for t in out.token_ids) == out.num_scheduled_tokens <= budget
        assert len(sched.running) <= max_seqs and len(set(out.req_ids)) == len(out.req_ids)
        assert set(kv.req_blocks) == {r.request_id for r in sched.running}
        null = kv.null_block
        holders = Counter(
            b.block_id for g in kv.req_blocks.values() for row in g for b in row if b is not null
        )
        for blk in pool.blocks:
            if blk is null:
                continue
            assert blk.ref_cnt == holders[blk.block_id]
            assert (blk.block_id in pool._free) == (blk.ref_cnt == 0)
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks

        # Preemptions and admissions seen from the requests.
        victims = [rid for rid, b in before.items() if sched.requests[rid].num_preemptions > b[2]]
        assert len(victims) == out.num_preemptions
        for rid in victims:
            assert sched.requests[rid].status == RequestStatus.PREEMPTED
            computed_at_preempt[rid] += before[rid][1]
        admitted = [
            r
            for rid, r in sched.requests.items()
            if before[rid][0] != RequestStatus.RUNNING and r.status == RequestStatus.RUNNING
        ]
        assert not (admitted and out.num_preemptions)
        assert sum(r.num_computed_tokens for r in admitted) == out.num_prefix_hit_tokens
        for r in admitted:
            assert r.num_computed_tokens % bs == 0 and r.num_computed_tokens < r.num_tokens
            hit[r.request_id] += r.num_computed_tokens
            first_hit.setdefault(r.request_id, r.num_computed_tokens)
            assert r.num_cached_tokens == first_hit[r.request_id]

        # Rows: the right tokens, a block table per group that covers them, and KV the model
        # wrote (each group into its own blocks).
        windows = cfg["kv_windows"]
        group_tables = out.group_block_tables or [[] for _ in out.req_ids]
        rows = list(zip(out.req_ids, out.num_computed_tokens, out.token_ids, out.block_tables,
                        group_tables, out.sample))  # fmt: skip
        for rid, start, toks, table, others, sample in rows:
            r = sched.requests[rid]
            assert r.status == RequestStatus.RUNNING and start == r.num_computed_tokens
            assert toks and toks == tokens[rid][start : start + len(toks)]
            assert [table, *others] == kv.block_tables(rid) and len(others) == len(windows) - 1
            assert all(len(t) * bs >= start + len(toks) for t in (table, *others))
            assert sample == (start + len(toks) == len(tokens[rid]))
            for t in (table, *others):
                for pos, tok in enumerate(toks, start):
                    assert null is None or t[pos // bs] != null.block_id  # written: not null
                    slots.setdefault(t[pos // bs], [None] * bs)[pos % bs] = tok
            ever_scheduled.add(rid)
        for rid, start, toks, table, others, _ in rows:
            end = start + len(toks)
            for t, window in zip((table, *others), windows):
                # What the row's first query reads: all of it, or its window.
                lo = max(0, start - window + 1) if window else 0
                seen = [slots.get(t[p // bs], [None] * bs)[p % bs] for p in range(lo, end)]
                assert seen == tokens[rid][lo:end], f"{rid} attends to KV it does not own"

        abort(step_no, mid_step=True)
        picks = {rid: sampled_token(by_id[rid]) for rid, s in zip(out.req_ids, out.sample) if s}
        for rid, toks in zip(out.req_ids, out.token_ids):
            if rid not in aborted:
                scheduled[rid] += len(toks)
        results = sched.update_from_output(out, ModelRunnerOutput([*picks], [*picks.values()]))
        assert [o.request_id for o in results] == [rid for rid in picks if rid not in aborted]
        for o in results:
            r = by_id[rid := o.request_id]
            assert o.new_token_ids == [picks[rid]]
            tokens[rid].append(picks[rid])
            if o.finish_reason is not None:
                num_out = len(tokens[rid]) - r.num_prompt_tokens
                assert o.finish_reason == FinishReason.LENGTH
                assert num_out == r.max_tokens and r.output_token_ids == tokens[rid][-num_out:]
                assert r.num_computed_tokens == r.num_tokens - 1
                assert rid not in sched.requests and rid not in kv.req_blocks
                recomputed = computed_at_preempt[rid] - (hit[rid] - first_hit[rid])
                expect = r.num_prompt_tokens - first_hit[rid] + recomputed + num_out - 1
                assert scheduled[rid] == expect
                finished.add(rid)
    else:
        raise AssertionError("the workload did not finish in 1000 steps")

    assert finished | aborted == {r.request_id for r in reqs} and not finished & aborted
    assert kv.num_used_blocks == 0 and kv.req_blocks == {}
    assert sched.running == [] and sched.num_waiting == 0
    last = sched.schedule()
    assert last.req_ids == []
    assert reported_finished | set(last.finished_req_ids) == ever_scheduled


def test_a_request_whose_drafts_are_refused_sits_out_speculation_then_tries_again() -> None:
    """Drafts scheduled after the last token, refused (kept share averaged, each step halving
    the weight of those before): under SPEC_MIN_RATE the request proposes none for
    SPEC_PAUSE_STEPS steps, then verifies drafts again."""
    from engine.core.scheduler import SPEC_PAUSE_STEPS
    from engine.spec_config import parse

    sched = make_scheduler(block_size=4)
    sched.speculative = parse('{"method": "ngram", "num_speculative_tokens": 3}')
    sched.spec_max_rows = 4
    r = make_request(8, max_tokens=200, request_id="a")
    sched.add_request(r)
    verified = []
    for _ in range(40):
        out = sched.schedule()
        verified.append(len(out.spec_token_ids.get("a", ())))
        assert ("a" in out.no_drafts) == (r.spec_pause > 0)
        runner = ModelRunnerOutput(["a"], [7], draft_token_ids={"a": [1, 2, 3]})  # never kept
        sched.update_from_output(out, runner)
        assert r.num_computed_tokens == r.num_tokens - 1  # refused drafts rewound
    print(f"drafts verified per step: {verified}")
    first = verified.index(0, 1)  # the first step after prefill has none yet
    assert verified[1:first] == [3] * (first - 1) and first <= 5
    assert verified[first : first + SPEC_PAUSE_STEPS] == [0] * SPEC_PAUSE_STEPS
    assert verified[first + SPEC_PAUSE_STEPS + 1] == 3  # tried again
