"""Random problem builders and obviously-correct (per-token loop) oracles for the kernel tests."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from kernels.lora.meta import LoraBatchMeta
from kernels.lora.rows import SlotRows


@dataclass
class LoraCase:
    x: torch.Tensor                 # [T, H_in]
    a: list[torch.Tensor]           # per slice [rows, H_in]: arena rows, other rows hold noise
    b: list[torch.Tensor]           # per slice [rows, out_i]: views of b_all
    b_all: torch.Tensor             # [rows, sum(out_i)]
    scaling: torch.Tensor           # [S] float32
    ranks: torch.Tensor             # [S] int32: each slot's rank (its run's length on every slice)
    rows: torch.Tensor              # [n_slices, S] int32: first arena row of each slot's run
    max_rank: int
    token_slots: list[int]
    meta: LoraBatchMeta
    y: torch.Tensor                 # [T, sum(out_i) + pad], the base output the delta goes into
    offsets: list[int]

    @property
    def slots(self) -> SlotRows:
        """Each slot's rank on every slice, and its runs."""
        return self.slots_with(self.ranks.repeat(len(self.a), 1))

    def slots_with(self, slice_ranks: torch.Tensor | Sequence[Sequence[int]]) -> SlotRows:
        """[n_slices, S] ranks of their own (at most the runs' lengths: a slice switched off, 0)."""
        ranks = torch.as_tensor(slice_ranks, dtype=torch.int32).to(self.rows.device)
        return SlotRows(ranks.contiguous(), self.rows, self.max_rank)

    def poison_free_rows(self) -> "LoraCase":
        """NaN in every arena row no slot's run holds (A and B): a kernel that reads past a
        rank, or a row of no slot, spreads it."""
        for i, (a, b) in enumerate(zip(self.a, self.b)):
            owned = torch.zeros(a.shape[0], dtype=torch.bool)
            for slot, r in enumerate(self.ranks.tolist()):
                first = int(self.rows[i, slot])
                owned[first:first + r] = True
            free = (~owned).to(a.device)
            a[free] = float("nan")
            b[free] = float("nan")
        return self

    def module_rows(self, slots: SlotRows | None = None, lead: int = 0,
                    tail: int = 0) -> list[list[int]]:
        """Per slot the (rank, first row) pairs of the slices, after `lead` and before `tail`
        pairs of other modules (which hold values that would be wrong here): a segment or
        token table's module columns."""
        slots = slots or self.slots
        ranks, rows = slots.ranks.tolist(), slots.rows.tolist()
        return [[99, 98] * lead + [v for i in range(len(self.a)) for v in (ranks[i][s], rows[i][s])]
                + [77, 76] * tail for s in range(self.scaling.shape[0])]


