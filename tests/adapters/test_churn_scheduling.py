"""The adapter manager under churn: more adapters than GPU memory and places in a step.

An engine-like loop drives it: each step applies fetches (prepare), admits waiting requests
in arrival order (try_bind, as the scheduler does), and ends running requests after their
length. Checked: no waiting request starves while other adapters are busy without pause
(places in a step, memory), adapters of waiting requests are promoted to the GPU ahead of
their admission where memory allows, the eviction policies pick what they say, and the
arenas always hold exactly the resident adapters' own sizes.
"""
from __future__ import annotations

import random
import time

import pytest

from pool_support import load, make_manager, pump, request


class Loop:
    """Requests through the manager the way the engine's scheduler admits them."""

    def __init__(self, manager) -> None:
        self.m = manager
        self.waiting: list = []
        self.running: dict = {}          # request -> steps left
        self.bound_at: dict = {}         # request -> step it was admitted
        self.arrived_at: dict = {}
        self.step_no = 0

    def submit(self, adapter: str, steps: int):
        req = request(adapter)
        req.steps = steps
        self.waiting.append(req)
        self.arrived_at[req] = self.step_no
        return req

    def step(self) -> None:
        self.step_no += 1
        for req in list(self.running):   # a step's tokens: running requests progress, some end
            self.running[req] -= 1
            if self.running[req] == 0:
                del self.running[req]
                self.m.release(req)
        self.m.prepare(self.waiting)
        deadline = time.monotonic() + 10
        while self.m.jobs:               # the fake source's fetches (a thread): wait for them
            assert time.monotonic() < deadline, "adapter fetch did not finish"
            time.sleep(0.002)
            self.m.prepare(self.waiting)
        for req in list(self.waiting):   # admission in arrival order, skipping the unbindable
            if self.m.try_bind(req):
                self.waiting.remove(req)
                self.running[req] = req.steps
                self.bound_at[req] = self.step_no
        self.m.check_consistency(list(self.running))

    def waited(self, req) -> int:
        return self.bound_at[req] - self.arrived_at[req]


def test_a_cold_adapter_gets_a_place_in_steps_while_a_hot_one_never_pauses() -> None:
    """One place in a step (max_loras 1), memory for both: a hot adapter's requests overlap
    without a gap, so it always has running ones. The cold request is served once the hot
    adapter's requests already running end; the hot one's newer requests wait meanwhile."""
    m, _ = make_manager(["hot", "cold"], max_loras=1, rows=8)
    loop = Loop(m)
    for _ in range(3):
        loop.submit("hot", steps=4)
        loop.step()
    cold = loop.submit("cold", steps=2)
    for _ in range(12):
        loop.submit("hot", steps=4)
        loop.step()
    assert cold in loop.bound_at, "the cold adapter starved"
    assert loop.waited(cold) <= 4 + 1   # the hot requests running when it arrived, then its turn
    hot_after = [r for r in loop.bound_at if r.adapter == "hot" and loop.arrived_at[r] > loop.arrived_at[cold]]
    assert all(loop.bound_at[r] >= loop.bound_at[cold] for r in hot_after), \
        "a younger hot request overtook the cold one"


def test_a_cold_adapter_gets_memory_from_a_hot_one_that_never_pauses() -> None:
    """Memory for one adapter (4 rank rows, rank 4 each): the hot adapter is drained (no new
    requests), evicted once its running ones end, and the cold one is promoted and served."""
    m, _ = make_manager(["hot", "cold"], max_loras=2, rows=4)
    loop = Loop(m)
    for _ in range(3):
        loop.submit("hot", steps=3)
        loop.step()
    cold = loop.submit("cold", steps=2)
    for _ in range(10):
        loop.submit("hot", steps=3)
        loop.step()
    assert cold in loop.bound_at, "the cold adapter starved"
    assert loop.waited(cold) <= 3 + 2   # the hot ones running end, a step to copy, admitted
    assert m.counters("hot").evictions["gpu"] >= 1
    assert m.buffers.used_nbytes() <= m.buffers.nbytes()


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_random_churn_serves_every_request_oldest_first(policy: str) -> None:
    """Zipf-like traffic over eight adapters of mixed ranks, memory for about a third of them
    and two places a step: every request is served, none waits longer than the bound that
    oldest-first service gives, and the arenas hold exactly the resident adapters' rows after
    every step (check_consistency)."""
    rng = random.Random(7)
    names = [f"a{i}" for i in range(8)]
    ranks = {n: [1, 2, 4, 8][i % 4] for i, n in enumerate(names)}
    m, _ = make_manager(names, max_loras=2, rows=12, ranks=ranks, eviction=policy)
    loop = Loop(m)
    weights = [1 / (k + 1) for k in range(len(names))]
    submitted = []
    for _ in range(120):
        for _ in range(rng.choice([0, 1, 1, 2])):
            submitted.append(loop.submit(rng.choices(names, weights)[0], steps=rng.randint(1, 4)))
        loop.step()
    for _ in range(200):
        if not loop.waiting and not loop.running:
            break
        loop.step()
    assert not loop.waiting and not loop.running
    longest = max(loop.waited(r) for r in submitted)
    # Oldest first: a request waits for the distinct adapters ahead of it, each at most one
    # request length (4 steps) to drain what it displaces, a step to copy and a step to bind.
    assert longest <= len(names) * (4 + 2), longest
    assert m.tier_hits["gpu"] > 0 and m.tier_hits["host"] + m.tier_hits["store"] > 0
    assert sum(m.tier_hits.values()) == len(submitted)


