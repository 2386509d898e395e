"""The adapter manager under churn: more adapters than GPU slots.

An engine-like loop drives it: each step applies fetches (prepare), admits waiting requests
in arrival order (try_bind, as the scheduler does) up to a batch size, and ends running
requests after their length. Checked: no waiting request starves while other adapters are
busy without pause, adapters of waiting requests are fetched no deeper than host memory and
copied to a GPU slot ahead of their admission where one is free or idle, never over an older
waiting request's, and the eviction policies pick what they say.
"""
from __future__ import annotations

import random
import time

import pytest

from pool_support import load, make_manager, request


class Loop:
    """Requests through the manager the way the engine's scheduler admits them: in arrival
    order, skipping those whose adapter cannot bind, at most `max_running` at once."""

    def __init__(self, manager, max_running: int = 1 << 30) -> None:
        self.m = manager
        self.max_running = max_running
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
        for req in list(self.waiting):
            if len(self.running) < self.max_running and self.m.try_bind(req):
                self.waiting.remove(req)
                self.running[req] = req.steps
                self.bound_at[req] = self.step_no
        self.m.check_consistency(list(self.running))
        assert sum(1 for e in self.m.slots if e is not None) <= self.m.max_loras

    def waited(self, req) -> int:
        return self.bound_at[req] - self.arrived_at[req]


def test_a_cold_adapter_gets_the_slot_of_a_hot_one_that_never_pauses() -> None:
    """One GPU slot: a hot adapter's requests overlap without a gap, so it always has running
    ones. The cold request drains it (no new binds), gets the slot once the hot requests
    already running end, and no younger hot request overtakes it."""
    m, _ = make_manager(["hot", "cold"], max_loras=1)
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
    assert hot_after, "the hot adapter came back after the cold one"
    assert all(loop.bound_at[r] >= loop.bound_at[cold] for r in hot_after), \
        "a younger hot request overtook the cold one"
    assert m.counters("hot").evictions["gpu"] >= 1


def test_two_cold_adapters_take_turns_while_every_slot_stays_busy() -> None:
    """Two slots, both held by adapters that never pause, two cold adapters arriving: each
    cold one is served within the running requests of the slot it drains, one drain at a
    time, in arrival order."""
    m, _ = make_manager(["h0", "h1", "c0", "c1"], max_loras=2)
    loop = Loop(m)
    for _ in range(3):
        loop.submit("h0", steps=3)
        loop.submit("h1", steps=3)
        loop.step()
    c0, c1 = loop.submit("c0", steps=2), loop.submit("c1", steps=2)
    for _ in range(20):
        loop.submit("h0", steps=3)
        loop.submit("h1", steps=3)
        loop.step()
    assert c0 in loop.bound_at and c1 in loop.bound_at, "a cold adapter starved"
    assert loop.bound_at[c0] <= loop.bound_at[c1]
    assert loop.waited(c1) <= 2 * (3 + 1)   # at worst each waits out one drain
    assert all(r in loop.bound_at for r in list(loop.arrived_at)[:-4])  # the hot ones come back


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_random_churn_serves_every_request_oldest_first(policy: str) -> None:
    """Zipf-like traffic over eight adapters of mixed ranks, three GPU slots and a batch of
    four: every request is served, none waits longer than the bound that oldest-first
    service gives, every request is counted in one tier, and reference counts match the
    running requests after every step (check_consistency)."""
    rng = random.Random(7)
    names = [f"a{i}" for i in range(8)]
    ranks = {n: [1, 2, 4, 8][i % 4] for i, n in enumerate(names)}
    m, _ = make_manager(names, max_loras=3, max_cpu=4, ranks=ranks, eviction=policy)
    loop = Loop(m, max_running=4)
    weights = [1 / (k + 1) for k in range(len(names))]
    submitted = []
    for _ in range(120):
        for _ in range(rng.choice([0, 1, 1, 2])):
            submitted.append(loop.submit(rng.choices(names, weights)[0], steps=rng.randint(1, 4)))
        loop.step()
    for _ in range(400):
        if not loop.waiting and not loop.running:
            break
        loop.step()
    assert not loop.waiting and not loop.running
    assert m.stats["evictions"] > 0
    longest = max(loop.waited(r) for r in submitted)
    # Oldest first: a request waits for the requests ahead of it (at most a batch's worth of
    # steps each) and for the adapters ahead of it, each at most one request length to drain
    # what it displaces and a step to copy.
    assert longest <= len(names) * (4 + 2) + 4 * 4, longest
    assert m.tier_hits["gpu"] > 0 and m.tier_hits["host"] + m.tier_hits["store"] > 0
    assert sum(m.tier_hits.values()) == len(submitted)
    assert all(e.refs == 0 and not e.draining for e in m.slots if e is not None)