def make_lora_case(*, token_slots: Sequence[int], num_slots: int, max_rank: int,
                   ranks: Sequence[int] | None = None, h_in: int, outs: Sequence[int],
                   dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                   y_pad: int = 0, seed: int = 0, spare: int = 3) -> LoraCase:
    """Slots get their own (possibly smaller than max_rank) rank: a run of that many rows in
    each slice's arena, runs in a different order on each slice, with `spare` rows of noise
    (another adapter's rows, as far as a slot knows) between and around them: a kernel that
    reads past a slot's rank reads noise. A slot's run may end at the arena's last row."""
    gen = torch.Generator().manual_seed(seed)
    if ranks is None:
        ranks = [max_rank] * num_slots
    T = len(token_slots)

    def rand(*shape: int, std: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    rows_total = sum(ranks) + spare * (num_slots + 1)
    first_rows = []
    for _ in outs:
        order = torch.randperm(num_slots, generator=gen).tolist()
        firsts, at = [0] * num_slots, 0
        for k, s in enumerate(order):
            gap = int(torch.randint(0, spare + 1, (1,), generator=gen))
            at += gap
            firsts[s] = at
            at += ranks[s]
        first_rows.append(firsts)
    x = rand(T, h_in).to(dtype)
    a = [rand(rows_total, h_in, std=1 / math.sqrt(h_in)).to(dtype).to(device) for _ in outs]
    b_all = torch.cat([rand(rows_total, out, std=1 / math.sqrt(max(max_rank, 1))) for out in outs],
                      dim=1).to(dtype).to(device)
    offsets = [sum(outs[:i]) for i in range(len(outs))]
    b = [b_all[:, off:off + out] for off, out in zip(offsets, outs)]
    scaling = (torch.rand(num_slots, generator=gen) * 2 + 0.5).to(device)
    y = rand(T, sum(outs) + y_pad).to(dtype).to(device)
    return LoraCase(
        x=x.to(device), a=a, b=b, b_all=b_all, scaling=scaling,
        ranks=torch.tensor(list(ranks), dtype=torch.int32, device=device),
        rows=torch.tensor(first_rows, dtype=torch.int32, device=device).reshape(len(outs), num_slots),
        max_rank=max_rank, token_slots=list(token_slots),
        meta=LoraBatchMeta.build(token_slots, device), y=y, offsets=offsets,
    )


def naive_shrink(case: LoraCase, slots: SlotRows | None = None) -> torch.Tensor:
    """Token by token, slice by slice: h[i, t, :r] = x[t] @ A_i[slot's r rows].T * scaling[slot]."""
    slots = slots or case.slots
    out = torch.zeros(len(case.a), len(case.token_slots), case.max_rank, dtype=torch.float32)
    for t, slot in enumerate(case.token_slots):
        if slot < 0:
            continue
        for i, a in enumerate(case.a):
            r, row = slots.host(i, slot)
            out[i, t, :r] = (a[row:row + r].float().cpu() @ case.x[t].float().cpu()) * case.scaling[slot].cpu()
    return out


def naive_expand(case: LoraCase, h: torch.Tensor, slots: SlotRows | None = None) -> torch.Tensor:
    """Token by token: y[t, off_i:off_i+out_i] += B_i[slot's r rows].T @ h[i, t, :r], one fp32
    sum, one rounding; a slice of rank 0 untouched."""
    slots = slots or case.slots
    y = case.y.detach().cpu().clone()
    for t, slot in enumerate(case.token_slots):
        if slot < 0:
            continue
        for i, b in enumerate(case.b):
            r, row = slots.host(i, slot)
            if r == 0:
                continue
            off, n = case.offsets[i], b.shape[1]
            delta = b[row:row + r].float().cpu().t() @ h[i, t, :r].float().cpu()
            y[t, off:off + n] = (y[t, off:off + n].float() + delta).to(y.dtype)
    return y


def naive_delta(case: LoraCase, slots: SlotRows | None = None) -> torch.Tensor:
    """[T, sum(out_i)] float32: every token's LoRA delta alone (naive_expand into zeros)."""
    zero = torch.zeros(len(case.token_slots), sum(b.shape[1] for b in case.b))
    return naive_expand(dataclasses.replace(case, y=zero), naive_shrink(case, slots), slots)


def grouped_slots(gen: torch.Generator, T: int, used: Sequence[int]) -> list[int]:
    """Tokens of each used slot in one contiguous run of 1 to 3 rows (as a decode graph orders
    a step's rows), rows without an adapter (-1) scattered between the runs up to T rows."""
    runs = [[int(s)] * (1 + int(torch.randint(3, (1,), generator=gen))) for s in used]
    gaps = [0] * (len(runs) + 1)
    for _ in range(T - sum(map(len, runs))):
        gaps[int(torch.randint(len(gaps), (1,), generator=gen))] += 1
    slots = [-1] * gaps[0]
    for run, gap in zip(runs, gaps[1:]):
        slots += run + [-1] * gap
    return slots


def make_gemm_lora(case: LoraCase, segments: int):
    """The case as kernels.gemm.GemmLora sees it (slices' B side by side as in the arenas), its
    segment table padded with empty segments up to `segments` rows (other modules' columns
    before this group's), its token table, and a scratch full of NaN (a kernel reading rows no
    shrink wrote would spread them)."""
    from kernels.gemm import GemmLora, fold_counters
    from kernels.lora import SEGMENT_TABLE_RANKS

    device = case.x.device
    n = len(case.a)
    table_meta = case.meta.with_segment_table(case.module_rows(lead=1, tail=1), segments)
    return GemmLora(
        a_all=torch.stack(case.a), b_all=case.b_all, scaling=case.scaling, slice_offsets=tuple(case.offsets),
        segment_table=table_meta.segment_table, segments=segments,
        rank_col=SEGMENT_TABLE_RANKS + 2, max_rank=case.max_rank,
        token_slots=case.meta.token_slots, token_rows=table_meta.token_table[:, 2:2 + 2 * n],
        xa=torch.full((len(case.token_slots), n * case.max_rank), float("nan"), device=device),
        sync=fold_counters(device=device))


def random_slots(gen: torch.Generator, T: int, num_slots: int, used: Sequence[int],
                 none_fraction: float = 0.25) -> list[int]:
    """Tokens in random (unsorted) order over the `used` slots, some with no adapter (-1)."""
    slots = []
    for _ in range(T):
        if not used or torch.rand(1, generator=gen).item() < none_fraction:
            slots.append(-1)
        else:
            slots.append(int(used[torch.randint(len(used), (1,), generator=gen).item()]))
    return slots


@dataclass
class AttentionCase:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int
    q_lens: list[int]
    seq_lens_list: list[int]

    def args(self) -> tuple:
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.query_start_loc,
                self.seq_lens, self.scale, self.max_query_len, self.max_seq_len)


