"""The node's sweep of a mixture of experts (sweep.py's cases experts.gate_up and
experts.down): per batch bucket the grouped GEMMs' tilings (moe_tilings), per fold bucket the
(token, pick) pairs' LoRA launches (moe_lora_launches); each option checked through the node's
own kernels against the PyTorch reference, then timed over routings of its own, enough that
what they hit overflows L2. moe_experts.py runs the same trials by hand."""
from __future__ import annotations

from typing import Sequence

import torch

from kernels.moe import experts_reference, route
from kernels.tuning import DEFAULT_TUNING, Tiling
from kernels.tuning_table import ModelShape

from .trial import MAX_REL_ERR, Case, Trial, copies_for, rel_err

# The grouped GEMM tilings a sweep tries beside the default: block_n, block_k, stages.
GRID: tuple[Tiling, ...] = tuple((n, k, s) for n in (32, 64, 128) for k in (32, 64, 128) for s in (3, 4))


def lora_arenas(shape: dict[str, int], adapters: int, rank: int, tokens: int, device: torch.device,
                dtype: torch.dtype, seed: int):
    """One layer's gate/up and down PairLora of `adapters` slots of rank `rank` (gate/up's at
    twice it, as PEFT writes it), token t on slot t % adapters, as the node's arenas hold them
    (made on the device: 30B-A3B's for 32 adapters are 1.3 GB)."""
    from kernels.moe.reference import PairLora

    hidden, inter, experts = shape["hidden"], shape["inter"], shape["experts"]
    slots = torch.arange(tokens, dtype=torch.int32) % adapters
    gen = torch.Generator(device=device).manual_seed(seed)

    def pair(r: int, inp: int, out: int) -> PairLora:
        make = lambda *size: (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5  # noqa: E731
                              ).to(dtype)
        first = torch.arange(adapters, dtype=torch.int32) * r
        return PairLora(make(experts, adapters * r, inp), make(experts, adapters * r, out).mul_(0.1),
                        slots.to(device), first.to(device), torch.full((adapters,), r, dtype=torch.int32, device=device),
                        torch.full((adapters,), 2.0, dtype=torch.float32, device=device), max_rank=r)

    return pair(2 * rank, hidden, 2 * inter), pair(rank, inter, hidden)


def lora_bytes(picks: torch.Tensor, adapters: int, rank: int, hidden: int, inter: int, esize: int,
               groups: Sequence[str] = ("gate_up", "down")) -> int:
    """Bytes of the expert LoRA a step must read: A and B of each distinct (expert, adapter)
    the routing hits (token t on adapter t mod N), gate/up's at twice the rank."""
    slots = torch.arange(picks.shape[0], device=picks.device) % adapters
    hit = (picks * adapters + slots[:, None]).unique().numel()
    per_pair = {"gate_up": 2 * rank * (hidden + 2 * inter), "down": rank * (inter + hidden)}
    return hit * esize * sum(per_pair[g] for g in groups)


def options(shape: ModelShape, case_group: str, dtype: torch.dtype) -> list[Tiling]:
    """The distinct tilings of a grouped GEMM the node would launch (fitted to K and to shared
    memory), the default first."""
    from kernels.moe.triton_kernel import fitted

    group = case_group.removeprefix("experts.")
    k = shape.hidden if group == "gate_up" else shape.intermediate
    esize = torch.finfo(dtype).bits // 8
    options: list[Tiling] = []
    for tiling in (DEFAULT_TUNING.moe_tilings[group], *GRID):
        fit = fitted(tiling, k, esize, gated=group == "gate_up")
        if fit not in options:
            options.append(fit)
    return options


def trials(shape: ModelShape, device: torch.device, dtype: torch.dtype,
           experts: tuple[torch.Tensor, torch.Tensor], case: Case, options: Sequence[Tiling]) -> tuple[list[Trial], int]:
    """(a trial per option, the bytes one launch must move): each option checked through the
    node's dispatch (routed_experts, both GEMMs, the other group at its default) against the
    float32 reference, and timed as its one grouped GEMM over routings of its own copies
    (random routers), enough that the experts they hit overflow L2 together."""
    from kernels.dispatch import use_triton
    from kernels.moe.dispatch import routed_experts

    group = case.group.removeprefix("experts.")
    hidden, inter = shape.hidden, shape.intermediate
    gate_up, down = experts
    gen = torch.Generator(device="cpu").manual_seed(case.batch)

    def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(case.batch, hidden, generator=gen).to(device, dtype)
        router = torch.randn(shape.experts, hidden, generator=gen).to(device, dtype)
        weights, picks = route(x, router, shape.top_k, renormalise=True, weights_in_model_dtype=False)
        return x, weights, picks

    first = routing()
    per_expert = (2 * inter * hidden if group == "gate_up" else hidden * inter) * gate_up.element_size()
    hit = int(first[2].unique().numel()) * per_expert
    copies = [first] + [routing() for _ in range(copies_for(hit) - 1)] if device.type == "cuda" else [first]
    x, weights, picks = first
    truth = experts_reference(x.float(), weights, picks, gate_up.float(), down.float())
    pairs = case.batch * shape.top_k
    act_rows = x.new_empty(pairs, inter).normal_()
    out_rows = x.new_empty(pairs, hidden if group == "down" else inter)

    def launch(copy: tuple[torch.Tensor, torch.Tensor, torch.Tensor], tilings: dict[str, Tiling]):
        cx, cweights, cpicks = copy
        if not use_triton(cx):  # the CPU smoke without the interpreter: what the node runs there
            return lambda: routed_experts(cx, cweights, cpicks, gate_up, down, tilings)
        from kernels.moe.triton_kernel import _Grouped

        grouped = _Grouped(cx, cpicks, shape.experts, tilings)
        if group == "gate_up":
            return lambda: grouped.gemm(cx, gate_up, out_rows, "gate_up", per_token=True, gated=True)
        flat = cweights.reshape(-1).contiguous()
        return lambda: grouped.gemm(act_rows, down, out_rows, "down", per_token=False, weights=flat)

    made = []
    for option in options:
        tilings = {**DEFAULT_TUNING.moe_tilings, group: option}

        def check(t=tilings) -> list[str]:
            err = rel_err(routed_experts(x, weights, picks, gate_up, down, t), truth)
            return [] if err <= MAX_REL_ERR else [f"rel err {err:.1e} at {case.batch} rows"]

        def timed(timer, t=tilings) -> float:
            return timer(lambda copy: launch(copy, t), copies)

        made.append(Trial(check, timed))
    activations = pairs * (2 * inter if group == "gate_up" else inter + hidden) * gate_up.element_size()
    return made, hit + activations