def test_waiting_adapters_are_promoted_ahead_of_their_admission() -> None:
    """While one adapter holds the only place in a step, the adapters of the requests waiting
    behind it are fetched and copied to the GPU (memory allows) before they can be admitted."""
    m, source = make_manager(["busy", "b", "c"], max_loras=1, rows=12)
    loop = Loop(m)
    loop.submit("busy", steps=6)
    loop.step()
    b, c = loop.submit("b", steps=1), loop.submit("c", steps=1)
    loop.step()
    assert b not in loop.bound_at and c not in loop.bound_at
    assert m.current["b"].resident and m.current["c"].resident  # on the GPU before admission
    for _ in range(12):
        loop.step()
    assert b in loop.bound_at and c in loop.bound_at
    assert loop.bound_at[b] <= loop.bound_at[c]


def test_prefetch_never_evicts_what_an_older_waiting_request_wants() -> None:
    """Memory for three adapters: a running one and two idle ones wanted by the two oldest
    waiting requests. A younger waiting adapter is not promoted over the idle two (it drains
    the running one instead)."""
    m, _ = make_manager(["busy", "x", "y", "z"], max_loras=1, rows=12)
    load(m, "x")
    load(m, "y")
    loop = Loop(m)
    loop.submit("busy", steps=8)             # the last free rows: x and y stay
    loop.step()
    assert m.current["x"].resident and m.current["y"].resident and m.current["busy"].refs == 1
    x, y, z = loop.submit("x", 1), loop.submit("y", 1), loop.submit("z", 1)
    loop.step()
    for name in ("x", "y"):
        entry = m.current[name]
        assert entry.resident or entry.refs, f"{name} was evicted for a younger waiting adapter"
    for _ in range(30):
        loop.step()
    assert all(r in loop.bound_at for r in (x, y, z))


@pytest.mark.parametrize("policy, evicted", [("lru", "small"), ("gdsf", "big")])
def test_eviction_policy_picks_by_recency_or_by_requests_per_byte(policy: str, evicted: str) -> None:
    """A small adapter with many requests, used first; a big one with one request, used last;
    then a newcomer needs room. LRU evicts the small one (least recent); GreedyDual-Size-
    Frequency the big one (fewest requests per byte)."""
    ranks = {"small": 2, "big": 6, "new": 2}
    m, _ = make_manager(list(ranks), max_loras=2, rows=8, ranks=ranks, eviction=policy)
    loop = Loop(m)
    for _ in range(5):
        loop.submit("small", steps=1)
        loop.step()
    loop.submit("big", steps=1)
    for _ in range(3):
        loop.step()
    loop.submit("new", steps=1)
    for _ in range(3):
        loop.step()
    assert m.current["new"].slot >= 0
    resident = {e.name for e in m.slots if e is not None}
    assert evicted not in resident and ({"small", "big"} - {evicted}) <= resident


def test_memory_used_is_the_sum_of_the_resident_adapters_own_sizes() -> None:
    """Mixed ranks take their own rank rows: the allocator's bytes in use equal, after every
    load and eviction, the sum over resident adapters of rank x (in + out) x layers x bytes,
    computed from the model's shapes, with no padding to the largest rank."""
    from pool_support import CONFIG

    ranks = {"r1": 1, "r2": 2, "r8": 8, "r3": 3, "r5": 5}
    m, _ = make_manager(list(ranks), max_loras=2, rows=12, ranks=ranks)
    fan_in, fan_out = CONFIG.module_shapes()["q_proj"]
    for name in ["r1", "r8", "r2", "r3", "r5", "r8", "r1"]:
        load(m, name)
        resident = [e for e in m.slots if e is not None]
        own = sum(ranks[e.name] * (fan_in + fan_out) * CONFIG.num_layers * 4 for e in resident)
        assert m.buffers.used_nbytes() == own
        assert m.buffers.arenas["q_proj"].used == sum(ranks[e.name] for e in resident) <= 12
        assert all(a.used == 0 for mod, a in m.buffers.arenas.items() if mod != "q_proj")
    assert m.stats["evictions"] > 0


def test_host_prefetch_goes_no_deeper_than_host_memory() -> None:
    """Host memory for two adapters, one place in a step held by a long request: of five
    waiting adapters only the two oldest are fetched ahead; each later one is fetched once,
    in turn, as the ones ahead of it are served (no host copy is fetched twice)."""
    names = ["busy", "w0", "w1", "w2", "w3", "w4"]
    m, source = make_manager(names, max_loras=1, max_cpu=2, rows=4)
    loop = Loop(m)
    loop.submit("busy", steps=6)
    loop.step()
    waiting = [loop.submit(n, steps=1) for n in names[1:]]
    loop.step()
    assert [n for n, _ in source.loads] == ["busy", "w0", "w1"]
    for _ in range(40):
        loop.step()
    assert all(r in loop.bound_at for r in waiting)
    assert [loop.bound_at[r] for r in waiting] == sorted(loop.bound_at[r] for r in waiting)
    assert [n for n, _ in source.loads] == names
