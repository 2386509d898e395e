"""The adapter tiers and their bookkeeping, owned by the engine loop thread.

Tiers: GPU (ready for batches: rank rows in the arenas, slots.py) <- host memory (LRU of
`max_cpu_loras`) <- source (the adapter store, or a local directory); a store source may keep
a disk tier of its own (disk_tier.py), which entries() lists for adapters held nowhere else.
Fetches run on background threads and report back through a queue that the engine thread
drains, so every state change happens on one thread and no lock guards this state.

Two GPU resources: memory (the arenas' rank rows: an adapter holds its own rank's worth on
each module it targets, a mixture-of-experts model's expert parameters included,
`--lora-memory-mb`) and places in a step (at most `max_loras` distinct adapters have running
requests at once: a step's LoRA kernels and graphs are sized for that many).

Rules:
- A request binds to its adapter's current version when it is admitted and holds a
  reference on that version's slot until it ends. An adapter with references is never
  evicted or rewritten; unload and replacement by a new version wait until the count is 0.
- Pinned adapters are never evicted.
- Waiting adapters are served in the order of their oldest waiting request. Each loop, the
  oldest `max_cpu_loras` waiting adapters not on this node are fetched into host memory, and
  every waiting adapter that is not on the GPU is promoted ahead of its admission if memory
  allows: free rows, or idle adapters (no running request) that no older waiting request
  wants, evicted as the policy picks (eviction.py). The oldest waiting adapter that cannot
  be placed that way drains running adapters instead: they take no new requests and leave
  the GPU once theirs end, and no younger adapter is promoted meanwhile, so the rows they
  free go to it. Likewise, when a resident adapter's oldest request waits because
  `max_loras` other adapters hold the step's places, the least valuable of them stops taking
  new requests until its running ones end. So a cold adapter waits at most for the running
  requests of the adapters it displaces: nobody starves.
- A fetch that no waiting request, admin call or slot promotion wants any more (its requests
  ended) is cancelled, and so is every fetch when the node stops: neither waits on a store.
"""
from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable, Protocol

import torch

from adapter_store.client import Cancellation

from ..engine.request import Request
from ..model.families import EXPERT_MODULES
from .errors import (AdapterCancelled, AdapterError, AdapterNotFound, AdapterNumericalFault, AdapterTooLarge,
                     NoSlotAvailable)
from .eviction import make_policy
from .slots import SlotBuffers
from .weights import AdapterWeights

log = logging.getLogger(__name__)

# Added to the policy's value of a running adapter: a room is made from idle adapters
# whenever it can be, and running ones are drained only when it cannot.
DRAIN_COST = 1e12


class AdapterSource(Protocol):
    def load(self, name: str, version: str, cancel: Cancellation | None = None) -> AdapterWeights:
        """Fetches and validates an adapter (version "" = current). Blocking; raises
        AdapterError (AdapterCancelled once `cancel` is cancelled, if it stopped for it)."""
        ...

    def catalog(self) -> list[tuple[str, int]]:
        """(name, unix time it was last updated) of every adapter it can serve. Blocking."""
        ...


@dataclass(eq=False)
class AdapterEntry:
    name: str
    version: str
    generation: int                            # load generation: part of the KV-cache namespace
    weights: AdapterWeights | None = None      # host tier (None once dropped from host memory)
    slot: int = -1
    copy_done: torch.cuda.Event | None = None  # pending host->GPU copy
    copying: bool = False
    refs: int = 0
    pinned: bool = False
    draining: bool = False                     # no new binds: its memory or its place is wanted
    evict_when_idle: bool = False              # drained for memory: leaves the GPU at refs 0
    retired: bool = False                      # unloaded or replaced: freed when refs reach 0
    on_disk: bool = False                      # only in the source's disk tier (a listing, never bound)
    rank: int = 0
    target_modules: tuple[str, ...] = ()
    ranks: dict[str, int] = field(default_factory=dict)  # rank rows it holds per arena on the GPU
    source_tier: str = ""                      # where its host copy came from (disk, store)
    gpu_nbytes: int = 0                        # its rows' bytes on the GPU (its own size)
    last_used: float = field(default_factory=time.monotonic)
    hits: int = 0                              # requests bound since it came onto the GPU
    value: float = 0.0                         # the eviction policy's (eviction.py)

    @property
    def resident(self) -> bool:
        return self.slot >= 0 and not self.copying

    @property
    def namespace(self) -> str:
        """Its prefix-cache namespace: KV computed under this load of this version only."""
        return f"{self.name}@{self.version}#{self.generation}"

    @property
    def tier(self) -> str:
        if self.resident:
            return "gpu"
        if self.on_disk:
            return "disk"
        return "loading" if self.copying else "host"


