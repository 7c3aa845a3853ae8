"""Test doubles for the scheduler: a fake model over a simulated paged KV cache, and a
plain-loop reference generator (the oracle)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mlxserve.core.block_pool import BlockPool
from mlxserve.core.request import Request, RequestStatus
from mlxserve.core.scheduler import ModelRunnerOutput, Scheduler, SchedulerOutput
from mlxserve.sampling_params import SamplingParams

VOCAB = 50


def next_token(context: Sequence[int]) -> int:
    """The fake model: a fixed pseudo-random function of the whole context."""
    h = 17
    for t in context:
        h = (h * 1_000_003 + t + 1) % 2_147_483_647
    return h % VOCAB


def reference_generate(
    prompt: Sequence[int],
    max_tokens: int | None,
    max_num_tokens: int,
    eos_token_ids: frozenset[int] = frozenset(),
    min_tokens: int = 0,
) -> list[int]:
    """Generate alone, with no KV cache at all: the oracle for any batched/paged run."""
    seq = list(prompt)
    out: list[int] = []
    while True:
        token = next_token(seq)
        seq.append(token)
        out.append(token)
        if len(out) > min_tokens and token in eos_token_ids:
            return out
        if (max_tokens is not None and len(out) >= max_tokens) or len(seq) >= max_num_tokens:
            return out


class PagedFakeModel:
    """Runs a SchedulerOutput the way a real runner does, against a simulated KV cache.

    Every fed token is written to its slot (from the block table of each KV cache group);
    then each sampling request gets next_token() of its context READ BACK from the slots.
    A group with a window reads back only the tokens the window covers (the blocks before
    it may be released). With recurrent layers (``state_slots`` in the output) a state slot
    holds the tokens its state has seen: the slot a request reads must hold exactly its
    tokens before the step, and snapshots get its tokens up to their position. A wrong
    block table, a block shared by mistake, a block released too early, a stale
    prefix-cache hit or a wrong state slot changes the output. ``script`` (request id ->
    tokens by output index) overrides the sampled token.

    Speculative decoding: a request with drafts gets next_token() of its context at each
    fed position (drafts included, read back from the slots as well) and keeps the drafts
    that match it, plus the first token that does not (greedy verification).
    """

    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        script: dict[str, list[int]] | None = None,
        windows: Sequence[int | None] = (None,),
    ) -> None:
        self.block_size = block_size
        # slot -> (group, token): a block moved between groups must be rewritten first.
        self.slots: list[tuple[int, int] | None] = [None] * (num_blocks * block_size)
        self.script = script or {}
        self.windows = tuple(windows)
        self.states: dict[int, tuple[int, ...]] = {0: ()}  # slot -> the tokens it has seen
        self.num_steps = 0

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        assert len(out.scheduled_requests) == len(out.num_scheduled_tokens)
        # Decodes (one token past the prompt) first, then every other chunk.
        is_decode = [
            out.num_scheduled_tokens[r.request_id] == 1
            and out.start_positions[r.request_id] >= r.num_prompt_tokens
            for r in out.scheduled_requests
        ]
        assert is_decode == [True] * out.num_decodes + [False] * (len(is_decode) - out.num_decodes)
        assert out.total_num_scheduled_tokens == sum(out.num_scheduled_tokens.values())
        # Write the K/V of every fed token first (as each layer does), then attend.
        for req in out.scheduled_requests:
            rid = req.request_id
            start, n = out.start_positions[rid], out.num_scheduled_tokens[rid]
            tables = out.block_ids[rid]
            assert len(tables) == len(self.windows)
            fed = out.token_ids(req)
            drafts = out.draft_token_ids.get(rid, [])
            assert fed == (req.all_token_ids + drafts)[start : start + n]
            if drafts:  # a decode: the last known token, then the drafts
                assert start == req.num_tokens - 1 and n == 1 + len(drafts)
            for g, (table, window) in enumerate(zip(tables, self.windows, strict=True)):
                assert len(table) * bs >= start + n and len(table) == -(-(start + n) // bs)
                # The null block only stands for blocks a window released: those before
                # the first token the chunk's first query sees.
                first = 0 if window is None else max(start - window + 1, 0)
                assert 0 not in table[first // bs :], f"{rid}: null block inside the window"
                for offset, token in enumerate(fed):
                    pos = start + offset
                    self.slots[table[pos // bs] * bs + pos % bs] = (g, token)
        self._run_states(out)
        sampled: dict[str, list[int]] = {}
        for req in out.scheduled_requests:
            rid = req.request_id
            end = out.start_positions[rid] + out.num_scheduled_tokens[rid]
            drafts = out.draft_token_ids.get(rid, [])
            assert out.samples(rid) == (end == req.num_tokens + len(drafts))
            if not out.samples(rid):
                continue
            want = req.all_token_ids + drafts
            context = want[:end]
            for g, (table, window) in enumerate(zip(out.block_ids[rid], self.windows, strict=True)):
                first = 0 if window is None else max(end - window, 0)
                seen = [self.slots[table[p // bs] * bs + p % bs] for p in range(first, end)]
                if not self.script.get(rid):
                    assert seen == [(g, t) for t in want[first:end]], (
                        f"{rid}: group {g}'s KV cache holds wrong tokens"
                    )
                if window is None:
                    context = [t for _, t in seen]  # the oracle's input, read back
            script = self.script.get(rid)
            tokens = []
            for i in range(len(drafts) + 1):  # verify each draft, then one more token
                num_output = req.num_output_tokens + i
                row_context = context[: req.num_tokens + i]
                token = script[num_output] if script else next_token(row_context)
                tokens.append(token)
                if i == len(drafts) or drafts[i] != token:
                    break
            sampled[rid] = tokens
        self.num_steps += 1
        return ModelRunnerOutput(sampled_token_ids=sampled)

    def _run_states(self, out: SchedulerOutput) -> None:
        """Read every request's state slot, then write final states and snapshots."""
        if not out.state_slots:
            return
        writes: dict[int, tuple[int, ...]] = {}
        for req in out.scheduled_requests:
            rid = req.request_id
            slots = out.state_slots[rid]
            start, n = out.start_positions[rid], out.num_scheduled_tokens[rid]
            seq = tuple(req.prompt_token_ids + req.output_token_ids)
            assert self.states.get(slots.read) == seq[:start], f"{rid}: wrong state read"
            assert slots.write != 0 and slots.write not in writes
            writes[slots.write] = seq[: start + n]
            for position, slot in slots.snapshots:
                assert start < position <= start + n and slot not in (0, *writes)
                assert position % self.block_size == 0
                writes[slot] = seq[:position]
        self.states.update(writes)


