"""Prefix cache over the paged KV blocks, namespaced so KV is reused only where it is valid.

A full block is indexed by a hash chain: h(-1) = H(namespace), h(i) = H(h(i-1), tokens of
block i). The namespace is the base model ("base") or one load of one adapter version
("name@version#generation"): KV computed under adapter A is wrong for B, for the base model
and for a re-uploaded A, and none of them can ever hash to A's chain. Unloading or replacing
an adapter drops its namespace; its blocks go back to the free list once no request holds them.

The cache owns no memory: blocks stay in the allocator, which parks an indexed block with no
owner as cached-idle and recycles it (telling the cache through `on_recycle`) only when it has
no free block left.
"""
from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass
from typing import Sequence

from .kv_cache import BlockAllocator
from .request import Request

BASE_NAMESPACE = "base"


def namespace_of(request: Request) -> str:
    """The KV namespace of a bound request: its adapter load's, or the base model's."""
    entry = request.adapter_entry
    return BASE_NAMESPACE if entry is None else entry.namespace


def split_namespace(namespace: str) -> tuple[str, str]:
    """(adapter name, version) of a namespace; ("", "") for the base model."""
    if namespace == BASE_NAMESPACE:
        return "", ""
    name, _, rest = namespace.partition("@")
    return name, rest.rpartition("#")[0]


def chain_hashes(namespace: str, tokens: Sequence[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Extends `known` (the hashes of the first blocks) to every full block of `tokens`."""
    prev = known[-1] if known else hashlib.blake2b(namespace.encode(), digest_size=16).digest()
    for i in range(len(known), len(tokens) // block_size):
        block = array("q", tokens[i * block_size:(i + 1) * block_size]).tobytes()
        prev = hashlib.blake2b(prev + block, digest_size=16).digest()
        known.append(prev)
    return known


@dataclass
class NamespaceStats:
    lookups: int = 0      # admissions that looked for a cached prefix
    hits: int = 0         # of them, those that reused at least one block
    hit_tokens: int = 0   # tokens whose prefill was skipped
    blocks: int = 0       # blocks indexed now


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._index: dict[bytes, int] = {}               # chain hash -> block
        self._keys: dict[int, tuple[bytes, str]] = {}    # block -> (chain hash, namespace)
        self._dropped: set[str] = set()                  # namespaces that may never be indexed again
        self.stats: dict[str, NamespaceStats] = {}
        allocator.on_recycle = self._forget

    # -- admission ---------------------------------------------------------------------------
    def match(self, request: Request) -> list[int]:
        """The blocks of the longest cached prefix of the request's tokens in its namespace,
        leaving at least one token to compute (its logits give the next token)."""
        namespace = self._bind_namespace(request)
        tokens = request.all_token_ids
        usable = (len(tokens) - 1) // self.block_size
        hashes = chain_hashes(namespace, tokens[:usable * self.block_size], self.block_size,
                              request.block_hashes)
        blocks: list[int] = []
        for h in hashes[:usable]:
            block = self._index.get(h)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_idle(self, blocks: list[int]) -> int:
        """How many of these cached blocks are idle, so a hit takes them off the free pool."""
        return sum(1 for b in blocks if self.allocator.ref_count(b) == 0)

    def acquire(self, request: Request, blocks: list[int]) -> None:
        """Gives the request the hit blocks and records the lookup."""
        self.allocator.share(blocks)
        request.block_ids = list(blocks)
        request.num_computed = len(blocks) * self.block_size
        request.num_indexed_blocks = len(blocks)
        if request.cache_namespace in self._dropped:
            return  # an old version's preempted request coming back: nothing cached to count
        stats = self._stats(request.cache_namespace)
        stats.lookups += 1
        if blocks:
            stats.hits += 1
            stats.hit_tokens += request.num_computed

    # -- after each step ------------------------------------------------------------------------
    def insert(self, request: Request) -> None:
        """Indexes the request's full blocks whose KV is now computed."""
        namespace = request.cache_namespace
        # Blocks whose every token is computed and known on the host (not still on the device).
        full = min(request.num_computed, request.num_known_tokens) // self.block_size
        if request.num_indexed_blocks >= full:
            return
        if namespace in self._dropped:
            request.num_indexed_blocks = full
            return
        hashes = chain_hashes(namespace, request.all_token_ids[:full * self.block_size], self.block_size,
                              request.block_hashes)
        stats = self._stats(namespace)
        for i in range(request.num_indexed_blocks, full):
            block = request.block_ids[i]
            if block == self.allocator.released:
                continue  # given back behind a sliding window before it could be indexed
            if hashes[i] in self._index or block in self._keys:
                continue  # the same prefix computed twice at once: the first copy is the cached one
            self._index[hashes[i]] = block
            self._keys[block] = (hashes[i], namespace)
            self.allocator.mark_cached(block)
            stats.blocks += 1
        request.num_indexed_blocks = full

    # -- namespaces -----------------------------------------------------------------------------
    def drop_namespace(self, namespace: str) -> int:
        """Forgets every block of a retired adapter load; returns how many were indexed."""
        self._dropped.add(namespace)
        victims = [b for b, (_, ns) in self._keys.items() if ns == namespace]
        for block in victims:
            self._forget(block)
            self.allocator.uncache(block)
        self.stats.pop(namespace, None)
        return len(victims)

    def _forget(self, block: int) -> None:
        key = self._keys.pop(block, None)
        if key is None:
            return
        chain_hash, namespace = key
        del self._index[chain_hash]
        if namespace in self.stats:
            self.stats[namespace].blocks -= 1

    def _bind_namespace(self, request: Request) -> str:
        namespace = namespace_of(request)
        if request.cache_namespace != namespace:  # first admission (a request keeps its binding)
            request.cache_namespace = namespace
            request.block_hashes = []
        return namespace

    def _stats(self, namespace: str) -> NamespaceStats:
        stats = self.stats.get(namespace)
        if stats is None:
            stats = self.stats[namespace] = NamespaceStats()
        return stats

    # -- introspection --------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return len(self._keys)

    def check_consistency(self) -> None:
        """The index and the allocator agree on which blocks hold cached content."""
        if len(self._index) != len(self._keys):
            raise AssertionError("prefix index and block keys differ in size")
        for block, (chain_hash, namespace) in self._keys.items():
            if self._index.get(chain_hash) != block:
                raise AssertionError(f"KV block {block} is not where its hash points")
            if not self.allocator.is_cached(block):
                raise AssertionError(f"KV block {block} is indexed but the allocator may reuse it")
            if namespace in self._dropped:
                raise AssertionError(f"KV block {block} is indexed under dropped namespace {namespace}")
        if self.allocator.cached_blocks() != set(self._keys):
            raise AssertionError("the allocator's cached blocks are not the indexed ones")
        for namespace, stats in self.stats.items():
            count = sum(1 for _, ns in self._keys.values() if ns == namespace)
            if stats.blocks != count:
                raise AssertionError(f"namespace {namespace}: {stats.blocks} blocks counted, {count} indexed")