# (one launch or two, columns a tile, warps): what the node's sweep tries for each pair's LoRA.
LORA_LAUNCHES: tuple[Tiling, ...] = tuple((one, width, warps) for one in (0, 1) for width in (128, 256)
                                          for warps in (2, 4))


def lora_options(case_group: str) -> list[Tiling]:
    """The pair LoRA launches (Tuning.moe_lora_launches) a sweep tries for a group, the
    default first."""
    default = DEFAULT_TUNING.moe_lora_launches[case_group.removeprefix("experts.")]
    return [default] + [launch for launch in LORA_LAUNCHES if launch != default]


def lora_trials(shape: ModelShape, device: torch.device, dtype: torch.dtype, rank: int, case: Case,
                options: Sequence[Tiling]) -> tuple[list[Trial], int]:
    """(a trial per launch option, the bytes one launch must move) for the LoRA of
    `case.adapters` adapters of rank `rank` on every expert of one group, token t on
    adapter t mod N: each option checked against pair_lora_reference, and timed as the pair
    launches alone over routings of their own, enough that the LoRA rows they hit overflow
    L2 together."""
    from kernels.dispatch import use_triton
    from kernels.moe.reference import pair_lora_reference

    group = case.group.removeprefix("experts.")
    dims = {"hidden": shape.hidden, "inter": shape.intermediate, "experts": shape.experts}
    gen = torch.Generator(device="cpu").manual_seed(case.batch * 1000 + case.adapters)
    gate_up_lora, down_lora = lora_arenas(dims, case.adapters, rank, case.batch, device, dtype,
                                          case.batch * 1000 + case.adapters)
    lora = gate_up_lora if group == "gate_up" else down_lora
    width_in = shape.hidden if group == "gate_up" else shape.intermediate
    width_out = 2 * shape.intermediate if group == "gate_up" else shape.hidden
    rows = case.batch if group == "gate_up" else case.batch * shape.top_k  # down's input: a row a pair

    def routing() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.randn(case.batch, shape.hidden, generator=gen).to(device, dtype)
        router = torch.randn(shape.experts, shape.hidden, generator=gen).to(device, dtype)
        weights, picks = route(x, router, shape.top_k, renormalise=True, weights_in_model_dtype=False)
        a = x if group == "gate_up" else torch.randn(rows, width_in, generator=gen).to(device, dtype)
        return a, weights.reshape(-1).contiguous(), picks

    first = routing()
    hit = lora_bytes(first[2], case.adapters, rank, shape.hidden, shape.intermediate,
                     torch.finfo(dtype).bits // 8, (group,))
    copies = [first] + [routing() for _ in range(copies_for(hit) - 1)] if device.type == "cuda" else [first]
    a, flat, picks = first
    pairs = picks.numel()
    truth = torch.zeros(pairs, width_out, device=device)
    pair_lora_reference(a, picks, lora, truth, x_per_pair=group == "down")
    if group == "down":
        truth.mul_(flat[:, None])
    out = a.new_zeros(pairs, width_out)

    def launch(copy, option: Tiling):
        ca, cflat, cpicks = copy
        weights = cflat if group == "down" else None
        if not use_triton(ca):  # the CPU smoke without the interpreter: what the node runs there
            return lambda: pair_lora_reference(ca, cpicks, lora, out, x_per_pair=group == "down")
        from kernels.moe.triton_kernel import one_launch, pair_lora_triton

        launches, width, warps = option
        return lambda: pair_lora_triton(ca, cpicks, lora, out, group == "down", weights, num_warps=warps,
                                        fused=one_launch(launches, cpicks.numel(), device), width=width)

    made = []
    for option in options:
        def check(o=option) -> list[str]:
            out.zero_()
            launch(first, o)()
            got = out.float() * (1 if use_triton(a) or group == "gate_up" else flat[:, None])
            err = rel_err(got, truth)
            return [] if err <= MAX_REL_ERR else [f"rel err {err:.1e} at {case.batch} rows"]

        def timed(timer, o=option) -> float:
            return timer(lambda copy: launch(copy, o), copies)

        made.append(Trial(check, timed))
    return made, hit + pairs * (width_in + 2 * width_out) * torch.finfo(dtype).bits // 8


def weights(shape: ModelShape, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's gate/up [E, 2 * inter, hidden] and down [E, hidden, inter], random, made on
    the device (one layer's experts overflow L2 by far)."""
    gen = torch.Generator(device=device).manual_seed(0)
    make = lambda *size: (torch.randn(*size, generator=gen, device=device) * size[-1] ** -0.5).to(dtype)  # noqa: E731
    return (make(shape.experts, 2 * shape.intermediate, shape.hidden),
            make(shape.experts, shape.hidden, shape.intermediate))