def make_attention_case(*, q_lens: Sequence[int], seq_lens: Sequence[int], num_heads: int,
                        num_kv_heads: int, head_dim: int, page: int,
                        dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                        extra_blocks: int = 7, seed: int = 0, head_major: bool = False) -> AttentionCase:
    """Block tables are random permutations of a shared pool (non-contiguous, unordered).
    head_major: the caches are stored [blocks, Hkv, page, D] and handed over as transposed
    views, as the engine's KVCache does."""
    assert all(0 < ql <= sl for ql, sl in zip(q_lens, seq_lens))
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // page) for s in seq_lens]
    max_blocks = max(need) + 1  # one spare column: unused entries must never be read
    num_blocks = sum(need) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    table = torch.randint(num_blocks, (len(seq_lens), max_blocks), generator=gen)
    used = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[used:used + n]
        used += n
    T = sum(q_lens)
    q = torch.randn(T, num_heads, head_dim, generator=gen)
    k = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, page, num_kv_heads, head_dim, generator=gen)
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    def cache(t: torch.Tensor) -> torch.Tensor:
        t = t.to(dtype).to(device)
        return t.transpose(1, 2).contiguous().transpose(1, 2) if head_major else t

    return AttentionCase(
        q=q.to(dtype).to(device), k_cache=cache(k), v_cache=cache(v),
        block_tables=table.to(torch.int32).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(list(seq_lens), dtype=torch.int32, device=device),
        scale=head_dim ** -0.5, max_query_len=max(q_lens), max_seq_len=max(seq_lens),
        q_lens=list(q_lens), seq_lens_list=list(seq_lens),
    )


def naive_attention(case: AttentionCase, window: int = 0, softcap: float = 0.0) -> torch.Tensor:
    """Per token and head: softmax over the keys at positions 0..pos (the last `window` of
    them where window > 0), read block by block; scores soft-capped where softcap > 0."""
    q, k, v = case.q.float().cpu(), case.k_cache.float().cpu(), case.v_cache.float().cpu()
    table = case.block_tables.cpu()
    page = k.shape[1]
    group = q.shape[1] // k.shape[2]
    out = torch.zeros_like(q)
    t = 0
    for b, (ql, sl) in enumerate(zip(case.q_lens, case.seq_lens_list)):
        keys = torch.stack([k[table[b, j // page], j % page] for j in range(sl)])    # [sl, Hkv, D]
        values = torch.stack([v[table[b, j // page], j % page] for j in range(sl)])
        for i in range(ql):
            pos = sl - ql + i
            first = max(0, pos - window + 1) if window > 0 else 0
            for h in range(q.shape[1]):
                scores = keys[first:pos + 1, h // group] @ q[t, h] * case.scale
                if softcap > 0:
                    scores = torch.tanh(scores / softcap) * softcap
                out[t, h] = torch.softmax(scores, 0) @ values[first:pos + 1, h // group]
            t += 1
    return out.to(case.q.dtype)


# ---------------------------------------------------------------------------------------------
# What Triton compiles: launches recorded by their specialisation

def specialisation(value: object, dynamic: bool) -> tuple:
    """What Triton specialises a launch argument on: an int's width and (unless it is
    do_not_specialize) whether it is 1 or a multiple of 16; a tensor's dtype and whether its
    pointer is 16-byte aligned."""
    if isinstance(value, torch.Tensor):
        return ("ptr", value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("bool", value)
    if isinstance(value, int):
        wide = not -2**31 <= value < 2**31
        return ("int", wide) if dynamic else ("int", wide, value == 1, value % 16 == 0)
    return (type(value).__name__,)


def record_specialisations(monkeypatch, module, kernels: dict[str, list[str]],
                           keys: dict[str, dict[tuple, set]] | None = None) -> dict[str, dict[tuple, set]]:
    """Wraps each named kernel's launch: {kernel: {its constexpr kwargs: {the run-time
    arguments' specialisations}}}, in `keys` if given. kernels maps a name to its
    do_not_specialize list."""
    keys = {} if keys is None else keys
    for name, dynamic in kernels.items():
        kernel = getattr(module, name)

        def run(*args, grid, warmup, _kernel=kernel, _name=name, _dynamic=frozenset(dynamic),
                _original=kernel.run, **kwargs):
            runtime = tuple(specialisation(v, n in _dynamic) for n, v in zip(_kernel.arg_names, args))
            tiling = tuple(sorted((k, repr(v)) for k, v in kwargs.items()))
            keys.setdefault(_name, {}).setdefault(tiling, set()).add(runtime)
            return _original(*args, grid=grid, warmup=warmup, **kwargs)

        monkeypatch.setattr(kernel, "run", run)
    return keys


def assert_one_variant_per_tiling(keys: dict[str, dict[tuple, set]], names: set[str]) -> None:
    assert set(keys) == names
    for name, by_tiling in keys.items():
        for tiling, runtime in by_tiling.items():
            assert len(runtime) == 1, (name, dict(tiling), runtime)
