"""The `fair` scheduler: fcfs with one tenant; with several, a tenant that fills the engine
gives a slot to another tenant's request at the next step."""

from __future__ import annotations

from pagedserve import SamplingParams
from pagedserve.common.contracts import Request, RequestStatus, RunnerOutput
from pagedserve.common.engine_config import EngineConfig
from pagedserve.engine.kv_cache_manager import KVCacheManager
from pagedserve.plugins.fair_scheduler import FairScheduler
from pagedserve.plugins.fcfs_scheduler import FCFSScheduler

GREEDY = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)


def make(cls=FairScheduler, num_blocks=64, budget=64, max_seqs=4):
    kv = KVCacheManager(num_blocks, 4, enable_caching=True, model_id="m")
    return cls(EngineConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, block_size=4), kv)


def req(rid, t, tenant=None, n_prompt=3):
    start = 1 + 1000 * int(t)
    return Request(rid, list(range(start, start + n_prompt)), GREEDY, frozenset(), max_tokens=100, arrival_time=t,
                   tenant=tenant)


def step(s, token=7):
    out = s.schedule()
    s.update(out, RunnerOutput([[token] if e.request.num_computed_tokens + e.num_new_tokens == e.request.num_tokens
                                else [] for e in out.scheduled], None))
    return out


def trace(cls, requests, late=(), steps=4):
    """The scheduled ids of each step; `late` requests arrive after the first step."""
    s = make(cls)
    for r in requests:
        s.add_request(r)
    history = [[e.request.request_id for e in step(s).scheduled]]
    for r in late:
        s.add_request(r)
    for _ in range(steps - 1):
        history.append([e.request.request_id for e in step(s).scheduled])
    return s, history


def test_one_tenant_is_scheduled_exactly_as_fcfs():
    def requests():
        return [req(f"a{i}", float(i), "A") for i in range(6)]

    _, fair = trace(FairScheduler, requests(), late=[req("a9", 9.0, "A")], steps=6)
    _, fcfs = trace(FCFSScheduler, requests(), late=[req("a9", 9.0, "A")], steps=6)
    assert fair == fcfs and fair[0] == ["a0", "a1", "a2", "a3"]


def test_a_flooding_tenant_gives_a_slot_to_another_at_the_next_step():
    s, history = trace(FairScheduler, [req(f"a{i}", float(i), "A") for i in range(6)], late=[req("b0", 10.0, "B")])
    assert history[0] == ["a0", "a1", "a2", "a3"]  # A alone takes every slot
    # B arrives: A's newest running request makes room, B runs at once
    assert history[1] == ["a0", "a1", "a2", "b0"]
    assert s.requests["a3"].status == RequestStatus.PREEMPTED and s.requests["a3"].num_preemptions == 1
    # and B keeps its slot: A's waiting requests wait for A's own slots
    assert history[2] == history[3] == ["a0", "a1", "a2", "b0"]


def test_fcfs_makes_the_other_tenant_wait():
    _, history = trace(FCFSScheduler, [req(f"a{i}", float(i), "A") for i in range(6)], late=[req("b0", 10.0, "B")])
    assert all("b0" not in ids for ids in history)


def test_shares_split_the_slots_and_waiting_tenants_below_share_go_first():
    s = make(max_seqs=4)
    for i in range(4):
        s.add_request(req(f"a{i}", float(i), "A"))
    step(s)
    for i in range(3):
        s.add_request(req(f"b{i}", 10.0 + i, "B"))
    out = step(s)
    # two tenants: a share of 2 slots each; A gives up its two newest
    assert [r.request_id for r in out.preempted] == ["a3", "a2"]
    assert sorted(e.request.request_id for e in out.scheduled) == ["a0", "a1", "b0", "b1"]
    assert [r.request_id for r in s.waiting] == ["b2", "a2", "a3"]
    out = step(s)
    assert out.preempted == [] and sorted(e.request.request_id for e in out.scheduled) == ["a0", "a1", "b0", "b1"]