Done = Callable[[AdapterEntry | None, AdapterError | None], None]


@dataclass(eq=False)
class FetchJob:
    """One fetch on a background thread: who waits for it, and how to end it early."""

    waiters: list[Done] = field(default_factory=list)
    cancel: Cancellation = field(default_factory=Cancellation)

# Buckets (seconds) of an adapter's load time: fetch, validation and probe, into host memory.
LOAD_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


@dataclass
class AdapterCounters:
    """Per adapter name, over all its versions and loads; read through Node.snapshot() by the
    metrics collector (totals, so a scrape may come at any time)."""

    loads: dict[str, int] = field(default_factory=lambda: {"host": 0, "gpu": 0})      # into each tier
    evictions: dict[str, int] = field(default_factory=lambda: {"host": 0, "gpu": 0})  # out of each tier
    load_seconds_buckets: list[int] = field(default_factory=lambda: [0] * len(LOAD_SECONDS_BUCKETS))
    load_seconds_count: int = 0
    load_seconds_sum: float = 0.0
    numerical_faults: int = 0

    def observe_load(self, seconds: float) -> None:
        self.load_seconds_count += 1
        self.load_seconds_sum += seconds
        for i, bound in enumerate(LOAD_SECONDS_BUCKETS):
            if seconds <= bound:
                self.load_seconds_buckets[i] += 1

    def as_dict(self) -> dict:
        return {"loads": dict(self.loads), "evictions": dict(self.evictions),
                "load_seconds": {"buckets": list(zip(LOAD_SECONDS_BUCKETS, self.load_seconds_buckets)),
                                 "count": self.load_seconds_count, "sum": self.load_seconds_sum},
                "numerical_faults": self.numerical_faults}