def check_pool(pool: BlockPool, tables: Sequence[Sequence[int]]) -> None:
    """Pool invariants: free + used + null == total, ref counts equal table references."""
    expected = [0] * pool.num_blocks
    for table in tables:
        for block_id in table:
            if block_id:  # the null block stands for a released one
                expected[block_id] += 1
    actual = [b.ref_cnt for b in pool.blocks]
    assert pool.null_block.ref_cnt == 0
    assert actual[1:] == expected[1:], "ref counts differ from block-table references"
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.get_num_free_blocks()
    assert {b.block_id for b in free} == {i for i in range(1, pool.num_blocks) if expected[i] == 0}
    num_used = sum(1 for c in expected[1:] if c > 0)
    assert pool.get_num_free_blocks() + num_used + 1 == pool.num_blocks
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash and block.token_ids is not None


def request_of(op: tuple, index: int, eos: frozenset[int]) -> Request:
    """The request of a random stream's ("add", prompt, max_tokens, min_tokens, ignore_eos)
    op, the ``index``-th added (min_tokens at most max_tokens, as admission requires)."""
    _, prompt, max_tokens, min_tokens, ignore_eos = op
    if max_tokens is not None:
        min_tokens = min(min_tokens, max_tokens)
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min_tokens, ignore_eos=ignore_eos)
    return Request(f"r{index}", prompt, params, eos_token_ids=eos)


