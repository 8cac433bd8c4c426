"""One :meth:`EngineRollout.serve <rlflow.rollout.engine.EngineRollout.serve>` call: its rows, lanes and waiting
requests, and the steps of its decode loop.

Every iteration of the loop (:meth:`ServeCall.run`)

1. polls the request source (without blocking while anything decodes) and queues what it hands over; the call's
   first requests may share the prompt head common to all of them (:meth:`ServeCall.poll`);
2. lets a partial rollout's step hook swap the weights (:meth:`ServeCall.before_iteration`);
3. takes waiting requests while the batch has room for their groups (:meth:`ServeCall.take_waiting`) and admits
   them: one prefill per request, its rows' first tokens sampled, its group appended to the lane of its size
   (:meth:`ServeCall.admit`);
4. decodes one token of every live row of every lane in one forward (:meth:`ServeCall.decode`), unless it admitted
   requests that still wait for room next to the running rows;
5. hands back each request whose rows have all finished, keeping their caches inside
   :meth:`EngineRollout.keep_caches <rlflow.rollout.engine.EngineRollout.keep_caches>` (:meth:`ServeCall.finish`);
6. drops the finished groups from their lanes, lazily and by whole groups, after moving the last rows of a
   mostly finished group of ``n >= 4`` into groups of one (:meth:`ServeCall.compact`,
   :meth:`ServeCall.split_stragglers`).

It ends when the source says no request will come and nothing is left to decode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from rlflow.rollout.base import Completion, Progress, SamplingParams
from rlflow.rollout.buffers import VocabBuffers
from rlflow.rollout.continuation import row_caches
from rlflow.rollout.decode_state import DecodeState, LaneStates
from rlflow.rollout.draws import RowDraws
from rlflow.rollout.hardware import without_cudnn_attention
from rlflow.rollout.penalty import mark_seen, seen_tokens
from rlflow.rollout.requests import DecodeRequest, RequestSource
from rlflow.rollout.sampling import sample_tokens


@dataclass
class Row:
    """A sequence being decoded: its prompt, its index in the group and what it has sampled so far."""

    prompt: int  # the id of the row's request (its group) in the serve call
    sample: int
    limit: int  # most tokens this row samples
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    alive: bool = True
    versions: list[int] = field(default_factory=list)  # the policy version of each token (when the engine has one)


@dataclass
class Lane:
    """The rows of one :class:`DecodeState` (groups of ``n``, with or without the call's shared head) in a serve
    call: their next positions and tokens and their random streams, aligned with ``rows``."""

    state: DecodeState
    rows: list[Row] = field(default_factory=list)
    pos: torch.Tensor | None = None
    pending: torch.Tensor | None = None
    draws: RowDraws = field(default_factory=RowDraws)
    seen: torch.Tensor | None = None  # [rows, vocab] tokens each row holds (only with a repetition penalty)

    def mark(self, offset: int, tokens: torch.Tensor) -> None:
        """Record the tokens just sampled by rows ``offset:`` as seen (with a repetition penalty)."""
        if self.seen is not None:
            mark_seen(self.seen[offset:], tokens)


def appended(rows: torch.Tensor | None, more: torch.Tensor) -> torch.Tensor:
    """A lane's per-row tensor (``None`` while the lane has no rows) with ``more`` rows after its own."""
    return more if rows is None else torch.cat([rows, more])


def check_requests(requests: list[DecodeRequest]) -> None:
    """Refuse a request with an empty prompt, no row keys or a ``max_tokens`` below 1."""
    for r in requests:
        if not r.ids:
            raise ValueError(f"request {r.tag!r} has an empty prompt; every prompt needs at least one token")
        if r.n < 1:
            raise ValueError(f"request {r.tag!r} has no row keys; it needs one key per completion")
        if r.max_tokens is not None and r.max_tokens < 1:
            raise ValueError(f"request {r.tag!r} has max_tokens={r.max_tokens}; it must be >= 1")


def record(rows: list[Row], offset: int, tokens: torch.Tensor, lps: torch.Tensor,
           stop_t: torch.Tensor, version: int | None = None) -> set[int]:
    """Append the sampled tokens (and ``version``, if given) to rows ``offset:``; return the indices of rows
    that just finished (a stop token, or their ``limit``)."""
    is_stop = torch.isin(tokens, stop_t).tolist() if stop_t.numel() else [False] * tokens.shape[0]
    finished = set()
    for j, (tok, lp, stop) in enumerate(zip(tokens.tolist(), lps.tolist(), is_stop)):
        row = rows[offset + j]
        if not row.alive:
            continue
        row.tokens.append(tok)
        row.logprobs.append(lp)
        if version is not None:
            row.versions.append(version)
        if stop or len(row.tokens) >= row.limit:
            row.alive = False
            finished.add(offset + j)
    return finished


#: A waiting request: (its id in the call, the request, its kept cache or None).
Waiting = tuple[int, DecodeRequest, object]
#: Rows that just finished: (their lane, their indices in it).
Finished = list[tuple[Lane, set[int]]]


class ServeCall:
    """The state of one serve call on ``engine`` with ``params`` (the engine's fused decoder for the call already
    set), and the steps of its decode loop (:meth:`run`)."""

    def __init__(self, engine: Any, params: SamplingParams, device: torch.device,
                 progress: Progress | None = None) -> None:
        # engine: the EngineRollout whose call this is (not imported here: the engine imports this module)
        self.engine, self.params, self.device, self.progress = engine, params, device, progress
        self.stop_ids = set(params.stop_token_ids)
        self.stop_t = torch.tensor(sorted(self.stop_ids), dtype=torch.long, device=device)
        self.penalty = params.repetition_penalty != 1.0  # rows track the tokens they hold (Lane.seen)
        self.buffers = VocabBuffers()  # the sampler's [rows, vocab] intermediates, reused step after step
        self.session = engine.session
        self.waiting: deque[Waiting] = deque()
        self.requests: dict[int, DecodeRequest] = {}  # admitted requests not finished yet
        self.done: dict[int, list[tuple[int, Completion]]] = {}  # request id -> its finished rows so far
        self.lanes: dict[tuple[int, bool], Lane] = {}  # (group size, shares the head) -> its lane
        self.head = self.head_ids = None  # the call's shared prompt head: its keys/values and its ids
        self.next_id, self.closed, self.iteration = 0, False, 0

    def run(self, source: RequestSource) -> Iterator[tuple[DecodeRequest, list[Completion]]]:
        """Decode what ``source`` hands over; yield ``(request, its completions)`` as each request finishes."""
        while True:
            live = sum(len(lane.rows) for lane in self.lanes.values())
            with without_cudnn_attention(self.device):  # between two yields: the caller's code keeps its kernels
                if not self.closed:
                    self.poll(source, wait=not live and not self.waiting)
                if not self.waiting and not live:
                    if self.closed:
                        return
                    continue
                self.before_iteration()
                take = self.take_waiting(live)
                finished = self.admit(take)
                if not take or (live and not self.waiting):  # one decode step of every live row of every lane (also
                    # right after admitting the last waiting requests next to running rows: they do not lose a step)
                    finished += self.decode()
            yield from self.finish(finished)
            self.compact()

    def poll(self, source: RequestSource, wait: bool) -> None:
        """Queue the requests ``source`` hands over (with their kept caches); note when it closes. The call's
        first requests share their common prefix when the engine finds one worth it."""
        new = source.poll(wait=wait)
        if new is None:
            self.closed = True
            return
        if not new:
            return
        check_requests(new)
        session = self.session
        hits = [session.take(r.ids) if session is not None and len(session) else None for r in new]
        if self.next_id == 0:  # the call's first requests: share their common prefix
            shared = self.engine._share_head(new, hits, self.device)
            if shared is not None:
                self.head_ids, self.head = shared
        for r, hit in zip(new, hits):
            self.waiting.append((self.next_id, r, hit))
            self.next_id += 1

    def before_iteration(self) -> None:
        """Run a partial rollout's step hook; when it changed the weights (the rows keep their caches), rebuild the
        fused decoder on them."""
        engine = self.engine
        if engine.step_hook is not None and engine.step_hook(self.iteration):  # new weights, the caches kept
            engine.sync_weights()  # copied in place: the version counters may not show it
            engine._decoder = engine._fused_decoder(engine.model, self.device)
        self.iteration += 1

    def take_waiting(self, live: int) -> list[Waiting]:
        """Waiting requests, in order, that fit next to ``live`` running rows: at most ``prefill_batch_size``, and
        ``max_batch_size`` rows in all (a group larger than that alone)."""
        take, taken = [], 0
        while self.waiting and len(take) < self.engine.prefill_batch_size:
            n = self.waiting[0][1].n
            if live + taken and live + taken + n > max(self.engine.max_batch_size, n):
                break
            take.append(self.waiting.popleft())
            taken += n
        return take

    def admit(self, take: list[Waiting]) -> Finished:
        """Admit the taken requests: one prefill per request, its rows' first tokens sampled; return the rows that
        finished with them. Requests go to the lane of their group size and whether they start with the shared
        head."""
        chunks: dict[tuple[int, bool], list[Waiting]] = {}
        for item in take:
            r, hit = item[1], item[2]
            shares = self.head is not None and hit is None and len(r.ids) > len(self.head_ids) and \
                r.ids[: len(self.head_ids)] == self.head_ids
            chunks.setdefault((r.n, shares), []).append(item)
        return [self._admit_chunk(key, chunk) for key, chunk in chunks.items()]

    def _admit_chunk(self, key: tuple[int, bool], chunk: list[Waiting]) -> tuple[Lane, set[int]]:
        """Prefill one lane's share of the admitted requests and append their groups to the lane."""
        params, device = self.params, self.device
        n, lane_head = key[0], self.head if key[1] else None
        per_row = n > 1 and self.engine.attention == "rows" and self.session is None  # groups of one, one per row
        lane_key = (1, key[1]) if per_row else key
        lane = self.lanes.get(lane_key)
        if lane is None:
            lane = self.lanes[lane_key] = Lane(DecodeState(lane_key[0], params.max_tokens, lane_head))
        keys, values, mask, logits = self.engine._admit(
            [r.ids for _, r, _ in chunk], [hit for _, _, hit in chunk], device, lane_head)
        offset = len(lane.rows)
        lane.draws.add([k for _, r, _ in chunk for k in r.keys], [r.start for _, r, _ in chunk for _ in range(n)])
        uniform = None if params.greedy else lane.draws.draw(device, offset)
        seen = None
        if self.penalty:  # each row starts with its prompt's tokens seen
            prompt_ids = [torch.tensor(r.ids, device=device) for _, r, _ in chunk]
            padded = torch.nn.utils.rnn.pad_sequence(prompt_ids, batch_first=True, padding_value=-1)
            seen = seen_tokens(padded, logits.shape[-1]).repeat_interleave(n, dim=0)
            lane.seen = appended(lane.seen, seen)
        tokens, lps = sample_tokens(logits.repeat_interleave(n, dim=0) if n > 1 else logits, params,
                                    uniform=uniform, buffers=self.buffers, seen=seen)
        lane.mark(offset, tokens)
        if per_row:  # each row its own copy of its prompt's cache
            keys, values = [k.repeat_interleave(n, 0) for k in keys], [v.repeat_interleave(n, 0) for v in values]
            prompt_ids = [i for i, _, _ in chunk for _ in range(n)]
            lane.state.add_groups(prompt_ids, keys, values, mask.repeat_interleave(n, 0))
        else:
            lane.state.add_groups([i for i, _, _ in chunk], keys, values, mask)
        new_pos = torch.tensor([len(r.ids) for _, r, _ in chunk], device=device).repeat_interleave(n)
        lane.pos, lane.pending = appended(lane.pos, new_pos), appended(lane.pending, tokens)
        for i, r, _ in chunk:
            lane.rows.extend(Row(i, s, r.limit(params.max_tokens)) for s in range(n))
            self.requests[i], self.done[i] = r, []
        return lane, record(lane.rows, offset, tokens, lps, self.stop_t, self.engine.version)

    def decode(self) -> Finished:
        """One decode step of every live row of every lane (one forward for all lanes); return the rows that
        finished."""
        params, device, engine = self.params, self.device, self.engine
        active = list(self.lanes.values())
        if len(active) == 1:
            lane = active[0]
            logits = engine._decode_step(lane.state, lane.pending, lane.pos, engine._decoder)
            uniform = None if params.greedy else lane.draws.draw(device)
            parts = [sample_tokens(logits, params, uniform=uniform, buffers=self.buffers, seen=lane.seen)]
        else:
            state = LaneStates([lane.state for lane in active])
            logits = engine._decode_step(state, torch.cat([lane.pending for lane in active]),
                                         torch.cat([lane.pos for lane in active]), engine._decoder)
            uniform = None if params.greedy else torch.cat([lane.draws.draw(device) for lane in active])
            seen = torch.cat([lane.seen for lane in active]) if self.penalty else None
            tokens, lps = sample_tokens(logits, params, uniform=uniform, buffers=self.buffers, seen=seen)
            parts = list(zip(tokens.split(state.sizes), lps.split(state.sizes)))
        finished = []
        for lane, (tokens, lps) in zip(active, parts):
            lane.pos, lane.pending = lane.pos + 1, tokens
            lane.mark(0, tokens)
            finished.append((lane, record(lane.rows, 0, tokens, lps, self.stop_t, engine.version)))
        return finished

    def finish(self, finished: Finished) -> Iterator[tuple[DecodeRequest, list[Completion]]]:
        """Turn the finished rows into completions; yield each request whose rows are all done, with its group in
        sample order (after ``progress`` heard of it)."""
        for lane, rows_done in finished:
            for i in self._completed_requests(lane, rows_done):
                yield self._hand_back(lane, i)

    def _completed_requests(self, lane: Lane, rows_done: set[int]) -> list[int]:
        """Record the completions of ``lane``'s rows ``rows_done``; return the requests they complete, in order."""
        complete = []
        for j in sorted(rows_done):
            row = lane.rows[j]  # record() marked it dead
            reason = "stop" if row.tokens[-1] in self.stop_ids else "length"
            versions = row.versions if self.engine.version is not None else None
            self.done[row.prompt].append((row.sample, Completion(row.tokens, row.logprobs, reason,
                                                                 token_versions=versions)))
            if len(self.done[row.prompt]) == self.requests[row.prompt].n:
                complete.append(row.prompt)
        return sorted(complete)

    def _hand_back(self, lane: Lane, i: int) -> tuple[DecodeRequest, list[Completion]]:
        """Request ``i`` and its completions, in sample order; keep its rows' caches inside ``keep_caches``."""
        request = self.requests.pop(i)
        n = lane.state.n
        if self.session is not None:  # keep each row's cache (all but its last token, not fed yet)
            first = next(j for j, row in enumerate(lane.rows) if row.prompt == i)
            members = lane.rows[first: first + n]
            caches = row_caches(lane.state, first // n, [len(row.tokens) - 1 for row in members])
            for row, cache in zip(members, caches):
                self.session.put(request.ids + row.tokens[:-1], cache)
        group = [c for _, c in sorted(self.done.pop(i), key=lambda sc: sc[0])]
        if self.progress is not None:
            self.progress(len(group), sum(len(c.token_ids) for c in group))
        return request, group

    def compact(self) -> None:
        """Drop finished groups from each lane, by whole groups (the rows of a group that are all done or moved
        on): a lane stays whole groups in order, so attention needs no scatter; and lazily, since dropping rows
        copies the caches: when a quarter of the lane's rows are such groups' or room is needed. A lane with no
        running group left goes. First, with the engine's ``split_stragglers``, the last rows of mostly finished
        groups move into groups of one (:meth:`split_stragglers`)."""
        if self.engine.split_stragglers and self.session is None:
            self.split_stragglers()
        for key, lane in list(self.lanes.items()):
            n = lane.state.n
            running = [any(r.alive for r in lane.rows[g: g + n]) for g in range(0, len(lane.rows), n)]
            gone = n * running.count(False)
            if gone == len(lane.rows):
                del self.lanes[key]
            elif gone and (4 * gone >= len(lane.rows) or self.waiting):
                keep_list = [j for j in range(len(lane.rows)) if running[j // n]]
                lane.rows = [lane.rows[j] for j in keep_list]
                keep = torch.tensor(keep_list, dtype=torch.long, device=self.device)
                lane.state.keep_rows(keep)
                lane.pos, lane.pending = lane.pos[keep], lane.pending[keep]
                lane.draws.keep(keep_list)
                if lane.seen is not None:
                    lane.seen = lane.seen[keep]

    def split_stragglers(self) -> None:
        """Move the rows still decoding in a group of ``n >= 4`` that has at most ``n // 4`` of them into groups of
        one (the lane of size 1, without the call's shared head). A group's finished rows keep costing every decode
        step while any of its rows runs (the group's rows share its cache layout): with long completions of spread
        lengths, a few long rows would keep whole groups alive. A moved row takes its cache (its prompt's real
        tokens and the tokens it has fed; :func:`~rlflow.rollout.continuation.row_caches`), its position, its
        pending token, its random stream and its seen tokens; it samples what it would have sampled in its group
        (its draws are its own), its attention now without the masked columns of its group's other rows. Its
        place in the old group becomes a finished row, so the group is dropped at compaction. Not inside
        :meth:`~rlflow.rollout.engine.EngineRollout.keep_caches`, whose hand-back reads a group's rows together."""
        for lane in list(self.lanes.values()):
            n = lane.state.n
            if n < 4:
                continue
            for first in range(0, len(lane.rows), n):
                live = [first + s for s, r in enumerate(lane.rows[first: first + n]) if r.alive]
                if live and len(live) <= n // 4:
                    self._move_to_singles(lane, first, live)

    def _move_to_singles(self, lane: Lane, first: int, live: list[int]) -> None:
        """Move rows ``live`` of ``lane``'s group starting at row ``first`` into the lane of groups of one."""
        n = lane.state.n
        members = lane.rows[first: first + n]
        caches = row_caches(lane.state, first // n, [max(len(r.tokens) - 1, 0) for r in members])
        target = self.lanes.get((1, False))
        if target is None:
            target = self.lanes[(1, False)] = Lane(DecodeState(1, self.params.max_tokens))
        at = torch.tensor(live, dtype=torch.long, device=self.device)
        for j in live:
            keys, values = caches[j - first]
            mask = torch.ones((1, keys[0].shape[1]), dtype=torch.long, device=self.device)
            target.state.add_groups([lane.rows[j].prompt], [k[None] for k in keys], [v[None] for v in values], mask)
            row = lane.rows[j]
            target.rows.append(row)
            lane.rows[j] = Row(row.prompt, row.sample, row.limit, alive=False)  # its place: a finished row
        target.draws.extend(lane.draws.take(live))
        target.pos, target.pending = appended(target.pos, lane.pos[at]), appended(target.pending, lane.pending[at])
        if lane.seen is not None:
            target.seen = appended(target.seen, lane.seen[at])
        self.engine.split_rows += len(live)