def test_waiting_adapters_are_copied_to_free_slots_ahead_of_their_admission() -> None:
    """A batch of one held by a long request: the adapters of the requests waiting behind it
    are fetched and copied to free GPU slots before they can be admitted, and are then
    admitted in arrival order."""
    m, _ = make_manager(["busy", "b", "c"], max_loras=3)
    loop = Loop(m, max_running=1)
    loop.submit("busy", steps=6)
    loop.step()
    b, c = loop.submit("b", steps=1), loop.submit("c", steps=1)
    loop.step()
    assert b not in loop.bound_at and c not in loop.bound_at
    assert m.current["b"].resident and m.current["c"].resident  # on the GPU before admission
    assert m.current["busy"].refs == 1 and not m.current["busy"].draining
    for _ in range(12):
        loop.step()
    assert b in loop.bound_at and c in loop.bound_at
    assert loop.bound_at[b] <= loop.bound_at[c]


def test_promotion_takes_idle_slots_only_and_never_an_older_waiting_requests() -> None:
    """Three slots: a running adapter and two idle ones that the two oldest waiting requests
    want. A younger waiting adapter is not copied over the idle two: it drains the running
    one instead, whose request is not cut short, and everyone is served."""
    m, _ = make_manager(["busy", "x", "y", "z"], max_loras=3)
    load(m, "x")
    load(m, "y")
    loop = Loop(m, max_running=1)
    busy = loop.submit("busy", steps=8)             # the last free slot: x and y stay
    loop.step()
    assert m.current["x"].resident and m.current["y"].resident and m.current["busy"].refs == 1
    x, y, z = loop.submit("x", 1), loop.submit("y", 1), loop.submit("z", 1)
    loop.step()
    assert m.current["x"].resident and m.current["y"].resident, "evicted for a younger waiting adapter"
    assert m.current["busy"].draining and m.current["z"].slot < 0
    for _ in range(30):
        loop.step()
    assert all(r in loop.bound_at for r in (x, y, z))
    assert busy not in loop.running and loop.bound_at[busy] == 1
    assert loop.bound_at[x] < loop.bound_at[y] < loop.bound_at[z]


def test_idle_adapters_are_evicted_for_waiting_ones_without_draining_running_ones() -> None:
    """Two slots: one adapter running, one idle that nobody waits for. A waiting adapter takes
    the idle one's slot at once; the running one keeps taking new requests."""
    m, _ = make_manager(["run", "idle", "new"], max_loras=2)
    load(m, "idle")
    loop = Loop(m)
    loop.submit("run", steps=5)
    loop.step()
    new = loop.submit("new", steps=1)
    more = loop.submit("run", steps=1)
    loop.step()
    assert loop.bound_at.get(new) == 2 and loop.bound_at.get(more) == 2
    assert "idle" not in m.current or m.current["idle"].slot < 0
    assert not m.current["run"].draining


@pytest.mark.parametrize("policy, evicted", [("lru", "first"), ("gdsf", "last")])
@pytest.mark.parametrize("first, last", [
    ({"requests": 5, "rank": 4}, {"requests": 1, "rank": 4}),   # frequency alone differs
    ({"requests": 1, "rank": 8}, {"requests": 1, "rank": 1}),   # reload bytes alone differ
], ids=["frequency", "bytes"])
def test_eviction_policy_picks_by_recency_or_by_requests_and_reload_bytes(
        policy: str, evicted: str, first: dict, last: dict) -> None:
    """Two slots: an adapter used first, then one used last, then a newcomer needs a slot.
    LRU evicts the one used first; GreedyDual-Size-Frequency the one worth less requests x
    bytes to reload (the first has more requests, or more bytes)."""
    ranks = {"first": first["rank"], "last": last["rank"], "new": 2}
    m, _ = make_manager(list(ranks), max_loras=2, ranks=ranks, eviction=policy)
    loop = Loop(m)
    for name, spec in (("first", first), ("last", last)):
        for _ in range(spec["requests"]):
            loop.submit(name, steps=1)
            loop.step()
    for _ in range(2):
        loop.step()
    loop.submit("new", steps=1)
    for _ in range(3):
        loop.step()
    assert m.current["new"].slot >= 0
    resident = {e.name for e in m.slots if e is not None}
    assert resident == {"new", ({"first", "last"} - {evicted}).pop()}, resident


def test_host_prefetch_goes_no_deeper_than_host_memory() -> None:
    """Host memory for two adapters, one GPU slot held by a long request: of five waiting
    adapters only the two oldest are fetched ahead; each later one is fetched once, in turn,
    as the ones ahead of it are served (no host copy is fetched twice)."""
    names = ["busy", "w0", "w1", "w2", "w3", "w4"]
    m, source = make_manager(names, max_loras=1, max_cpu=2)
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


def test_pinned_slots_everywhere_fail_waiting_requests_with_an_actionable_error() -> None:
    """Every slot pinned: a waiting adapter can never get one, so its request fails naming
    --max-loras instead of waiting forever."""
    m, _ = make_manager(["p0", "p1", "other"], max_loras=2)
    load(m, "p0", pin=True)
    load(m, "p1", pin=True)
    req = request("other")
    deadline = time.monotonic() + 10
    failures = []
    while not failures:
        assert time.monotonic() < deadline, "no failure reported"
        m.prepare([req])
        failures = m.collect_failures([req])
        time.sleep(0.002)
    assert failures[0][0] is req and "--max-loras" in str(failures[0][1])