def check_all_released(scheduler: Scheduler, num_blocks: int) -> None:
    """Once every request has ended nothing leaks: all ``num_blocks`` blocks but the null
    one free and unreferenced, no request's blocks or cached-block counts kept, no live
    state slot."""
    kv = scheduler.kv_cache_manager
    assert kv.get_num_free_blocks() == num_blocks - 1 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    for manager in kv.managers:
        assert manager.req_to_blocks == {} and manager.num_cached_blocks == {}
    if kv.state_pool is not None:
        states = kv.state_pool
        assert states.live == {} and states.num_available() == states.num_slots - 1


def step_token_limit(out: SchedulerOutput, was_running: set[str], budget: int) -> int:
    """The most tokens a step may hold: the budget, or its decodes plus half of it.

    A decode here is a request that was running and computes its last token this step (a
    decode proper, or the last token of a prompt). Decodes never starve prefills, so the
    step may grow past the budget to hold them all and still give prefills ceil(budget / 2).
    """
    num_decodes = sum(
        1
        for r in out.scheduled_requests
        if r.request_id in was_running
        and out.num_scheduled_tokens[r.request_id]
        == 1 + len(out.draft_token_ids.get(r.request_id, ()))
        and out.samples(r.request_id)
    )
    return max(budget, num_decodes + -(-budget // 2))


class OracleProposer:
    """Drafts for the fake model: its true continuation, corrupted from a position chosen
    by the context (deterministic), so drafts are accepted fully, partly or not at all;
    sometimes none (a plain decode after a speculative one)."""

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        seq = list(token_ids)
        if next_token(seq[:-1]) % 4 == 0:
            return []
        wrong_at = next_token(seq) % (k + 2)  # k + 1: every draft right
        drafts = []
        for i in range(k):
            token = next_token(seq)
            if i == wrong_at:
                token = (token + 1) % VOCAB
            drafts.append(token)
            seq.append(token)
        return drafts


def step(
    scheduler: Scheduler,
    model: PagedFakeModel,
    on_output: Callable[[SchedulerOutput], None] | None = None,
) -> SchedulerOutput:
    """One engine step: schedule, run the fake model, update; checks the step's limits."""
    was_running = {r.request_id for r in scheduler.running}
    out = scheduler.schedule()
    cfg = scheduler.scheduler_config
    limit = step_token_limit(out, was_running, cfg.max_num_batched_tokens)
    assert out.total_num_scheduled_tokens <= limit
    assert len(out.scheduled_requests) <= cfg.max_num_seqs
    assert len(scheduler.running) <= cfg.max_num_seqs
    if on_output is not None:
        on_output(out)
    scheduler.update_from_output(out, model.execute(out))
    kv = scheduler.kv_cache_manager
    check_pool(kv.block_pool, [t for r in scheduler.running for t in kv.get_block_ids(r)])
    for manager in kv.managers:
        assert set(manager.req_to_blocks) == {r.request_id for r in scheduler.running}
    # A block belongs to one KV cache group at a time (requests of one group may share it).
    owners: dict[int, int] = {}
    for r in scheduler.running:
        for g, table in enumerate(kv.get_block_ids(r)):
            for block_id in table:
                if block_id:
                    assert owners.setdefault(block_id, g) == g, f"block {block_id} in 2 groups"
    assert all(r.status == RequestStatus.RUNNING for r in scheduler.running)
    assert all(
        r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in scheduler.waiting
    )
    assert len(scheduler.requests) == len(scheduler.running) + len(scheduler.waiting)
    return out


def run_to_completion(scheduler: Scheduler, model: PagedFakeModel, max_steps: int = 1000) -> None:
    """Step until every request has finished; fail (instead of hanging) on a livelock."""
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return
        step(scheduler, model)
    raise AssertionError(f"requests still unfinished after {max_steps} steps")
