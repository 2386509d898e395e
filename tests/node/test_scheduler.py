"""The continuous-batching scheduler: chunked prefill under a token budget, decode first,
admission limits, and preemption when KV blocks run out."""
from __future__ import annotations

from inference_node.engine.kv_cache import BlockAllocator
from inference_node.engine.request import Request, SamplingParams
from inference_node.engine.scheduler import Scheduler, SchedulerConfig


def req(prompt_len: int, max_tokens: int = 8, adapter: str = "") -> Request:
    return Request(list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens),
                   emit=lambda e: None, adapter=adapter)


def advance(plan) -> None:
    """What the engine does after a forward pass: KV computed, a token sampled if complete."""
    for chunk in plan:
        complete = chunk.completes_prompt
        chunk.request.num_computed += chunk.num_new_tokens
        if complete:
            chunk.request.output_token_ids.append(7)


def make(blocks: int = 64, budget: int = 32, seqs: int = 8) -> Scheduler:
    cfg = SchedulerConfig(block_size=4, max_num_seqs=seqs, max_num_batched_tokens=budget)
    return Scheduler(cfg, BlockAllocator(blocks))


def test_long_prompt_is_prefilled_in_chunks_within_the_budget() -> None:
    s = make(budget=32)
    r = req(70)
    s.add(r)
    sizes = []
    while not r.output_token_ids:
        plan = s.schedule()
        assert sum(c.num_new_tokens for c in plan) <= 32
        sizes.append(plan[0].num_new_tokens)
        advance(plan)
    assert sizes == [32, 32, 6]
    assert len(r.block_ids) == -(-70 // 4)


def test_decode_goes_first_and_prefill_fills_the_rest() -> None:
    s = make(budget=16)
    a = req(4)
    s.add(a)
    advance(s.schedule())          # a: prompt done, one token sampled
    b = req(40)
    s.add(b)
    plan = s.schedule()
    assert [(c.request, c.num_new_tokens) for c in plan] == [(a, 1), (b, 15)]


def test_admission_respects_max_num_seqs_and_order() -> None:
    s = make(seqs=2, budget=100)
    reqs = [req(3) for _ in range(4)]
    for r in reqs:
        s.add(r)
    plan = s.schedule()
    assert [c.request for c in plan] == reqs[:2]
    assert list(s.waiting) == reqs[2:]


def test_admission_waits_for_free_blocks() -> None:
    s = make(blocks=5, budget=100)
    big, small = req(16), req(4)   # 4 blocks, then 1 block (+1 for decode)
    s.add(big)
    s.add(small)
    plan = s.schedule()
    assert [c.request for c in plan] == [big, small]
    assert s.allocator.num_free == 0


def test_preemption_frees_blocks_and_recomputes_prompt_plus_output() -> None:
    s = make(blocks=4, budget=100)
    first, second = req(8), req(8)     # 2 blocks each for the prompt
    s.add(first)
    s.add(second)
    advance(s.schedule())              # both prefilled, 4 blocks used, a 9th token sampled
    advance(s.schedule())              # decode at position 8 needs a 3rd block each
    assert second.preemptions == 1 and first.preemptions == 0
    assert second.block_ids == [] and second.num_computed == 0
    assert s.waiting[0] is second
    # Later, second is recomputed over its prompt and the token it already produced.
    s.remove(first)
    plan = s.schedule()
    assert plan[0].request is second and plan[0].num_new_tokens == second.num_tokens == 9
    s.remove(second)
    s.allocator.check_idle()


def test_remove_frees_everything() -> None:
    s = make()
    r = req(10)
    s.add(r)
    advance(s.schedule())
    s.remove(r)
    assert not s.has_work()
    s.allocator.check_idle()


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def delayed(factor: float, budget: int = 32) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    cfg = SchedulerConfig(block_size=4, max_num_seqs=8, max_num_batched_tokens=budget,
                          prefill_delay_factor=factor)
    return Scheduler(cfg, BlockAllocator(64), clock=clock), clock


def arriving(clock: FakeClock, prompt_len: int) -> Request:
    r = req(prompt_len, max_tokens=100)
    r.arrival = clock.now
    return r


def test_prefill_delay_holds_a_trickle_of_arrivals_while_others_decode() -> None:
    """factor 1 and a last prefill step of 0.125 s: a request arriving while another decodes
    is admitted once it has waited 0.125 s, together with a later arrival."""
    s, clock = delayed(1.0)
    first = arriving(clock, 5)
    s.add(first)
    advance(s.schedule())  # nothing decoding yet: admitted at once
    s.note_prefill_step(0.125)
    second = arriving(clock, 6)
    s.add(second)
    clock.now += 0.0625
    third = arriving(clock, 7)
    s.add(third)
    plan = s.schedule()
    assert [c.request for c in plan] == [first]  # decode only
    advance(plan)
    clock.now += 0.0625  # second has waited 0.125 s
    plan = s.schedule()
    assert [(c.request, c.num_new_tokens) for c in plan] == [(first, 1), (second, 6), (third, 7)]


def test_prefill_delay_admits_at_once_when_nothing_decodes_or_the_budget_is_full() -> None:
    s, clock = delayed(1.0, budget=16)
    s.note_prefill_step(10.0)
    a = arriving(clock, 5)
    s.add(a)
    assert [c.request for c in s.schedule()] == [a]  # nothing is decoding
    s2, clock2 = delayed(1.0, budget=16)
    b = arriving(clock2, 5)
    s2.add(b)
    advance(s2.schedule())
    s2.note_prefill_step(10.0)
    small = arriving(clock2, 6)
    s2.add(small)
    assert [c.request for c in s2.schedule()] == [b]  # 6 tokens waiting: held
    big = arriving(clock2, 20)
    s2.add(big)
    plan = s2.schedule()  # 26 tokens waiting >= the 16-token budget: admitted
    assert [c.request for c in plan][:2] == [b, small]


def test_no_prefill_delay_by_default() -> None:
    s, clock = delayed(0.0)
    a = arriving(clock, 5)
    s.add(a)
    advance(s.schedule())
    s.note_prefill_step(10.0)
    b = arriving(clock, 5)
    s.add(b)
    assert [c.request for c in s.schedule()] == [a, b]


def refilling(factor: float = 1.0, seqs: int = 8) -> tuple[Scheduler, FakeClock]:
    clock = FakeClock()
    cfg = SchedulerConfig(block_size=4, max_num_seqs=seqs, max_num_batched_tokens=64,
                          refill_wait_factor=factor)
    return Scheduler(cfg, BlockAllocator(256), clock=clock), clock


def running_batch(s: Scheduler, clock: FakeClock, n: int) -> list[Request]:
    """n requests admitted and decoding, the last prefill step taking 0.125 s."""
    batch = [arriving(clock, 4) for _ in range(n)]
    for r in batch:
        s.add(r)
    advance(s.schedule())
    s.note_prefill_step(0.125)
    return batch


def after_burst(factor: float = 1.0, seqs: int = 8, size: int = 8,
                finished: int = 4) -> tuple[Scheduler, FakeClock, list[Request]]:
    """A decoding batch of `size` of which the first `finished` have just ended."""
    s, clock = refilling(factor, seqs)
    batch = running_batch(s, clock, size)
    for r in batch[:finished]:
        s.remove(r)
    return s, clock, batch


def test_a_burst_of_finishes_holds_new_prompts_until_their_replacements_arrive() -> None:
    """Half the batch finishes in one step; their replacements arrive apart (a client's
    round trip each) and are admitted in one step once the last is in."""
    s, clock, batch = after_burst()
    plan = s.schedule()
    assert s.refills_owed == 4
    advance(plan)
    new = []
    for _ in range(3):
        clock.now += 0.002
        new.append(arriving(clock, 5))
        s.add(new[-1])
        plan = s.schedule()
        assert {c.request for c in plan} == set(batch[4:])  # decodes only: the replacements wait
        advance(plan)
    clock.now += 0.002
    new.append(arriving(clock, 5))
    s.add(new[-1])
    plan = s.schedule()
    assert [c.request for c in plan if c.request in new] == new
    assert s.refills_owed == 0


def test_replacements_that_arrive_with_the_finishes_are_not_held() -> None:
    """An in-process client resubmits before the next plan: nothing is owed, nothing waits."""
    s, clock, batch = after_burst()
    new = [arriving(clock, 5) for _ in range(4)]
    for r in new:
        s.add(r)
    plan = s.schedule()
    assert s.refills_owed == 0
    assert [c.request for c in plan if c.request in new] == new


def test_lone_finishes_hold_no_one() -> None:
    """One finish in a batch of 8 is no burst (a burst is 1/16 of the batch and at least 2):
    an independent arrival is admitted at once."""
    s, clock = refilling()
    batch = running_batch(s, clock, 8)
    s.remove(batch[0])
    advance(s.schedule())
    late = arriving(clock, 5)
    s.add(late)
    assert late in [c.request for c in s.schedule()]


def test_replacements_wait_at_most_the_factor_times_the_last_prefill_step() -> None:
    s, clock, batch = after_burst(factor=1.0)
    advance(s.schedule())
    first = arriving(clock, 5)
    s.add(first)
    clock.now += 0.1
    plan = s.schedule()
    assert first not in [c.request for c in plan]  # waited 0.1 s of at most 0.125
    advance(plan)
    clock.now += 0.03
    plan = s.schedule()
    assert first in [c.request for c in plan]
    assert s.refills_owed == 0  # the other three are admitted as they come
    advance(plan)
    second = arriving(clock, 5)
    s.add(second)
    assert second in [c.request for c in s.schedule()]


def test_refill_wait_off_admits_a_burst_s_first_replacement_at_once() -> None:
    s, clock, batch = after_burst(factor=0.0)
    advance(s.schedule())
    first = arriving(clock, 5)
    s.add(first)
    assert first in [c.request for c in s.schedule()]


def test_a_burst_s_replacements_past_a_full_step_still_wait_for_each_other() -> None:
    """A full step's worth of prompt is admitted at once; the burst's later replacements
    still wait for one another rather than taking a prefill step each."""
    s, clock, batch = after_burst(seqs=16, size=12, finished=8)
    advance(s.schedule())
    early = [arriving(clock, 32) for _ in range(2)]  # 64 tokens: the whole budget
    for r in early:
        s.add(r)
    plan = s.schedule()
    assert [c.request for c in plan if c.request in early] == early
    advance(plan)
    late = []
    for _ in range(5):
        clock.now += 0.002
        late.append(arriving(clock, 5))
        s.add(late[-1])
        plan = s.schedule()
        assert not [c for c in plan if c.request in late]
        advance(plan)
    clock.now += 0.002
    late.append(arriving(clock, 5))
    s.add(late[-1])
    assert [c.request for c in s.schedule() if c.request in late] == late
