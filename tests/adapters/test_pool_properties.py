"""Random load/unload/request/re-upload sequences against a simple model of the pool.

Checked after every step: reference counts equal the live requests bound to each version;
a slot read by a live request still holds that request's adapter version (never rewritten
under it); pinned adapters stay resident; at most max_loras adapters have running requests;
the arenas hold exactly the resident adapters' rows (check_consistency).
"""
from __future__ import annotations

import time

from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pool_support import make_manager, request


def settle(manager, waiting=()) -> None:
    """Per-step work until no fetch or copy is in flight (slot waits may remain)."""
    for _ in range(2000):
        manager.prepare(waiting)
        if not manager.jobs and not any(e is not None and e.copying for e in manager.slots):
            manager.prepare(waiting)
            return
        time.sleep(0.002)
    raise AssertionError("adapter fetch did not finish")

NAMES = ["a", "b", "c", "d"]
RANKS = {"a": 2, "b": 4, "c": 8, "d": 1}  # mixed ranks in an arena of ROWS rank rows
ROWS = 12


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.manager, self.source = make_manager(NAMES, max_loras=2, max_cpu=3, rows=ROWS, ranks=RANKS)
        self.live: list = []             # requests bound to a slot (running)
        self.pinned: set[str] = set()
        self.pinned_resident: set = set()
        self.version_counter = 1

    @rule(name=st.sampled_from(NAMES), pin=st.booleans())
    def load(self, name: str, pin: bool) -> None:
        if pin and (len(self.pinned | {name}) >= self.manager.max_loras
                    or sum(RANKS[n] for n in self.pinned | {name}) > ROWS - max(RANKS.values())):
            pin = False                  # keep room unpinned so every adapter can progress
        def done(entry, error) -> None:
            assert error is None
            if pin:
                self.pinned.add(name)
        self.manager.load(name, "", pin, done)
        # A pinned load may wait for a slot to drain (until running requests end): it
        # completes later, so only the fetch is waited for here.
        settle(self.manager)

    @rule(name=st.sampled_from(NAMES))
    def start_request(self, name: str) -> None:
        req = request(name)
        settle(self.manager, [req])
        if self.manager.try_bind(req):   # else it waits (its victim slot is draining)
            self.live.append(req)

    @precondition(lambda self: self.live)
    @rule(index=st.integers(min_value=0, max_value=100))
    def end_request(self, index: int) -> None:
        req = self.live.pop(index % len(self.live))
        self.manager.release(req)
        settle(self.manager)

    @rule(name=st.sampled_from(NAMES))
    def unload(self, name: str) -> None:
        if name in self.manager.current:
            self.manager.unload(name)
            self.pinned.discard(name)

    @rule(name=st.sampled_from(NAMES))
    def reupload(self, name: str) -> None:
        self.version_counter += 1
        version = f"v{self.version_counter}"
        self.source.versions[name] = version
        self.manager.on_catalog_update(name, version)
        settle(self.manager)

    @invariant()
    def reference_counts_match_live_requests(self) -> None:
        self.manager.check_consistency(self.live)

    @invariant()
    def no_slot_is_rewritten_under_a_live_request(self) -> None:
        for req in self.live:
            entry = req.adapter_entry
            assert self.manager.slots[req.lora_slot] is entry
            assert entry.version == req.adapter_version

    @invariant()
    def pinned_adapters_once_resident_are_never_evicted(self) -> None:
        for entry in self.manager.entries():
            if entry.pinned and entry.resident:
                self.pinned_resident.add(entry)
        for entry in self.pinned_resident:
            if not entry.retired:        # unloaded or replaced by a new version: may go
                assert entry.slot >= 0, f"pinned {entry.name} lost its slot"

    @invariant()
    def running_adapters_are_bounded(self) -> None:
        running = {id(r.adapter_entry) for r in self.live}
        assert len(running) <= self.manager.max_loras == 2

    def teardown(self) -> None:
        for req in self.live:
            self.manager.release(req)
        self.manager.check_consistency([])
        assert all(e.refs == 0 for e in self.manager.entries())
        self.manager.shutdown()


TestPoolProperties = PoolMachine.TestCase
TestPoolProperties.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
