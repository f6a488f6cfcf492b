"""Batched generation: many sequences decoded together, fused, with continuous batching.

:class:`BatchGenerator` keeps up to ``max_batch`` sequences (rows) in batched caches
(:class:`~dart_client.models.target.TargetCache` / :class:`~dart_client.models.head.HeadCache`
with ``batch`` > 1: each row of its own length). One :meth:`BatchGenerator.step` is, for
every live row at once:

1. draft  -- ONE head forward over each row's newly accepted positions + mask slots
             (:func:`~dart_client.decoding.draft.draft_rows_batch`);
2. prune  -- ONE ``prune_batch`` call builds every row's tree
             (:func:`~dart_client.decoding.prune.build_trees`);
3. verify -- ONE target forward over all trees, padded to the largest
             (:func:`~dart_client.decoding.verify.verify_trees`);
4. accept -- per row, greedy or recursive rejection with the row's own sampling settings
             and generator; each row's accepted K/V are compacted to its own length;
5. emit   -- per row: length, EOS and stop strings (the single-sequence loop's own code).

``mode="ar"`` runs the same step with root-only trees: one (rows, 1) forward per step.
On the static path (``static``; by default on cuda) steps 3-4 are one fixed-shape program
(:mod:`dart_client.decoding.static_batch`: a CUDA graph on cuda) with greedy acceptance and
compaction on the device.
Rows join between steps (:meth:`add`; a prompt is prefilled alone, then copied into its
row, so a row's cache is exactly what a lone generation's would be) and leave as soon as
they finish or are cancelled (:meth:`cancel`; their slot is free for the next step);
:meth:`pop_finished` hands the results over. :func:`generate_batch` runs a fixed batch to the end.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from dart_client.decoding.accept import accept_greedy, accept_sampling
from dart_client.decoding.autotune import budget_for_rows
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.draft import DraftRows, draft_rows_batch, left_padded
from dart_client.decoding.loop import (
    STAGES,
    DecodingModel,
    GenerationResult,
    StreamEvent,
    _Run,
    new_run,
    node_rows,
)
from dart_client.decoding.prune import build_trees, pruner_max_nodes
from dart_client.decoding.static import (
    StaticVerifier,
    lend_cache,
    resolve_static,
    return_cache,
    static_capacity,
    verifier_for,
)
from dart_client.decoding.static_batch import StaticBatchVerifier
from dart_client.decoding.verify import TreeBatch, verify_trees
from dart_client.errors import ContextTooLongError, InvalidArgumentError
from dart_client.models.target import attention_mask

if TYPE_CHECKING:
    from dart_client.models.target import TargetCache


#: The most tokens (prompts padded to the longest, times their count) one admission forward
#: takes (:meth:`BatchGenerator._together_count`).
ADMIT_TOGETHER_TOKENS = 8192


@dataclass
class _Row:
    """A live sequence: its generation state and what its next draft reads."""

    request: int
    run: _Run
    start: float
    #: The last forward's taps at the accepted positions (r, 3H) and the tokens after them,
    #: for the next draft; or, where the static program drafted already, its rows.
    taps: torch.Tensor | None = None
    next_ids: list[int] | None = None
    rows: DraftRows | None = None


class BatchGenerator:
    """Continuous batching over one model: :meth:`add` requests, :meth:`step` them all at
    once, :meth:`pop_finished` the results.

    ``max_length`` bounds prompt + new tokens of every request (the batched caches are
    allocated for it); ``max_batch`` bounds the live rows (more requests wait their turn);
    ``static``: verify on the static path (``"auto"``: on one cuda device;
    ``GenerationConfig.static``); ``admit_together``: prefill the requests that join at one
    step in one forward (:meth:`_admit_together`; ``"auto"``: on cuda, where a forward costs
    its launches) instead of each alone; ``stream_text``: each step's events carry their text
    delta (False: only the results carry text, decoded once at the end, unless a request has
    stop strings: no per-row decoding each step).

    A request whose ``tree_budget`` is ``"auto"`` takes, at every step, the per-row budget
    tuned for the number of rows live then (:func:`~dart_client.decoding.autotune.
    budget_for_rows`): alone it drafts the lone sequence's tree, in a full batch the smaller
    one each row of that batch can afford.
    """

    def __init__(
        self,
        model: DecodingModel,
        *,
        mode: str = "dart",
        max_batch: int = 8,
        max_length: int = 2048,
        static: bool | str = "auto",
        admit_together: bool | str = "auto",
        stream_text: bool = True,
    ) -> None:
        if mode not in ("dart", "ar"):
            raise InvalidArgumentError(f"mode = {mode!r}; expected 'dart' or 'ar'")
        if mode == "dart" and getattr(model, "eagle3", None) is not None:
            raise InvalidArgumentError(
                "batched generation drafts with a DART head only; an EAGLE-3 model generates "
                "one sequence at a time"
            )
        if mode == "dart" and (model.head is None or model.tree_builder is None):
            raise InvalidArgumentError(
                "this DartModel has no draft head / n-gram pruner: use mode='ar', or load one"
            )
        if max_batch < 1 or max_length < 2:
            raise InvalidArgumentError(
                f"max_batch = {max_batch}, max_length = {max_length}: need >= 1 and >= 2"
            )
        self.model = model
        self.mode = mode
        self.max_batch = max_batch
        self.max_length = max_length
        target = model.target
        self.target = target
        self.device = target.device
        self.head = model.head if mode == "dart" else None
        # A row's tree is written at the frontier (the longest row), not at its own length.
        nodes = pruner_max_nodes(getattr(model.tree_builder, "pruner", None))
        tree = 1 + (max_length if nodes is None else min(nodes, max_length))
        if self.head is None:
            tree = 1
        self.static = resolve_static(static, target.layer_devices())
        if admit_together not in (True, False, "auto"):
            raise InvalidArgumentError(
                f"admit_together = {admit_together!r}; expected True, False or 'auto'"
            )
        #: Whether requests joining at one step are prefilled in one forward.
        self.admit_together = (
            self.device.type == "cuda" if admit_together == "auto" else bool(admit_together)
        )
        self.max_tree = tree
        self.stream_text = stream_text
        #: The static path's verifier, made at the first step (the cache's rows exist then).
        self.verifier: StaticBatchVerifier | None = None
        self.head_cache = None
        held = None
        if self.static:
            # The static caches (and the verifier's graphs with them) outlive the batch: the
            # target keeps them for the next one, as a lone generation's.
            self.cache = lend_cache(target, static_capacity(max_length, tree), batch=max_batch)
            self._release = weakref.finalize(self, return_cache, target, self.cache)
            held = self._held_verifier()
        else:
            self.cache = target.new_cache(max_length + tree, max_batch)
        if held is not None:
            self.verifier, self.head_cache = held, held.head_cache
        elif self.head is not None:
            capacity = self.cache.capacity + self.head.config.draft_length + tree
            self.head_cache = self.head.new_cache(capacity, max_batch)
        for cache in (self.cache, self.head_cache):
            while cache is not None and len(cache.rows):  # a batch dropped mid-run left rows
                cache.drop_row(len(cache.rows) - 1)
        self.rows: list[_Row] = []
        self.waiting: deque[tuple[int, _Run]] = deque()
        self.finished: dict[int, GenerationResult] = {}
        self._ids = itertools.count()
        #: Requests whose tree budget follows the live rows (``tree_budget="auto"``).
        self._auto: set[int] = set()
        #: Seconds per stage over every step (:data:`~dart_client.decoding.loop.STAGES`).
        self.timings = dict.fromkeys(STAGES, 0.0)
        self.steps = 0

    # -- requests ---------------------------------------------------------------------------

    def add(
        self,
        config: GenerationConfig,
        *,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        input_ids: Any = None,
        stream_text: bool | None = None,
    ) -> int:
        """Queue a request; returns its id. Validated now: a bad request (empty, longer than
        the context, ...) raises here and leaves the batch as it was. ``stream_text``: whether
        this request's events carry their text delta (None: the generator's
        ``stream_text``)."""
        auto = self.mode == "dart" and config.tree_budget == "auto"
        if auto:
            config = config.replace(tree_budget=None)  # bounded at each step instead
        run = new_run(self.model, config, self.mode, prompt, messages, input_ids)
        if not (self.stream_text if stream_text is None else stream_text):
            run.decode_at_end()
        if run.max_length > self.max_length:
            if len(run.prompt) >= self.max_length:
                raise ContextTooLongError(
                    f"the prompt has {len(run.prompt)} tokens; this batch's max_length "
                    f"({self.max_length}) leaves no room for a new token"
                )
            run.max_length = self.max_length
        request = next(self._ids)
        self.waiting.append((request, run))
        if auto:
            self._auto.add(request)
        return request

    @property
    def live(self) -> int:
        """Sequences being decoded."""
        return len(self.rows)

    @property
    def done(self) -> bool:
        """Nothing live and nothing waiting."""
        return not self.rows and not self.waiting

    def pop_finished(self) -> dict[int, GenerationResult]:
        """The results of the requests finished since the last call, by request id."""
        out, self.finished = self.finished, {}
        return out

    def cancel(self, request: int) -> bool:
        """Drop a waiting or live request (no result); its row is free for the next step.
        False when it is unknown or already finished."""
        for i, (waiting, _) in enumerate(self.waiting):
            if waiting == request:
                del self.waiting[i]
                self._auto.discard(request)
                return True
        for b, row in enumerate(self.rows):
            if row.request == request:
                self._free(b)
                return True
        return False

    def close(self) -> None:
        """Give the static caches back to the target (for the next batch); the generator is
        unusable after. Dropping it does the same."""
        if self.static:
            self._release()

    def _verifier_key(self) -> tuple[Any, ...]:
        head = self.head
        top_k = self.model.draft_top_k if head is not None else 0
        return ("batch", id(head) if head is not None else None, top_k, self.device.type == "cuda")

    def _held_verifier(self) -> StaticBatchVerifier | None:
        """The verifier an earlier batch left on this cache for this head and setting, if
        its trees' buckets still hold ours (its head cache comes with it)."""
        held = self.cache.static_verifiers.get(self._verifier_key())
        if (
            isinstance(held, StaticBatchVerifier)
            and held.target is self.target
            and held.head is self.head
            and held.buckets[-1] >= self.max_tree
            and (self.head is None or held.head_cache is not None)
        ):
            return held
        return None

    def _verifier(self) -> StaticBatchVerifier:
        if self.verifier is None:
            self.verifier = StaticBatchVerifier(
                self.target,
                self.cache,
                self.max_tree,
                graphs=self.device.type == "cuda",
                head=self.head,
                head_cache=self.head_cache,
                top_k=self.model.draft_top_k,
            )
            self.cache.static_verifiers[self._verifier_key()] = self.verifier
        return self.verifier

    def _free(self, b: int) -> None:
        """Free row ``b``: the last live row moves into it, in the caches and here."""
        self._auto.discard(self.rows[b].request)
        self.cache.drop_row(b)
        if self.head_cache is not None:
            self.head_cache.drop_row(b)
        self.rows[b] = self.rows[-1]
        self.rows.pop()

    # -- decoding ---------------------------------------------------------------------------

    @torch.no_grad()
    def _admit(self) -> list[tuple[int, StreamEvent]]:
        """Prefill waiting requests into free rows and emit their first tokens: each alone
        (its cache is a lone generation's), or with :attr:`admit_together` as many at a time
        as fit in one forward (:meth:`_admit_together`)."""
        events = []
        while self.waiting and len(self.rows) < self.max_batch:
            take = self._together_count() if self.admit_together else 1
            if take > 1:
                events += self._admit_together(take)
                continue
            request, run = self.waiting.popleft()
            start = run._clock()
            prompt = run.prompt
            with self._prefilled(prompt) as (last, taps, single, static):
                event, row, first = self._first_token(request, run, start, last)
                events.append((request, event))
                if row is None:
                    continue
                slot = len(self.rows)
                self.cache.put_row(slot, single)
                if static is not None and static.head_cache is not None:
                    # The head read the prompt in the prefill's programs: its first draft.
                    assert self.head_cache is not None
                    row.rows = static.first_draft(first)
                    self.head_cache.put_row(slot, static.head_cache)
            if self.head is not None and row.rows is None:
                assert taps is not None and self.head_cache is not None
                ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
                # The head reads the prompt's positions but the last now; the last (with
                # the first token) joins the row's first batched draft.
                head_single = self.head.new_cache(len(prompt) + self.head.config.draft_length)
                if len(prompt) > 1:
                    self.head(
                        taps[:, :-1].to(self.head.fc.weight.dtype),
                        ids[:, 1:],
                        head_single,
                        num_masks=0,
                    )
                self.head_cache.put_row(slot, head_single)
                row.taps, row.next_ids = taps[0, -1:], [first]
            self.rows.append(row)
            run.timings["prefill"] += run._clock() - start
        return events

    def _together_count(self) -> int:
        """How many of the waiting requests the next admission forward takes: as many as
        there are free rows, while their prompts padded to the longest stay within
        :data:`ADMIT_TOGETHER_TOKENS` (a long prompt beside short ones would pad them all to
        its length: attention's scores grow with the square of it)."""
        free = self.max_batch - len(self.rows)
        width = count = 0
        for _, run in itertools.islice(self.waiting, free):
            width = max(width, len(run.prompt))
            if (count + 1) * width > ADMIT_TOGETHER_TOKENS:
                break
            count += 1
        return max(count, 1)

    def _first_token(
        self, request: int, run: _Run, start: float, last: torch.Tensor
    ) -> tuple[StreamEvent, _Row | None, int]:
        """The first token picked from the prefill's ``last`` logits and emitted: the event,
        the row the request goes on in (None: it finished already, with its result) and the
        token."""
        first = run._pick(last)
        event = run._emit([first], 1, 0, {}, last.unsqueeze(0))
        if run.finish is None:
            return event, _Row(request, run, start), first
        run.timings["prefill"] += run._clock() - start
        self.finished[request] = run.result(start)
        self._auto.discard(request)
        return event, None, first

    def _admit_together(self, take: int) -> list[tuple[int, StreamEvent]]:
        """The next ``take`` waiting prompts prefilled in one forward, left-padded to the
        longest (each at its own positions, seeing only itself: :func:`left_padded`), the
        head reading them in one forward too, then copied into free rows; each row's first
        draft comes with the next step's. One forward instead of ``take`` pays where a
        forward costs its launches more than its arithmetic (a GPU: on the static path each
        lone prefill is several programs). A row's numbers are then those of a batched
        forward, equal to a lone prefill's in exact arithmetic, in bf16 up to rounding."""
        taken = [self.waiting.popleft() for _ in range(take)]
        start = taken[0][1]._clock()
        prompts = [run.prompt for _, run in taken]
        width = max(len(p) for p in prompts)
        pads = [width - len(p) for p in prompts]
        device = self.device
        ids = torch.zeros((take, width), dtype=torch.long)
        for b, (prompt, pad) in enumerate(zip(prompts, pads, strict=True)):
            ids[b, pad:] = torch.tensor(prompt, dtype=torch.long)
        ids = ids.to(device)
        positions, sees = left_padded(pads, width, device)
        together = self.target.new_cache(width, take)
        logits, taps = self.target.forward(
            ids, positions, together, tree_mask=sees, logits_to_keep=1, taps=self.head is not None
        )
        head_together = None
        if self.head is not None and width > 1:
            assert taps is not None
            # The head reads every prompt position but the last (with the token after it);
            # the last joins the row's first batched draft, as after a lone prefill.
            head_together = self.head.new_cache(width - 1, take)
            head_positions, head_sees = left_padded(pads, width - 1, device)
            dtype = self.head.fc.weight.dtype
            self.head(
                taps[:, :-1].to(dtype),
                ids[:, 1:],
                head_together,
                num_masks=0,
                positions=head_positions,
                mask=attention_mask(width - 1, 0, head_sees, dtype, device),
            )
        events = []
        admitted = []
        for b, (request, run) in enumerate(taken):
            event, row, first = self._first_token(request, run, start, logits[b, -1])
            events.append((request, event))
            if row is None:
                continue
            slot = len(self.rows)
            n = len(run.prompt)
            self.cache.put_row(slot, together, source_row=b, span=(pads[b], n))
            if self.head is not None:
                assert taps is not None and self.head_cache is not None
                if head_together is None:  # one-token prompts: nothing for the head yet
                    self.head_cache.put_row(slot, self.head.new_cache(1))
                else:
                    self.head_cache.put_row(
                        slot, head_together, source_row=b, span=(pads[b], n - 1)
                    )
                row.taps, row.next_ids = taps[b, -1:], [first]
            self.rows.append(row)
            admitted.append(run)
        for run in admitted:
            run.timings["prefill"] += run._clock() - start
        return events

    @contextlib.contextmanager
    def _prefilled(
        self, prompt: list[int]
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None, TargetCache, StaticVerifier | None]]:
        """A prompt prefilled alone: its last logits, its taps (with a head), the
        one-sequence cache that holds it (for :meth:`TargetCache.put_row`, inside the block)
        and on the static path the verifier that prefilled it. There in fixed-shape chunks
        over a static cache the target lends (graphs on cuda, as a lone generation's
        prefill), the head reading the prompt in the same programs (its cache the verifier's,
        :meth:`StaticVerifier.first_draft` next), not one eager forward."""
        target = self.target
        if not self.static:
            ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
            positions = torch.arange(len(prompt), device=self.device).unsqueeze(0)
            single = target.new_cache(len(prompt))
            logits, taps = target.forward(
                ids, positions, single, logits_to_keep=1, taps=self.head is not None
            )
            yield logits[0, -1], taps, single, None
            return
        # The batch's length limit, not the prompt's: one cache (and its graphs) serves all.
        single = lend_cache(target, static_capacity(self.max_length, 1))
        try:
            verifier = verifier_for(
                target,
                single,
                1,
                graphs=self.device.type == "cuda",
                head=self.head,
                top_k=self.model.draft_top_k,
            )
            verifier.clear_tail()
            if verifier.head_cache is not None:
                verifier.head_cache.truncate(0)
            last, taps = verifier.prefill(prompt)
            yield last, taps, single, verifier
        finally:
            return_cache(target, single)

    def step(self) -> list[tuple[int, StreamEvent]]:
        """Admit waiting requests, then one fused step over every live row. Returns the
        (request id, event) of every row that produced tokens (first tokens included)."""
        events = self._admit()
        if not self.rows:
            return events
        rows = self.rows
        clock = rows[0].run._clock
        stage: dict[str, float] = {}
        t = clock()

        def lap(name: str) -> None:
            nonlocal t
            now = clock()
            stage[name] = stage.get(name, 0.0) + now - t
            t = now

        budgets = [row.run.tree_budget_now() for row in rows]
        if self._auto:
            cap = budget_for_rows(self.model, len(rows), self.max_batch)
            budgets = [
                min(b, cap) if row.request in self._auto else b
                for row, b in zip(rows, budgets, strict=True)
            ]
        if self.head is not None:
            assert self.head_cache is not None
            pending = [row.taps is not None for row in rows]
            if any(pending):
                # One head forward for the rows with new positions; a row the static program
                # drafted already brings none (its output is not used).
                some = next(row.taps for row in rows if row.taps is not None)
                none = some.new_empty((0, some.shape[-1]))
                drafted = draft_rows_batch(
                    self.head,
                    self.head_cache,
                    [row.taps if row.taps is not None else none for row in rows],
                    [row.next_ids if row.next_ids is not None else [] for row in rows],
                    self.model.draft_top_k,
                )
                for row, fresh, was_pending in zip(rows, drafted, pending, strict=True):
                    if was_pending:
                        row.rows, row.taps, row.next_ids = fresh, None, None
            drafts: list[DraftRows] = []
            for row in rows:
                assert row.rows is not None
                drafts.append(row.rows)
            lap("draft")
            inputs = [
                row.run.pruner_inputs(max(b, 0)) for row, b in zip(rows, budgets, strict=True)
            ]
            assert self.model.tree_builder is not None
            trees = build_trees(
                self.model.tree_builder,
                [c for c, _ in inputs],
                drafts,
                [max(b, 0) for b in budgets],
                [p for _, p in inputs],
            )
            lap("prune")
        else:
            trees = TreeBatch.roots([row.run.generated[-1] for row in rows])
        frontier = self.cache.length
        row_taps: list[torch.Tensor] | None = None
        # The greedy program accepts on the device and returns no logits: a row reporting
        # log probabilities takes the forward (as sampling rows do), and so does a row whose
        # end tokens are still masked (min_tokens).
        if self.static and all(
            row.run.params.greedy and row.run.logprobs is None and not row.run.early()
            for row in rows
        ):
            # One copy in, one program (forward, acceptance, compaction), one copy out.
            verifier = self._verifier()
            loaded = verifier.load(trees)
            lap("inputs")
            out = verifier.run_greedy(loaded)
            lap("verify")
            outcome = verifier.accepted(loaded, out, trees)
            accepted = outcome.acceptances
            if outcome.rows is not None:
                # Drafted in the same program: the next step prunes these.
                for row, fresh in zip(rows, outcome.rows, strict=True):
                    row.rows = fresh
            lap("accept")
        else:
            if self.static:
                logits, taps = self._verifier().forward(trees)
                lap("verify")
            else:
                logits, taps = verify_trees(
                    self.target, self.cache, trees, taps=self.head is not None
                )
                forward = self.target.last_forward_seconds
                lap("inputs")
                stage["inputs"] -= forward
                stage["verify"] = forward
            accepted = []
            for b, (row, tree) in enumerate(zip(rows, trees, strict=True)):
                run = row.run
                allowed = run.allowed(logits[b], tree.depths)
                accepted.append(
                    accept_greedy(tree, allowed)
                    if run.params.greedy
                    else accept_sampling(tree, allowed, run.params, run.generator)
                )
            lap("accept")
            self.cache.keep_rows(frontier, [a.nodes for a in accepted], self.device)
            lap("compact")
            if taps is not None and self.head is not None:
                row_taps = []
                for b, acc in enumerate(accepted):
                    index = torch.tensor(acc.nodes, dtype=torch.long, device=self.device)
                    row_taps.append(taps[b].index_select(0, index))
        for b, (row, acc) in enumerate(zip(rows, accepted, strict=True)):
            new = acc.new_tokens
            scores = None if row.run.logprobs is None else node_rows(logits[b], acc)
            events.append((row.request, row.run._emit(new, len(new), trees.size(b), stage, scores)))
            if row_taps is not None and self.head is not None:
                row.taps, row.next_ids, row.rows = row_taps[b], new, None
        lap("emit")
        self.steps += 1
        for name, seconds in stage.items():
            self.timings[name] += seconds
            for row in rows:
                row.run.timings[name] += seconds
        # Finished rows leave now, the highest first (the last live row moves into a freed
        # one, so lower indices stay valid).
        for b in reversed(range(len(rows))):
            row = rows[b]
            if row.run.finish is None:
                continue
            self.finished[row.request] = row.run.result(row.start)
            self._free(b)
        return events


