"""The adapter pool: LRU order, pinning, deferred unload, versions, reference counts."""
from __future__ import annotations

import time

from pool_support import bind, load, make_manager, pump, request


def slot_names(manager) -> list[str | None]:
    return [e.name if e else None for e in manager.slots]


def test_lru_slot_is_evicted_first() -> None:
    m, _ = make_manager(["a", "b", "c"], max_loras=2)
    load(m, "a")
    load(m, "b")
    m.release(bind(m, "a"))               # a is now more recently used than b
    load(m, "c")
    assert sorted(n for n in slot_names(m) if n) == ["a", "c"]
    assert m.stats["evictions"] == 1


def test_pinned_adapter_is_never_evicted() -> None:
    m, _ = make_manager(["a", "b", "c", "d"], max_loras=2)
    load(m, "a", pin=True)
    for name in ["b", "c", "d", "b"]:
        entry, error = load(m, name)
        assert error is None
    assert "a" in slot_names(m)
    assert m.current["a"].pinned and m.current["a"].resident


def test_unload_is_deferred_while_a_request_runs() -> None:
    m, _ = make_manager(["a"], max_loras=2)
    load(m, "a")
    req = bind(m, "a")
    slot = req.lora_slot
    assert m.unload("a") is True          # deferred
    assert slot_names(m)[slot] == "a"     # the running request still reads its slot
    assert not m.try_bind(request("a"))   # no new request binds to it
    m.release(req)
    assert not any(slot_names(m))
    assert m.buffers.used_nbytes() == 0
    m.check_consistency([])


def test_new_version_serves_new_requests_while_old_one_finishes() -> None:
    m, source = make_manager(["a"], max_loras=2)
    load(m, "a")
    old_req = bind(m, "a")
    old_slot = old_req.lora_slot
    source.versions["a"] = "v2"
    m.on_catalog_update("a", "v2")
    new_req = bind(m, "a")
    assert (old_req.adapter_version, new_req.adapter_version) == ("v1", "v2")
    assert new_req.lora_slot != old_slot
    assert sorted(n for n in slot_names(m) if n) == ["a", "a"]
    m.release(old_req)
    assert m.slots[old_slot] is None      # the old version's slot is freed once idle
    m.release(new_req)
    m.check_consistency([])
    assert m.current["a"].version == "v2" and m.current["a"].refs == 0


def test_cold_adapter_gets_a_slot_by_draining_the_lru_one() -> None:
    m, _ = make_manager(["a", "b", "c"], max_loras=2)
    held = [bind(m, "a"), bind(m, "b")]   # both slots in use
    cold = request("c")
    pump(m, [cold])
    assert not m.try_bind(cold)
    drained = [e for e in m.slots if e and e.draining]
    assert len(drained) == 1 and drained[0].name == "a"   # least recently used
    assert not m.try_bind(request("a"))   # new requests of a wait while it drains
    m.release(held[0])                    # a's last request ends: its slot is reused
    pump(m, [cold])
    assert m.try_bind(cold) and cold.adapter_version == "v1"
    m.release(cold)
    m.release(held[1])
    m.check_consistency([])


def test_unknown_adapter_fails_its_waiting_requests() -> None:
    m, _ = make_manager(["a"])
    waiting = [request("ghost"), request("a")]
    failures = []
    for _ in range(1000):                 # what the engine loop does each iteration
        m.prepare(waiting)
        for req, error in m.collect_failures(waiting):
            failures.append((req.adapter, type(error).__name__))
            waiting.remove(req)           # the engine finishes it with the error's status
        if failures and not m.busy():
            break
        time.sleep(0.005)
    assert failures == [("ghost", "AdapterNotFound")]
    pump(m, waiting)
    assert m.try_bind(waiting[0])


def test_host_tier_is_bounded_and_refetches_what_it_dropped() -> None:
    m, source = make_manager(["a", "b", "c"], max_loras=1, max_cpu=2)
    for name in ["a", "b", "c"]:
        load(m, name)
    in_host = {e.name for e in m.entries() if e.weights is not None}
    assert len(m.host_lru) <= 2 and "c" in in_host
    dropped = ({"a", "b", "c"} - in_host).pop()
    loads_before = len(source.loads)
    entry, error = load(m, dropped)       # no copy left on the node: fetched again
    assert error is None and entry.weights is not None
    assert source.loads[loads_before:] == [(dropped, "v1")]


def test_prefetch_keeps_the_adapter_in_host_memory_until_a_request_wants_it() -> None:
    m, source = make_manager(["a"], max_loras=2)
    outcome: dict = {}
    m.prefetch("a", lambda e, err: outcome.update(entry=e, error=err))
    pump(m)
    entry = outcome["entry"]
    assert outcome["error"] is None and entry.tier == "host" and entry.slot == -1
    assert m.buffers.used_nbytes() == 0 and m.counters("a").loads == {"host": 1, "gpu": 0}
    again: dict = {}
    m.prefetch("a", lambda e, err: again.update(entry=e, error=err))
    assert again == {"entry": entry, "error": None} and source.loads == [("a", "v1")]  # not fetched twice
    req = bind(m, "a")                    # the request finds it in host memory and promotes it
    assert req.adapter_tier == "host" and m.tier_hits["host"] == 1 and m.tier_hits["gpu"] == 0
    assert entry.resident and m.counters("a").loads == {"host": 1, "gpu": 1}
    m.release(req)
    m.check_consistency([])
    missing: dict = {}
    m.prefetch("ghost", lambda e, err: missing.update(entry=e, error=err))
    pump(m)
    assert missing["entry"] is None and type(missing["error"]).__name__ == "AdapterNotFound"
    assert "ghost" not in m.current