class AdapterManager:
    def __init__(self, buffers: SlotBuffers, source: AdapterSource | None, max_cpu_loras: int,
                 pin_host_memory: bool = False, fetch_workers: int = 4,
                 disk_copies: Callable[[], list[tuple[str, str, int]]] | None = None,
                 eviction: str = "lru") -> None:
        """disk_copies: (name, version, rank) of each adapter in the source's disk tier;
        eviction: the GPU eviction policy (eviction.py)."""
        self.buffers = buffers
        self.source = source
        self.disk_copies = disk_copies or (lambda: [])
        self.max_loras = buffers.max_loras
        self.max_cpu_loras = max(max_cpu_loras, 1)
        self.pin_host_memory = pin_host_memory
        self.policy = make_policy(eviction)
        self.slots: list[AdapterEntry | None] = [None] * buffers.num_slots
        self.active = 0                                   # adapters with running requests
        # Adapters whose host->GPU copy may still run: the per-loop checks look at these alone,
        # not at every slot (a large adapter memory tracks thousands).
        self._copying: dict[int, AdapterEntry] = {}
        self._reserved: AdapterEntry | None = None        # the adapter running ones drain for
        self._wanted: dict[str, int] = {}                 # waiting adapters: name -> position
        self.current: dict[str, AdapterEntry] = {}       # name -> the version new requests get
        self.retired: list[AdapterEntry] = []             # old versions still referenced
        self.host_lru: OrderedDict[int, AdapterEntry] = OrderedDict()
        self.jobs: dict[tuple[str, str], FetchJob] = {}  # (name, version) -> its fetch
        self._refetch: dict[tuple[str, str], AdapterEntry] = {}  # fetches that restore a host copy
        self.resident_waiters: list[tuple[AdapterEntry, Done]] = []
        self._failed: dict[str, AdapterError] = {}
        self._completions: queue.SimpleQueue = queue.SimpleQueue()
        self._pool = ThreadPoolExecutor(fetch_workers, thread_name_prefix="adapter-fetch")
        self._generation = 0
        self.stats = {"loads": 0, "evictions": 0, "fetch_errors": 0}
        # Requests by where their adapter was when the node first saw them.
        self.tier_hits = {"gpu": 0, "host": 0, "disk": 0, "store": 0}
        self.per_adapter: dict[str, AdapterCounters] = {}     # names that loaded at least once
        # (name, version) -> requests whose logits were not finite: that version is unhealthy.
        self.numerical_faults: dict[tuple[str, str], int] = {}
        self._on_namespace_dropped: Callable[[str], object] = lambda namespace: None

    def set_namespace_listener(self, on_dropped: Callable[[str], object]) -> None:
        """Called with an entry's namespace when it can never be used again (the prefix cache)."""
        self._on_namespace_dropped = on_dropped

    # -- the scheduler's AdapterBinder -----------------------------------------------------------
    def try_bind(self, request: Request) -> bool:
        if not request.adapter:
            request.lora_slot = -1
            return True
        entry = self.current.get(request.adapter)
        if entry is None or not entry.resident or entry.draining:
            return False
        if entry.refs == 0:
            if self.active >= self.max_loras:
                return False  # max_loras other adapters hold the step's places
            self.active += 1
        entry.refs += 1
        entry.last_used = time.monotonic()
        self.policy.touched(entry)
        if request.adapter_tier == "?":
            self._count_tier(request, entry.source_tier or "store")
        request.lora_slot = entry.slot
        request.adapter_version = entry.version
        request.adapter_entry = entry
        return True

    def release(self, request: Request) -> None:
        entry: AdapterEntry | None = request.adapter_entry
        request.lora_slot = -1
        request.adapter_entry = None
        if entry is None:
            return
        entry.refs -= 1
        if entry.refs < 0:
            raise AssertionError(f"adapter {entry.name} reference count went negative")
        if entry.refs == 0:
            self.active -= 1
            if entry.retired:
                self._drop(entry)
            elif entry.evict_when_idle and not entry.pinned:
                self._evict(entry.slot)
            else:  # it gave up its place in steps: it may take requests again
                entry.draining = entry.evict_when_idle = False

    # -- once per engine loop iteration -------------------------------------------------------------
    def busy(self) -> bool:
        return bool(self.jobs or self.resident_waiters or self._copying)

    def prepare(self, waiting: Iterable[Request]) -> None:
        """Before scheduling: apply finished fetches and copies, start the loads the waiting
        requests need, promote their adapters to the GPU ahead of admission (oldest request
        first) and make room or a place in steps for the oldest that lacks one."""
        self._apply_completions()
        self._check_copies()
        self._wanted = {}
        for req in waiting:
            if not req.adapter or req.adapter_entry is not None:
                continue  # base model, or preempted with its adapter still bound
            if not req.adapter_tier:
                self._observe(req)
            self._wanted.setdefault(req.adapter, len(self._wanted))
        order = list(self._wanted)
        reserved = self._reserved
        if reserved is not None and (reserved.slot >= 0 or reserved.retired
                                     or (reserved.name not in self._wanted and not reserved.pinned)):
            self._reserved = reserved = None
        may_drain = True  # only the oldest adapter that cannot be placed drains others
        for position, name in enumerate(order):
            entry = self.current.get(name)
            if entry is None:
                # Fetched ahead no deeper than host memory holds: a deeper prefetch would push
                # out the host copies of older waiting adapters and fetch them again. One that
                # just failed is not fetched again for the requests its failure ends next.
                if position < self.max_cpu_loras and name not in self._failed:
                    self._start_load(name, "")
            elif entry.slot < 0 and (reserved is None or entry is reserved):
                placed = self._promote(entry, drain=may_drain)
                may_drain = may_drain and placed
        self._yield_place(order)
        for entry, done in list(self.resident_waiters):
            if entry.resident or entry.retired:
                self.resident_waiters.remove((entry, done))
                done(entry, None)
            elif entry.slot < 0 and (self._reserved is None or entry is self._reserved):
                self._promote(entry, drain=entry.pinned)
        self._cancel_unwanted()

    def _cancel_unwanted(self) -> None:
        """Cancels the fetches nobody wants any more: no waiter (an admin call), no waiting
        request for the adapter, no admin load waiting to place it. A store that is slow or
        gone then holds no thread and no connection for a request that has ended."""
        wanted = set(self._wanted) | {e.name for e, _ in self.resident_waiters}
        if self._reserved is not None:
            wanted.add(self._reserved.name)
        for (name, _), job in self.jobs.items():
            if not job.waiters and name not in wanted and not job.cancel.cancelled:
                log.info("adapter %s: no request waits for it any more; its fetch is cancelled", name)
                job.cancel.cancel()

    def collect_failures(self, waiting: Iterable[Request]) -> list[tuple[Request, AdapterError]]:
        """Waiting requests whose adapter failed to load (the engine finishes them)."""
        if not self._failed:
            return []
        failed, self._failed = self._failed, {}
        return [(r, failed[r.adapter]) for r in waiting if r.adapter in failed and r.adapter_entry is None]

    # -- admin, on the engine thread through Engine.call ---------------------------------------------
    def load(self, name: str, version: str, pin: bool, done: Done) -> None:
        """Fetches the source's current version (or `version`, unless it is already here) and
        promotes it to a GPU slot if one can be had; done() gets the entry."""
        def loaded(entry: AdapterEntry | None, error: AdapterError | None) -> None:
            if entry is None:
                done(None, error)
                return
            too_large = self._too_large(entry)
            if too_large is not None:  # refused now, not pinned: it never holds the GPU
                done(None, too_large)
                return
            if pin:
                entry.pinned = True
                entry.draining = False  # a pinned slot is never given away
            if entry.resident:
                done(entry, None)
                return
            self.resident_waiters.append((entry, done))
            if entry.slot < 0:
                self._promote(entry, drain=pin)
            if entry.slot < 0 and not pin:  # no slot free now: it stays in host memory
                self.resident_waiters.remove((entry, done))
                done(entry, None)

        entry = self.current.get(name)
        if entry is not None and version and entry.version == version and entry.weights is not None:
            loaded(entry, None)
        else:  # no version: whatever the source has now (the same version is not installed twice)
            self._start_load(name, version, loaded)

    def prefetch(self, name: str, done: Done) -> None:
        """Fetches the source's current version into host memory and leaves it there: it
        takes no GPU memory until a request wants it (the host tier, warmed ahead of its
        traffic). An adapter with a host copy here already is not fetched again."""
        entry = self.current.get(name)
        if entry is not None and entry.weights is not None:
            done(entry, None)
        else:
            self._start_load(name, "", done)

    def unload(self, name: str) -> bool:
        """Retires the adapter; returns True when running requests defer the unload."""
        entry = self.current.pop(name, None)
        if entry is None:
            raise AdapterNotFound(f"adapter {name!r} is not loaded on this node")
        entry.pinned = False
        deferred = entry.refs > 0
        self._retire(entry)
        return deferred

    def on_catalog_update(self, name: str, version: str) -> None:
        """The store has a new version: new requests get it, running ones finish on theirs.
        An adapter this node had loaded is fetched again right away, so it stays warm."""
        entry = self.current.get(name)
        if entry is None or entry.version == version:
            return
        pinned = entry.pinned
        self.current.pop(name)
        self._retire(entry)
        self.load(name, version, pinned, lambda e, err: None)

    def on_catalog_delete(self, name: str) -> None:
        if name in self.current:
            self.unload(name)

    # -- loading ---------------------------------------------------------------------------------------
    def _start_load(self, name: str, version: str, waiter: Done | None = None) -> None:
        if self.source is None:
            error = AdapterNotFound(f"adapter {name!r} is not loaded and this node has no adapter "
                                    "source (start it with --adapter-store or --adapter-dir)")
            self._failed[name] = error
            if waiter:
                waiter(None, error)
            return
        key = (name, version)
        job = self.jobs.get(key)
        if job is None or job.cancel.cancelled:  # a cancelled fetch's result goes to nobody
            job = self.jobs[key] = FetchJob()
            self._pool.submit(self._fetch, name, version, job)
        if waiter is not None:
            job.waiters.append(waiter)

    def _fetch(self, name: str, version: str, job: FetchJob) -> None:  # background thread
        started = time.monotonic()
        try:
            weights = self.source.load(name, version, cancel=job.cancel)
            if self.pin_host_memory:
                weights.tensors = {k: (a.pin_memory(), b.pin_memory())
                                   for k, (a, b) in weights.tensors.items()}
            weights.load_seconds = time.monotonic() - started
            self._completions.put(((name, version), job, weights, None))
        except AdapterError as exc:
            self._completions.put(((name, version), job, None, exc))
        except Exception as exc:  # unexpected: reported, never half-used
            log.exception("loading adapter %s failed", name)
            self._completions.put(((name, version), job, None,
                                   AdapterError(f"loading adapter {name!r} failed: {exc}")))

    def _apply_completions(self) -> None:
        while True:
            try:
                key, job, weights, error = self._completions.get_nowait()
            except queue.Empty:
                return
            name = key[0]
            if self.jobs.get(key) is job:
                del self.jobs[key]
            elif weights is None:
                continue  # a cancelled fetch replaced by a newer one: that one answers
            if isinstance(error, AdapterCancelled):  # nobody waited for it
                self._refetch.pop(key, None)  # a promotion that wants it again asks again
                continue
            waiters = job.waiters
            target = self._refetch.pop(key, None)
            entry = None
            if error is not None:
                self.stats["fetch_errors"] += 1
                log.warning("adapter %s could not be loaded: %s", name, error)
                self._failed[name] = error
            elif target is not None and target.version == weights.version:
                target.weights = weights      # the same entry gets its host copy back
                target.source_tier = weights.source_tier
                self._count_load(weights)
                self._touch_host(target)
                entry = target
            else:
                entry = self._install(weights)
            for waiter in waiters:
                waiter(entry, error)

    def _install(self, weights: AdapterWeights) -> AdapterEntry:
        old = self.current.get(weights.name)
        self._count_load(weights)
        if old is not None and old.version == weights.version:
            old.weights = weights
            old.source_tier = weights.source_tier
            self._touch_host(old)
            return old
        if old is not None:
            self.current.pop(weights.name)
            self._retire(old)
        self._generation += 1
        entry = AdapterEntry(weights.name, weights.version, self._generation, weights,
                             rank=weights.rank, target_modules=weights.target_modules,
                             ranks=self.buffers.ranks_of(weights), source_tier=weights.source_tier)
        self.current[weights.name] = entry
        self._touch_host(entry)
        self.stats["loads"] += 1
        log.info("adapter %s version %s in host memory (rank %d, %s, %.2f MB)", entry.name,
                 entry.version[:12], weights.rank, ",".join(weights.target_modules), weights.nbytes / 1e6)
        return entry

    def counters(self, name: str) -> AdapterCounters:
        return self.per_adapter.setdefault(name, AdapterCounters())

    def _count_load(self, weights: AdapterWeights) -> None:
        counters = self.counters(weights.name)
        counters.loads["host"] += 1
        counters.observe_load(getattr(weights, "load_seconds", 0.0))

    def _touch_host(self, entry: AdapterEntry) -> None:
        self.host_lru[id(entry)] = entry
        self.host_lru.move_to_end(id(entry))
        while len(self.host_lru) > self.max_cpu_loras:
            victim = self._host_victim(keep=entry)
            if victim is None:
                return
            self.host_lru.pop(id(victim))
            victim.weights = None  # a GPU slot keeps serving; a later promotion refetches
            self.counters(victim.name).evictions["host"] += 1
            if victim.slot < 0 and self.current.get(victim.name) is victim:
                del self.current[victim.name]  # no copy left on this node: the source has it
                self._on_namespace_dropped(victim.namespace)

    def _host_victim(self, keep: AdapterEntry) -> AdapterEntry | None:
        """LRU host copy to drop: first those already on the GPU (their host copy is only a
        cache), then idle ones no waiting request wants, then those the youngest waiting
        requests want; never one an admin load waits to place, nor the one running adapters
        drain for."""
        waiting = {id(e) for e, _ in self.resident_waiters}
        for e in self.host_lru.values():
            if e is not keep and e.slot >= 0 and not e.copying:
                return e
        idle = [e for e in self.host_lru.values() if e is not keep and e is not self._reserved
                and e.slot < 0 and not e.pinned and id(e) not in waiting]
        unwanted = [e for e in idle if e.name not in self._wanted]
        if unwanted:
            return unwanted[0]
        return max(idle, key=lambda e: self._wanted[e.name], default=None)

    # -- GPU memory and places in steps -------------------------------------------------------------
    def _promote(self, entry: AdapterEntry, drain: bool) -> bool:
        """Puts the adapter on the GPU if room can be made now: free rows, or idle adapters
        evicted as the policy picks. drain: else drain the running adapters whose rows make
        the room (no new binds; they leave once their requests end) and keep younger
        promotions back meanwhile. True once it is placed (its copy may still run)."""
        too_large = self._too_large(entry)
        if too_large is not None:
            self._fail(entry, too_large)
            return False
        if entry.weights is None:  # dropped from host memory: fetch it again into this entry
            self._refetch[(entry.name, entry.version)] = entry
            self._start_load(entry.name, entry.version)
            return False
        ranks = entry.ranks
        slot = self._room_for(entry, ranks, drain)
        if slot is None:
            return False
        if self._reserved is entry:
            self._reserved = None
        self.slots[slot] = entry
        entry.slot = slot
        entry.copying = True
        self._copying[id(entry)] = entry
        entry.gpu_nbytes = self.buffers.adapter_nbytes(ranks)
        self.counters(entry.name).loads["gpu"] += 1
        entry.copy_done = self.buffers.write(slot, entry.weights)
        entry.last_used = time.monotonic()
        self.policy.placed(entry)
        self._touch_host(entry)
        self._check_copies()
        return True

    def _room_for(self, entry: AdapterEntry, ranks: dict[str, int], drain: bool) -> int | None:
        """A slot with rows placed for `ranks`, evicting what it must; None while it waits."""
        slot = self._free_slot()
        if slot is not None and self.buffers.place(slot, ranks):
            return slot
        position = self._wanted.get(entry.name, len(self._wanted))
        older = {name for name, i in self._wanted.items() if i < position}

        def cost(s: int) -> float | None:
            e = self.slots[s]
            if e is None or e is entry or e.pinned or e.copying or e.retired:
                return None  # retired ones leave by themselves when their requests end
            if e.refs == 0 and not e.draining and e.name not in older:
                return self.policy.value(e)
            if drain and e.refs > 0:
                return DRAIN_COST + self.policy.value(e)
            return None

        victims = self.buffers.plan(ranks, cost)
        if victims is not None and slot is None and not victims:
            candidates = [(c, s) for s in range(len(self.slots)) if (c := cost(s)) is not None]
            victims = [min(candidates)[1]] if candidates else None
        if victims is None:
            if drain:
                self._check_fits(entry, ranks)
            return None
        running = [s for s in victims if self.slots[s].refs > 0]
        for s in victims:
            if s not in running:
                self._evict(s)
        if running:
            for s in running:
                self.slots[s].draining = self.slots[s].evict_when_idle = True
            self._reserved = entry
            return None
        slot = self._free_slot()
        if slot is None or not self.buffers.place(slot, ranks):
            raise AssertionError(f"no room for {entry.name} after evicting {victims}")
        return slot

    def _check_fits(self, entry: AdapterEntry, ranks: dict[str, int]) -> None:
        """Fails the adapter's waiting requests when nothing but pinned adapters keep it off
        the GPU (so waiting would never end)."""
        def cost(s: int) -> float | None:
            e = self.slots[s]
            return None if e is None or e is entry or (e.pinned and not e.retired) else 0.0

        if self.buffers.plan(ranks, cost) is not None:
            return
        worst = max(ranks, key=lambda m: ranks[m] / self.buffers.arenas[m].rows)
        self._fail(entry, NoSlotAvailable(
            f"adapter {entry.name!r} needs {ranks[worst]} rank rows of {worst} on the GPU; the arena "
            f"holds {self.buffers.arenas[worst].rows} rows and pinned adapters keep the rest: unpin one "
            "or raise --lora-memory-mb"))

    def _too_large(self, entry: AdapterEntry) -> AdapterTooLarge | None:
        """Why the adapter can never be placed, whatever leaves the GPU: it needs more rank
        rows of a module than that module's arena has (None: it fits an empty memory)."""
        buffers = self.buffers
        over = [m for m, r in entry.ranks.items() if r > buffers.arenas[m].rows]
        if not over:
            return None
        module, mb = max(over, key=lambda m: entry.ranks[m] * buffers.row_nbytes[m]), 1 << 20
        rows, need = buffers.arenas[module].rows, entry.ranks[module]
        if module in buffers.held:
            hint = "raise --lora-memory-mb or serve a smaller adapter"
        else:
            hint = f"this node keeps no adapter memory for it: add {','.join(EXPERT_MODULES.get(module, (module,)))} to --lora-modules"
        return AdapterTooLarge(
            f"adapter {entry.name!r} needs {need} rank rows of {module} ({need * buffers.row_nbytes[module] / mb:.1f} MB; "
            f"{buffers.adapter_nbytes(entry.ranks) / mb:.1f} MB in all) on the GPU, but this node's adapter memory "
            f"holds {rows} rows of it ({rows * buffers.row_nbytes[module] / mb:.1f} MB of "
            f"{buffers.nbytes() / mb:.1f} MB): {hint}")

    def _fail(self, entry: AdapterEntry, error: AdapterError) -> None:
        """Ends the adapter's waiting requests and the admin loads waiting to place it."""
        self._failed[entry.name] = error
        for e, done in list(self.resident_waiters):
            if e is entry:
                self.resident_waiters.remove((e, done))
                done(None, error)

    def _free_slot(self) -> int | None:
        for i, e in enumerate(self.slots):
            if e is None:
                return i
        return None

    def _yield_place(self, order: list[str]) -> None:
        """When the oldest waiting adapter that is on the GPU cannot bind because max_loras
        others have running requests, the least valuable of those stops taking new ones (one
        at a time): its place in steps is free once its running requests end."""
        if self.active < self.max_loras or any(e is not None and e.refs > 0 and e.draining
                                               for e in self.slots):
            return
        for name in order:
            entry = self.current.get(name)
            if entry is not None and entry.resident and not entry.draining and entry.refs == 0:
                running = [e for e in self.slots if e is not None and e.refs > 0 and not e.retired]
                if running:
                    victim = min(running, key=lambda e: (e.pinned, self.policy.value(e)))
                    victim.draining = True
                return

    def _evict(self, slot: int) -> None:
        entry = self.slots[slot]
        self.slots[slot] = None
        self.buffers.free(slot)
        if entry is None:
            return
        entry.slot = -1
        entry.draining = entry.evict_when_idle = False
        entry.gpu_nbytes = 0
        self.policy.evicted(entry)
        self.stats["evictions"] += 1
        self.counters(entry.name).evictions["gpu"] += 1
        if entry.weights is None and self.current.get(entry.name) is entry:
            del self.current[entry.name]  # no copy left on this node
            self._on_namespace_dropped(entry.namespace)

    def _check_copies(self) -> None:
        for key, e in list(self._copying.items()):
            if e.copy_done is None or e.copy_done.query():
                e.copying = False
                e.copy_done = None
                del self._copying[key]

    # -- tier hits -------------------------------------------------------------------------------------
    def _observe(self, request: Request) -> None:
        """Counts where the request's adapter is when the node first sees it; one that must
        come from the source is counted when it binds, by where the load found it."""
        entry = self.current.get(request.adapter)
        if entry is not None and entry.resident:
            self._count_tier(request, "gpu")
        elif entry is not None and (entry.weights is not None or entry.slot >= 0):
            self._count_tier(request, "host")
        else:
            request.adapter_tier = "?"

    def _count_tier(self, request: Request, tier: str) -> None:
        request.adapter_tier = tier
        self.tier_hits[tier] = self.tier_hits.get(tier, 0) + 1

    def _retire(self, entry: AdapterEntry) -> None:
        entry.retired = True
        self._on_namespace_dropped(entry.namespace)
        if entry.refs == 0:
            self._drop(entry)
        else:
            self.retired.append(entry)

    def _drop(self, entry: AdapterEntry) -> None:
        if entry.slot >= 0:
            self._evict(entry.slot)
        self.host_lru.pop(id(entry), None)
        entry.weights = None
        if entry in self.retired:
            self.retired.remove(entry)

    # -- numerical health ------------------------------------------------------------------------------
    def numerical_fault(self, request: Request) -> AdapterNumericalFault:
        """A request of this adapter got logits that are not finite: its version is marked
        unhealthy (ListAdapters, metrics) and the request's error names it."""
        entry: AdapterEntry = request.adapter_entry
        key = (entry.name, entry.version)
        self.numerical_faults[key] = self.numerical_faults.get(key, 0) + 1
        self.counters(entry.name).numerical_faults += 1
        if self.numerical_faults[key] == 1:
            log.error("adapter %s version %s marked unhealthy: its forward gave NaN or Inf logits",
                      entry.name, entry.version[:12])
        return AdapterNumericalFault(
            f"adapter {entry.name!r} version {entry.version[:12]}: the logits were not finite (NaN or Inf) at "
            f"output token {len(request.output_token_ids) + 1}: the adapter's weights make the forward "
            "overflow; it is marked unhealthy on this node (ListAdapters); push a fixed version")

    def health_of(self, entry: AdapterEntry) -> int:
        """Requests of this version whose logits were not finite (0: healthy)."""
        return self.numerical_faults.get((entry.name, entry.version), 0)

    # -- introspection ---------------------------------------------------------------------------------
    def entries(self) -> list[AdapterEntry]:
        """Adapters in GPU slots or host memory, then those only in the disk tier (listed as
        on_disk entries: a request for one loads it like any other cold adapter)."""
        held = list(self.current.values()) + list(self.retired)
        known = {(e.name, e.version) for e in held}
        return held + [AdapterEntry(name, version, 0, on_disk=True, rank=rank)
                       for name, version, rank in self.disk_copies()
                       if (name, version) not in known]

    def check_consistency(self, live: Iterable[Request]) -> None:
        """Every reference count equals the live requests bound to that adapter version."""
        counts: dict[int, int] = {}
        for req in live:
            if req.adapter_entry is not None:
                counts[id(req.adapter_entry)] = counts.get(id(req.adapter_entry), 0) + 1
        everyone = {id(e): e for e in self.entries() + [s for s in self.slots if s is not None]}
        for key, e in everyone.items():
            if e.refs != counts.get(key, 0):
                raise AssertionError(f"adapter {e.name}@{e.version[:8]} has ref count {e.refs}, "
                                     f"but {counts.get(key, 0)} live requests use it")
        for key in counts:
            if key not in everyone:
                raise AssertionError("a live request holds an adapter the manager no longer tracks")
        for i, e in enumerate(self.slots):
            if e is not None and e.slot != i:
                raise AssertionError(f"slot {i} holds {e.name}, which thinks it is in slot {e.slot}")
        running = sum(1 for e in everyone.values() if e.refs > 0)
        if running != self.active or running > self.max_loras:
            raise AssertionError(f"{running} adapters have running requests; the manager counts "
                                 f"{self.active} (at most {self.max_loras})")
        self.check_memory()

    def check_memory(self) -> None:
        """The arenas hold exactly the rows of the adapters on the GPU, each its own rank on
        each module it targets: memory used is the sum of their own sizes, within what was
        allocated at start."""
        expected: dict[str, dict[int, int]] = {m: {} for m in self.buffers.arenas}
        for slot, e in enumerate(self.slots):
            if e is not None:
                for module, rank in e.ranks.items():
                    expected[module][slot] = rank
        for module, arena in self.buffers.arenas.items():
            held = {owner: length for _, length, owner in arena.runs()}
            if held != expected[module]:
                raise AssertionError(f"the {module} arena holds {held}, the GPU's adapters need {expected[module]}")
        own = sum(e.gpu_nbytes for e in self.slots if e is not None)
        if self.buffers.used_nbytes() != own:
            raise AssertionError(f"adapter memory used is {self.buffers.used_nbytes()} bytes, the "
                                 f"resident adapters' own sizes sum to {own}")
        if own > self.buffers.nbytes():
            raise AssertionError(f"resident adapters hold {own} bytes of {self.buffers.nbytes()} allocated")

    def shutdown(self) -> None:
        """Ends every fetch now: the process's exit joins the fetch threads, and a fetch from a
        store that is down would otherwise hold it until the fetch's deadline."""
        for job in self.jobs.values():
            job.cancel.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.source is not None and hasattr(self.source, "close"):
            self.source.close()