def generate_batch(
    model: DecodingModel,
    prompts: Sequence[Any],
    config: GenerationConfig,
    *,
    mode: str = "dart",
    max_batch: int | None = None,
    admit_together: bool | str = "auto",
) -> list[GenerationResult]:
    """Generate for every prompt (text, or token ids) together, fused: the results in
    order. At most ``max_batch`` (default: all) are decoded at once; the others take the
    rows the finished ones free. ``config.tree_budget`` must be resolved
    (``DartModel.generate_batch`` does it); ``admit_together``: :class:`BatchGenerator`'s.
    Every prompt is validated before anything runs."""
    if not prompts:
        return []
    limit = model.target.max_positions
    max_length = config.max_length if limit is None else min(config.max_length, limit)
    rows = len(prompts) if max_batch is None else min(max_batch, len(prompts))
    batch = BatchGenerator(
        model,
        mode=mode,
        max_batch=rows,
        max_length=max_length,
        static=config.static,
        admit_together=admit_together,
        stream_text=False,  # only the results are returned
    )
    ids = []
    for i, prompt in enumerate(prompts):
        text = prompt if isinstance(prompt, str) else None
        try:
            ids.append(
                batch.add(config, prompt=text, input_ids=None if text is not None else prompt)
            )
        except InvalidArgumentError as err:  # empty, too long, ...: say which prompt
            raise type(err)(f"prompt {i}: {err}") from None
    results: dict[int, GenerationResult] = {}
    try:
        while not batch.done:
            batch.step()
            results.update(batch.pop_finished())
    finally:
        batch.close()
    results.update(batch.pop_finished())
    return [results[i] for i in ids]
