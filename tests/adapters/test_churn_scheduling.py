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

from pool_support import load, make_manager, request


class Loop:
    """Requests through the manager the way the engine's scheduler admits them."""

    def __init__(self, manager, max_running: int = 1 << 30) -> None:
        self.m = manager
        self.max_running = max_running   # the batch's size: a full batch admits no one
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

    def hot_steps(self, hot: list[str], steps: int, rounds: int) -> None:
        """`rounds` steps, each after a new request of every hot adapter (they never pause)."""
        for _ in range(rounds):
            for adapter in hot:
                self.submit(adapter, steps=steps)
            self.step()

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
            if len(self.running) < self.max_running and self.m.try_bind(req):
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
    loop.hot_steps(["hot"], steps=4, rounds=3)
    cold = loop.submit("cold", steps=2)
    loop.hot_steps(["hot"], steps=4, rounds=12)
    assert cold in loop.bound_at, "the cold adapter starved"
    assert loop.waited(cold) <= 4 + 1   # the hot requests running when it arrived, then its turn
    hot_after = [r for r in loop.bound_at if r.adapter == "hot" and loop.arrived_at[r] > loop.arrived_at[cold]]
    assert hot_after, "the hot adapter came back after the cold one"
    assert all(loop.bound_at[r] >= loop.bound_at[cold] for r in hot_after), \
        "a younger hot request overtook the cold one"


def test_a_cold_adapter_gets_memory_from_a_hot_one_that_never_pauses() -> None:
    """Memory for one adapter (4 rank rows, rank 4 each): the hot adapter is drained (no new
    requests), evicted once its running ones end, and the cold one is promoted and served."""
    m, _ = make_manager(["hot", "cold"], max_loras=2, rows=4)
    loop = Loop(m)
    loop.hot_steps(["hot"], steps=3, rounds=3)
    cold = loop.submit("cold", steps=2)
    loop.hot_steps(["hot"], steps=3, rounds=10)
    assert cold in loop.bound_at, "the cold adapter starved"
    assert loop.waited(cold) <= 3 + 2   # the hot ones running end, a step to copy, admitted
    assert m.counters("hot").evictions["gpu"] >= 1
    assert m.buffers.used_nbytes() <= m.buffers.nbytes()


def test_two_cold_adapters_take_turns_while_every_adapter_stays_busy() -> None:
    """Memory and places for two adapters, both held by adapters that never pause, two cold
    adapters arriving: each cold one is served within the running requests of the adapter it
    drains, one drain at a time, in arrival order, and the hot ones come back."""
    m, _ = make_manager(["h0", "h1", "c0", "c1"], max_loras=2, rows=8)
    loop = Loop(m)
    loop.hot_steps(["h0", "h1"], steps=3, rounds=3)
    c0, c1 = loop.submit("c0", steps=2), loop.submit("c1", steps=2)
    loop.hot_steps(["h0", "h1"], steps=3, rounds=20)
    assert c0 in loop.bound_at and c1 in loop.bound_at, "a cold adapter starved"
    assert loop.bound_at[c0] <= loop.bound_at[c1]
    assert loop.waited(c1) <= 2 * (3 + 1)   # at worst each waits out one drain
    assert all(r in loop.bound_at for r in list(loop.arrived_at)[:-4])  # the hot ones come back


# (max_loras, rows, max_cpu, batch, the longest wait beyond the adapters ahead): memory for
# about a third of the adapters and two places a step, unbounded batch; or memory for about
# 40% of them, three places and a batch of four (a request also waits out the batches ahead).
CHURN_SETUPS = {"memory-bound": (2, 12, 8, 1 << 30, 0), "batch-bound": (3, 12, 4, 4, 4 * 4)}


@pytest.mark.parametrize("setup", list(CHURN_SETUPS))
@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_random_churn_serves_every_request_oldest_first(policy: str, setup: str) -> None:
    """Zipf-like traffic over eight adapters of mixed ranks: every request is served, none
    waits longer than the bound that oldest-first service gives, every request is counted in
    one tier, and reference counts and the arenas (exactly the resident adapters' rows) are
    checked after every step (check_consistency)."""
    max_loras, rows, max_cpu, batch, batch_wait = CHURN_SETUPS[setup]
    rng = random.Random(7)
    names = [f"a{i}" for i in range(8)]
    ranks = {n: [1, 2, 4, 8][i % 4] for i, n in enumerate(names)}
    m, _ = make_manager(names, max_loras=max_loras, max_cpu=max_cpu, rows=rows, ranks=ranks,
                        eviction=policy)
    loop = Loop(m, max_running=batch)
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
    # Oldest first: a request waits for the distinct adapters ahead of it, each at most one
    # request length (4 steps) to drain what it displaces, a step to copy and a step to bind
    # (and, with a batch cap, for the batches ahead of it).
    assert longest <= len(names) * (4 + 2) + batch_wait, longest
    assert m.tier_hits["gpu"] > 0 and m.tier_hits["host"] + m.tier_hits["store"] > 0
    assert sum(m.tier_hits.values()) == len(submitted)
    assert all(e.refs == 0 and not e.draining for e in m.slots if e is not None)


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


def test_waiting_adapters_are_copied_to_free_memory_ahead_of_their_admission() -> None:
    """A batch of one held by a long request, memory and places for three: the adapters of
    the requests waiting behind it are fetched and copied to free rows before they can be
    admitted, without draining the running one, and are then admitted in arrival order."""
    m, _ = make_manager(["busy", "b", "c"], max_loras=3, rows=12)
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


def test_promotion_takes_idle_memory_only_and_never_an_older_waiting_requests() -> None:
    """Memory for three adapters, a batch of one: a running adapter and two idle ones that
    the two oldest waiting requests want. A younger waiting adapter is not copied over the
    idle two: it drains the running one instead, whose request is not cut short, and
    everyone is served in arrival order."""
    m, _ = make_manager(["busy", "x", "y", "z"], max_loras=3, rows=12)
    load(m, "x")
    load(m, "y")
    loop = Loop(m, max_running=1)
    busy = loop.submit("busy", steps=8)             # the last free rows: x and y stay
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
    """Memory and places for two: one adapter running, one idle that nobody waits for. A
    waiting adapter takes the idle one's rows at once; the running one keeps taking new
    requests."""
    m, _ = make_manager(["run", "idle", "new"], max_loras=2, rows=8)
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
def test_eviction_policy_picks_by_recency_or_by_requests(policy: str, evicted: str) -> None:
    """Two adapters of one rank fill memory: one with five requests used first, one with a
    single request used last; then a newcomer needs room. LRU evicts the one used first;
    GreedyDual-Size-Frequency the one with fewer requests (sizes equal)."""
    ranks = {"first": 4, "last": 4, "new": 2}
    m, _ = make_manager(list(ranks), max_loras=2, rows=8, ranks=ranks, eviction=policy)
    loop = Loop(m)
    for name, requests in (("first", 5), ("last", 1)):
        for _ in range(requests):
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


def test_pinned_adapters_filling_memory_fail_waiting_requests_with_an_actionable_error() -> None:
    """Pinned adapters hold all of adapter memory: a waiting adapter can never be placed, so
    its request fails naming --lora-memory-mb instead of waiting forever."""
    m, _ = make_manager(["p0", "p1", "other"], max_loras=2, rows=8)
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
    assert failures[0][0] is req and "--lora-memory-mb" in str(failures[0][1])
