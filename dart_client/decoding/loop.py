"""The generation loop: speculative (lossless) DART decoding and the autoregressive baseline.

One DART step, as one token's trip reads top to bottom:

1. draft   -- one head forward over the newly accepted real positions + the mask slots
              (:mod:`dart_client.decoding.draft`), top-k per row;
2. prune   -- the Rust pruner turns the rows into a draft tree (node 0 = the token just
              sampled), its size shrunk near ``max_length`` / ``max_new_tokens``;
   (steps 1 and 2 are a :class:`Drafter`'s: DART's, or EAGLE-3's, whose tree grows by
   draft-model forwards, :mod:`dart_client.decoding.eagle3`)
3. verify  -- one target forward over every node (:mod:`dart_client.decoding.verify`);
4. accept  -- greedy or recursive rejection (:mod:`dart_client.decoding.accept`); the
              accepted nodes' K/V are compacted in place and their taps feed the next draft.

``mode="ar"`` runs plain autoregressive decoding on the same target wrapper, cache, warpers
and seed handling, so the two are comparable for speed and for losslessness.

Every step's time falls in exactly one stage of :data:`STAGES` (see
:class:`GenerationResult`); ``verify`` is only the time inside the target's forward call, so
``step time - verify`` is the cost of everything that is not a target forward.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from dart_client.decoding.accept import (
    Acceptance,
    accept_greedy,
    accept_sampling,
    greedy_token,
    mask_end_tokens,
)
from dart_client.decoding.config import GenerationConfig
from dart_client.decoding.draft import DraftRows, draft_rows
from dart_client.decoding.logprobs import TokenLogprob, token_logprobs
from dart_client.decoding.lookup import PromptLookupConfig, parse_prompt_lookup
from dart_client.decoding.prune import TreeBuilder, build_tree
from dart_client.decoding.sampling import SamplingParams, make_generator, sample, target_probs
from dart_client.decoding.static import (
    StaticVerifier,
    lend_cache,
    resolve_static,
    return_cache,
    static_capacity,
    static_head_capacity,
    verifier_for,
)
from dart_client.decoding.verify import ROOT_DEPTHS, Tree, verify_tree
from dart_client.errors import ContextTooLongError, EmptyPromptError, InvalidArgumentError

if TYPE_CHECKING:
    from dart_client.models.head import DartHead
    from dart_client.models.target import TargetModel

#: Keys of :attr:`GenerationResult.timings` (documented there).
STAGES = ("prefill", "draft", "prune", "inputs", "verify", "accept", "compact", "emit")

#: Tokens of context handed to the pruner: it only reads the last order-1 of them.
PRUNER_CONTEXT = 8


@dataclass
class PrefixCache:
    """The target's and the head's KV caches of a conversation, kept between generations.

    Pass the same ``PrefixCache`` to every turn (``model.generate(..., prefix_cache=pc)``):
    a prompt that starts with the tokens already cached prefills only what follows them (a
    chat's next turn), any other prompt prefills from where the two part (from 0 at worst).
    The outputs are those of a full prefill. ``reset()`` forgets the conversation.
    """

    tokens: list[int] = field(default_factory=list)
    cache: Any = None
    head_cache: Any = None
    #: Tokens the last generation took from the cache (its prefill skipped them).
    reused: int = 0

    def reset(self) -> None:
        self.tokens, self.cache, self.head_cache, self.reused = [], None, None, 0

    def _start(self, prompt: list[int], capacity: int, head_capacity: int | None) -> int:
        """Where this prompt's prefill starts: the cached tokens it shares, less one (whose
        taps the head reads again); 0 when the caches are too small for this generation
        (``head_capacity`` None: no head runs)."""
        cache = self.cache
        if cache is None or cache.capacity < capacity:
            return 0
        head = head_capacity is not None
        if head and (self.head_cache is None or self.head_cache.capacity < head_capacity):
            return 0
        shared = 0
        for a, b in zip(self.tokens, prompt, strict=False):
            if a != b:
                break
            shared += 1
        start = max(min(shared, len(prompt)) - 1, 0)
        start = min(start, cache.length)
        if head:
            start = min(start, self.head_cache.length)
        return start


@dataclass
class GenerationResult:
    """What a generation produced, and how fast.

    ``tokens`` are the new tokens only (the EOS token included when generation stopped on
    it, the token completing a stop string included), never more than ``max_new_tokens``;
    ``text`` is their decoding without special tokens, cut before a stop string.
    ``accept_lengths`` counts the tokens each step produced (accepted drafts + the bonus,
    the prefill's first token being step 0's 1); ``tau`` is their mean over the
    speculative steps, as papers report it.

    ``timings`` (seconds, keys :data:`STAGES`): ``prefill`` is the target's and the head's
    passes over the prompt and the first token's pick; then, summed over the steps, each
    step's time in exactly one of

    * ``draft``   -- the head forward over the last step's accepted positions, top-k, the
      transfer of the rows to the CPU (DART); for EAGLE-3 also the tree's growth, which is
      draft-model forwards (its ``prune`` is then zero);
    * ``prune``   -- the tree builder (the Rust pruner, in-process or remote) and its inputs;
    * ``inputs``  -- everything around the target's forward call: node ids, positions, the
      attention mask, the gathered taps;
    * ``verify``  -- the target's forward call itself (over the tree, or one token for AR);
    * ``accept``  -- greedy or rejection acceptance (the bonus token's pick for AR);
    * ``compact`` -- moving the accepted nodes' K/V into place;
    * ``emit``    -- length/EOS/stop checks and the incremental detokenisation of the step's
      tokens (the stream consumer's time is not counted).

    ``elapsed - sum(timings)`` is the loop's own bookkeeping, the final text's decoding and,
    when streaming, the consumer's time between events. All are read from the target's
    ``clock`` (wall time unless a profile chose otherwise).
    """

    text: str
    tokens: list[int]
    prompt_tokens: int
    accept_lengths: list[int]
    timings: dict[str, float]
    elapsed: float
    finish_reason: str  # "eos" | "stop" | "length"
    mode: str  # "dart" | "ar"
    tree_sizes: list[int] = field(default_factory=list)
    #: With ``GenerationConfig.logprobs`` set: one per token of ``tokens``.
    logprobs: list[TokenLogprob] | None = None

    @property
    def steps(self) -> int:
        """Target forwards after the prefill."""
        return max(0, len(self.accept_lengths) - 1)

    @property
    def tau(self) -> float:
        """Mean tokens per target forward after the prefill (incl. the bonus token)."""
        spec = self.accept_lengths[1:]
        return sum(spec) / len(spec) if spec else 0.0

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.elapsed if self.elapsed > 0 else 0.0


@dataclass
class StreamEvent:
    """One step of a streamed generation: new text, new tokens and that step's statistics."""

    text: str
    tokens: list[int]
    accept_length: int
    tree_size: int
    timings: dict[str, float]
    #: With ``GenerationConfig.logprobs`` set: one per token of ``tokens``.
    logprobs: list[TokenLogprob] | None = None


class GenerationStream:
    """Iterator of :class:`StreamEvent`; ``.result`` holds the full result once exhausted."""

    def __init__(self, events: Iterator[StreamEvent | GenerationResult]) -> None:
        self._events = events
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[StreamEvent]:
        for event in self._events:
            if isinstance(event, GenerationResult):
                self.result = event
            else:
                yield event


class Drafter(Protocol):
    """What drafts a step's tree from the target's taps at the accepted positions: DART's
    head + pruner (:class:`DartDrafter`) or EAGLE-3's head (``Eagle3Drafter``). One per
    generation; the loop owns its cache (kept across turns by a :class:`PrefixCache`)."""

    #: The stage :meth:`tree` is timed under: ``"prune"`` (DART: the pruner) or
    #: ``"draft"`` (EAGLE-3: the tree grows by draft-model forwards).
    tree_stage: str

    def cache_capacity(self, max_length: int) -> int: ...

    def new_cache(self, capacity: int) -> Any: ...

    def feed(self, cache: Any, taps: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Read r new real positions: the target's ``taps`` (1, r, 3H) and the token after
        each, ``next_ids`` (1, r) (the last is the token just sampled)."""
        ...

    def tree(self, context: np.ndarray, budget: int, lookup_path: np.ndarray | None = None) -> Tree:
        """The draft tree under root ``context[-1]``, at most ``budget`` nodes besides it."""
        ...


class DartDrafter:
    """DART's :class:`Drafter`: the head's rows (:func:`draft_rows`) pruned into a tree."""

    tree_stage = "prune"

    def __init__(self, head: DartHead, builder: TreeBuilder, top_k: int) -> None:
        self.head = head
        self.builder = builder
        self.top_k = top_k
        self.rows: DraftRows | None = None

    def cache_capacity(self, max_length: int) -> int:
        return max_length + self.head.config.draft_length

    def new_cache(self, capacity: int) -> Any:
        return self.head.new_cache(capacity)

    def feed(self, cache: Any, taps: torch.Tensor, next_ids: torch.Tensor) -> None:
        self.rows = draft_rows(self.head, cache, taps, next_ids, self.top_k)

    def tree(self, context: np.ndarray, budget: int, lookup_path: np.ndarray | None = None) -> Tree:
        if self.rows is None:
            raise RuntimeError("feed() the accepted positions before building a tree")
        return build_tree(self.builder, context, self.rows, budget, lookup_path)


def new_drafter(model: DecodingModel) -> Drafter | None:
    """The model's drafter for one generation (its ``new_drafter()`` when it has one), else
    DART's from its head and tree builder; None when it has neither."""
    factory = getattr(model, "new_drafter", None)
    if factory is not None:
        drafter: Drafter | None = factory()
        return drafter
    if model.head is None or model.tree_builder is None:
        return None
    return DartDrafter(model.head, model.tree_builder, model.draft_top_k)


class DecodingModel(Protocol):
    """What the loop reads of a model (``DartModel`` has it all)."""

    target: TargetModel
    head: DartHead | None
    tokenizer: Any
    tree_builder: TreeBuilder | None
    draft_top_k: int
    prompt_lookup: PromptLookupConfig | None

    def encode_input(
        self,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        input_ids: Any = None,
    ) -> list[int]: ...


def generate(
    model: DecodingModel,
    config: GenerationConfig,
    *,
    mode: str = "dart",
    prompt: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    input_ids: Any = None,
    stream: bool = False,
    prefix_cache: PrefixCache | None = None,
    stream_text: bool = True,
) -> GenerationResult | GenerationStream:
    """The generation loop: ``mode="dart"`` (speculative, lossless) or ``"ar"`` (the baseline).

    Exactly one of ``prompt`` (text), ``messages`` (chat, formatted with the model's template)
    or ``input_ids`` is given. ``config.tree_budget`` is the resolved node budget (an int, or
    None for the tree builder's own limit: see ``DartModel.generate``); the room left for new
    tokens caps it. ``stream=True`` returns a :class:`GenerationStream`, whose events carry
    their text delta unless ``stream_text=False`` (the result's text is decoded once at the
    end, as without ``stream``).
    """
    run = new_run(model, config, mode, prompt, messages, input_ids, prefix_cache)
    if not (stream and stream_text):
        run.decode_at_end()
    if stream:
        return GenerationStream(run.events())
    result = None
    for event in run.events():
        if isinstance(event, GenerationResult):
            result = event
    assert result is not None
    return result


def new_run(
    model: DecodingModel,
    config: GenerationConfig,
    mode: str,
    prompt: str | None = None,
    messages: Sequence[dict[str, str]] | None = None,
    input_ids: Any = None,
    prefix_cache: PrefixCache | None = None,
) -> _Run:
    """One generation's validated state (what :func:`generate` and a batch's row share)."""
    if mode not in ("dart", "ar"):
        raise InvalidArgumentError(f"mode = {mode!r}; expected 'dart' or 'ar'")
    drafter = new_drafter(model) if mode == "dart" else None
    if mode == "dart" and drafter is None:
        raise InvalidArgumentError(
            "this DartModel has no draft head / n-gram pruner: use ar_generate, or load one"
        )
    if config.tree_budget == "auto":
        raise InvalidArgumentError(
            "tree_budget 'auto' is resolved by DartModel.tune() (DartModel.generate does it)"
        )
    tree_budget = config.tree_budget if mode == "dart" else None
    lookup = model.prompt_lookup
    if config.prompt_lookup is not None:
        lookup = parse_prompt_lookup(config.prompt_lookup)
    stops = list(config.stop)
    if stops and model.tokenizer is None:
        raise InvalidArgumentError("stop strings need a tokenizer to decode the output")
    ids = model.encode_input(prompt=prompt, messages=messages, input_ids=input_ids)
    outside = [t for t in config.stop_token_ids if t >= model.target.vocab_size]
    if outside:
        raise InvalidArgumentError(
            f"stop_token_ids {outside}: outside the target's vocabulary of "
            f"{model.target.vocab_size} tokens"
        )
    if not ids:
        raise EmptyPromptError("the prompt is empty: at least one token is needed")
    # The target's position limit caps max_length (positions past it are out of distribution).
    max_length = config.max_length
    limit = model.target.max_positions
    bound = "max_length"
    if limit is not None and max_length > limit:
        max_length, bound = limit, "the target's max_position_embeddings"
    if len(ids) >= max_length:
        raise ContextTooLongError(
            f"the prompt has {len(ids)} tokens; {bound} ({max_length}) leaves no room for a "
            f"new token (raise max_length above {len(ids)} or shorten the prompt)"
        )
    # The static path drafts with a DART head (its graphs hold the head's forward): another
    # drafter runs on the dynamic path ("auto"), or is refused when asked for explicitly.
    static = resolve_static(config.static, model.target.layer_devices())
    if static and drafter is not None and not isinstance(drafter, DartDrafter):
        if config.static is True:
            raise InvalidArgumentError(
                f"static=True: the static path drafts with DART's head in its graphs; "
                f"{type(drafter).__name__} drafts on the dynamic path (static='auto' or False)"
            )
        static = False
    return _Run(
        model,
        drafter,
        mode,
        ids,
        config.sampling,
        config.max_new_tokens,
        max_length,
        stops,
        None if tree_budget is None else int(tree_budget),
        config.seed,
        lookup if mode == "dart" else None,
        prefix_cache,
        static,
        config.logprobs,
        config.ignore_eos,
        config.stop_token_ids,
        config.min_tokens,
    )


class _Run:
    """The state of one generation; ``events()`` drives it step by step."""

    def __init__(
        self,
        model: DecodingModel,
        drafter: Drafter | None,
        mode: str,
        ids: list[int],
        params: SamplingParams,
        max_new: int,
        max_length: int,
        stops: list[str],
        tree_budget: int | None,
        seed: int | None,
        lookup: PromptLookupConfig | None,
        prefix_cache: PrefixCache | None = None,
        static: bool = False,
        logprobs: int | None = None,
        ignore_eos: bool = False,
        stop_token_ids: Sequence[int] = (),
        min_tokens: int = 0,
    ) -> None:
        self.model = model
        self.drafter = drafter
        self.static = static
        self.prefix_cache = prefix_cache
        self.target = model.target
        self.mode = mode
        self.prompt = ids
        self.params = params
        self.max_new = max_new
        self.max_length = max_length
        self.stops = stops
        self.tree_budget = tree_budget
        self.device = self.target.device
        self.generator = make_generator(seed, self.device)
        self.timings = dict.fromkeys(STAGES, 0.0)
        self.generated: list[int] = []
        self.accept_lengths: list[int] = []
        self.tree_sizes: list[int] = []
        self.finish: str | None = None
        self.sync = self.device.type == "cuda"
        self.emitted_text = ""
        tokenizer = model.tokenizer
        self.detok = IncrementalText(tokenizer) if tokenizer is not None else None
        self.stop_scanned = 0  # characters of self.detok.text already searched for stops
        self.lookup = lookup
        self.lookup_index = lookup.new_index() if lookup is not None else None
        if self.lookup_index is not None:
            self.lookup_index.extend(ids)
        self.final_text: tuple[int, str] | None = None  # (tokens decoded, text) of _text()
        # Alternatives per token when log probabilities are reported, and theirs so far.
        self.logprobs_top = logprobs
        self.logprobs: list[TokenLogprob] | None = [] if logprobs is not None else None
        # The tokens that end the output: end-of-sequence (unless ignored) and the stop ids.
        eos = () if ignore_eos else self.target.eos_token_ids
        self.eos: frozenset[int] = frozenset(eos) | frozenset(stop_token_ids)
        # New tokens before any of self.eos may come.
        self.min_tokens = min_tokens

    def early(self) -> bool:
        """Whether the next token still comes before ``min_tokens`` (the end tokens masked:
        the static greedy program, which does not mask, is not used then)."""
        return len(self.generated) < self.min_tokens and bool(self.eos)

    def allowed(self, logits: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
        """The target's ``logits`` for tree nodes at ``depths`` below the last token, the end
        tokens masked where their token comes before ``min_tokens``."""
        return mask_end_tokens(logits, depths, len(self.generated), self.min_tokens, self.eos)

    def _clock(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return self.target.clock()

    def _pick(self, logits: torch.Tensor) -> int:
        """The token after the prompt (``logits``: its row), as the steps choose theirs."""
        logits = self.allowed(logits.unsqueeze(0), ROOT_DEPTHS)[0]
        if self.params.greedy:
            return greedy_token(logits)
        return sample(target_probs(logits, self.params), self.generator)

    def events(self) -> Iterator[StreamEvent | GenerationResult]:
        start = self._clock()
        target = self.target
        drafter = self.drafter
        # The DART head, which the static path drafts with (another drafter never runs it).
        head = drafter.head if isinstance(drafter, DartDrafter) else None
        prompt_len = len(self.prompt)
        kept = self.prefix_cache
        head_capacity = None if drafter is None else drafter.cache_capacity(self.max_length)
        # The largest tree this generation can verify (root included).
        max_tree = min(self.max_length - prompt_len, self.max_new)
        if drafter is not None and self.tree_budget is not None:
            max_tree = min(max_tree, self.tree_budget + 1)
        capacity = static_capacity(self.max_length, max_tree) if self.static else self.max_length
        begin = kept._start(self.prompt, capacity, head_capacity) if kept else 0
        if begin and self.static and head is not None:
            assert kept is not None
            needed = static_head_capacity(kept.cache.capacity, head.config.draft_length)
            if kept.head_cache.capacity != needed:
                begin = 0  # a head cache of the dynamic path: the static draft cannot use it
        if kept is not None:
            # Until this generation ends the caches change under the recorded tokens: an
            # interrupted generation leaves nothing to reuse.
            kept.tokens = []
        if begin > 0:
            assert kept is not None
            cache = kept.cache
            cache.truncate(begin)
        elif self.static and kept is None:
            cache = lend_cache(target, capacity)
        else:
            cache = target.new_cache(capacity)
        try:
            yield from self._generate(start, cache, drafter, head, head_capacity, begin, max_tree)
        finally:
            if self.static and kept is None:
                return_cache(target, cache)

    def _generate(
        self,
        start: float,
        cache: Any,
        drafter: Drafter | None,
        head: DartHead | None,
        head_capacity: int | None,
        begin: int,
        max_tree: int,
    ) -> Iterator[StreamEvent | GenerationResult]:
        target = self.target
        kept = self.prefix_cache
        prompt_len = len(self.prompt)
        static: StaticVerifier | None = None
        if self.static:
            graphs = self.device.type == "cuda"
            static = verifier_for(
                target,
                cache,
                max_tree,
                graphs=graphs,
                head=head,
                top_k=self.model.draft_top_k,
                head_cache=kept.head_cache if begin > 0 and head is not None else None,
            )
            static.clear_tail()
            if static.head_cache is not None:
                # A conversation's next turn keeps its head positions below ``begin``.
                static.head_cache.truncate(begin)
            # The prompt in fixed-shape chunks (graphs on cuda), not one eager forward; the
            # head reads it in the same programs.
            last, taps = static.prefill(self.prompt[begin:])
        else:
            ids = torch.tensor([self.prompt[begin:]], dtype=torch.long, device=self.device)
            positions = torch.arange(begin, prompt_len, device=self.device).unsqueeze(0)
            logits, taps = target.forward(
                ids, positions, cache, logits_to_keep=1, taps=drafter is not None
            )
            last = logits[0, -1]
        first = self._pick(last)
        t = self._clock()
        step0 = {"prefill": t - start}
        event = self._emit([first], 1, 0, step0, last.unsqueeze(0))
        self._lap(t, "emit", step0)
        for stage, seconds in step0.items():
            self.timings[stage] += seconds
        yield event

        # The static greedy program accepts on the device and returns no logits: log
        # probabilities take the static path's forward (as sampling does).
        static_greedy = static is not None and self.params.greedy and self.logprobs is None
        head_cache = None
        # What the next draft reads: the last forward's taps, the accepted nodes among them
        # and the accepted nodes' tokens.
        pending: tuple[torch.Tensor, list[int], list[int]] | None = None
        if drafter is not None and self.finish is None:
            assert taps is not None
            t = self._clock()
            if static is not None and static.head_cache is not None:
                # The head read the prompt in the prefill's programs: its last position (with
                # the first token) and the first draft remain.
                assert isinstance(drafter, DartDrafter)
                head_cache = static.head_cache
                drafter.rows = static.first_draft(first)
            else:
                if begin > 0:
                    assert kept is not None
                    head_cache = kept.head_cache
                    head_cache.truncate(begin)
                else:
                    head_cache = drafter.new_cache(head_capacity)
                next_ids = torch.tensor(
                    [[*self.prompt[begin + 1 :], first]], dtype=torch.long, device=self.device
                )
                drafter.feed(head_cache, taps, next_ids)
            # The head's pass over the whole prompt is prefill work, not a per-step draft.
            self.timings["prefill"] += self._clock() - t

        while self.finish is None:
            step: dict[str, float] = {}
            greedy_program = static_greedy and not self.early()
            drafted_in_program = greedy_program
            t = self._clock()
            if pending is not None:
                assert drafter is not None and head_cache is not None
                step_taps, nodes, new = pending
                index = torch.tensor(nodes, dtype=torch.long, device=self.device)
                next_ids = torch.tensor([new], dtype=torch.long, device=self.device)
                drafter.feed(head_cache, step_taps.index_select(1, index), next_ids)
                pending = None
                t = self._lap(t, "draft", step)
            cache_len = cache.length
            root = self.generated[-1]
            budget = self.tree_budget_now()
            tree_stage = "prune" if drafter is None else drafter.tree_stage
            if drafter is not None and budget > 0:
                context, path = self.pruner_inputs(budget)
                tree = drafter.tree(context, budget, path)
            else:
                tree = Tree.root_only(root)
            t = self._lap_add(t, tree_stage, step)
            if greedy_program:
                assert static is not None
                # One copy in, one graph (forward, acceptance, compaction), one copy out.
                loaded = static.load(tree)
                t = self._lap(t, "inputs", step)
                out = static.run_greedy(loaded)
                t = self._lap(t, "verify", step)
                outcome = static.accepted(loaded, out, tree)
                acc = outcome.acceptance
                if outcome.rows is not None:
                    # Drafted in the same replay: no draft stage (static: DART's drafter).
                    assert isinstance(drafter, DartDrafter)
                    drafter.rows = outcome.rows
                t = self._lap(t, "accept", step)
            else:
                if static is not None:
                    logits, taps = static.forward(tree)
                    t = self._lap(t, "verify", step)
                else:
                    logits, taps = (
                        verify_tree(target, cache, tree)
                        if drafter is not None
                        else self._ar_forward(cache, root)
                    )
                    forward = target.last_forward_seconds
                    t2 = self._clock()
                    step["inputs"] = t2 - t - forward
                    step["verify"] = forward
                    t = t2
                allowed = self.allowed(logits, tree.depths)
                acc = (
                    accept_greedy(tree, allowed)
                    if self.params.greedy
                    else accept_sampling(tree, allowed, self.params, self.generator)
                )
                t = self._lap(t, "accept", step)
                cache.keep(cache_len, acc.nodes, self.device)
                t = self._lap(t, "compact", step)
                if (
                    static is not None
                    and static.head is not None
                    and isinstance(drafter, DartDrafter)
                    and self.finish is None
                ):
                    # The head's next draft in a program of its own (a graph on cuda).
                    drafter.rows = static.draft(acc)
                    drafted_in_program = True
                    t = self._lap(t, "draft", step)
            new = acc.new_tokens
            rows = None
            if self.logprobs is not None:
                assert not greedy_program
                rows = node_rows(logits, acc)
            event = self._emit(new, len(new), len(tree), step, rows)
            self._lap(t, "emit", step)
            for stage, seconds in step.items():
                self.timings[stage] += seconds
            # (A static step drafted the next rows in its program already.)
            if self.finish is None and drafter is not None and not drafted_in_program:
                assert taps is not None
                pending = (taps, acc.nodes, new)
            yield event

        if kept is not None:
            kept.tokens = (self.prompt + self.generated)[: cache.length]
            kept.cache, kept.head_cache, kept.reused = cache, head_cache, begin
        yield self.result(start)

    def result(self, start: float) -> GenerationResult:
        """The generation's result, ``start`` (on :meth:`_clock`) being when it began."""
        text = self._text()
        return GenerationResult(
            text=text,
            tokens=list(self.generated),
            prompt_tokens=len(self.prompt),
            accept_lengths=list(self.accept_lengths),
            timings=dict(self.timings),
            elapsed=self._clock() - start,
            finish_reason=self.finish or "length",
            mode=self.mode,
            tree_sizes=list(self.tree_sizes),
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )

    def tree_budget_now(self) -> int:
        """Draft nodes this step's tree may have: the room left for new tokens, less the
        bonus token's, capped by the tree budget."""
        room = min(
            self.max_length - len(self.prompt) - len(self.generated),
            self.max_new - len(self.generated),
        )
        budget = room - 1  # leaves room for the bonus token
        if self.tree_budget is not None:
            budget = min(budget, self.tree_budget)
        return budget

    def decode_at_end(self) -> None:
        """Skip the per-step text: nothing reads the events' deltas (a caller that returns
        only the result, whose text is decoded once at the end). A run with stop strings
        keeps decoding each step: they are found in that text."""
        if not self.stops:
            self.detok = None

    def pruner_inputs(self, budget: int) -> tuple[np.ndarray, np.ndarray | None]:
        """The pruner's context (the last tokens) and the prompt-lookup path (if any)."""
        context = np.asarray(
            self.generated[-PRUNER_CONTEXT:]
            if len(self.generated) >= PRUNER_CONTEXT
            else (self.prompt + self.generated)[-PRUNER_CONTEXT:],
            dtype=np.int64,
        )
        path = None
        index = self.lookup_index
        if index is not None:
            assert self.lookup is not None
            index.extend(self.generated[len(index) - len(self.prompt) :])
            path = self.lookup.path(index, budget)
        return context, path

    def _lap(self, since: float, stage: str, step: dict[str, float]) -> float:
        """Book the time from ``since`` to now to ``step[stage]``; returns now (the next
        stage's start)."""
        now = self._clock()
        step[stage] = now - since
        return now

    def _lap_add(self, since: float, stage: str, step: dict[str, float]) -> float:
        """:meth:`_lap`, adding to what ``step[stage]`` already holds."""
        now = self._clock()
        step[stage] = step.get(stage, 0.0) + now - since
        return now

    def _ar_forward(self, cache: Any, token: int) -> tuple[torch.Tensor, None]:
        ids = torch.tensor([[token]], dtype=torch.long, device=self.device)
        positions = torch.tensor([[cache.length]], dtype=torch.long, device=self.device)
        logits, _ = self.target.forward(ids, positions, cache, logits_to_keep=1, taps=False)
        return logits[0], None

    def _emit(
        self,
        new: list[int],
        accept_length: int,
        tree_size: int,
        step: dict[str, float],
        logits: torch.Tensor | None = None,
    ) -> StreamEvent:
        """Append a step's tokens, apply the length / EOS / stop limits, make the text delta;
        ``logits``: the target's rows that produced ``new`` (one each), needed when log
        probabilities are reported."""
        self.accept_lengths.append(accept_length)
        self.tree_sizes.append(tree_size)
        before = len(self.generated)
        limit = min(self.max_new, self.max_length - len(self.prompt))
        new = new[: limit - before]
        hit = next((i for i, tok in enumerate(new) if tok in self.eos), None)
        if hit is not None:
            new = new[: hit + 1]
            self.finish = "eos"
        elif before + len(new) >= limit:
            self.finish = "length"
        self.generated.extend(new)
        if self.logprobs is not None:
            assert logits is not None, "log probabilities need the logits of the new tokens"
            assert self.logprobs_top is not None
            self.logprobs.extend(token_logprobs(logits, new, self.logprobs_top))
        delta = ""
        if self.detok is not None:
            text = self.detok.update(self.generated)
            if self.stops:
                # Only the new text (and the longest stop's reach back into the old) can
                # hold a stop string that was not there before.
                scan = max(0, self.stop_scanned - max(map(len, self.stops)) + 1)
                self.stop_scanned = len(text)
                found = any(text.find(s, scan) >= 0 for s in self.stops)
                # The incremental text is the final decoding for every tokenizer we know of;
                # the last step re-checks the full decoding all the same.
                if found or self.finish is not None:
                    cut = self._stop_cut(before if found else 0)
                    if cut is not None:
                        self.generated = self.generated[:cut]
                        if self.logprobs is not None:
                            del self.logprobs[cut:]
                        self.finish = "stop"
            text = _hold_back(text, self.stops) if self.finish is None else self._text()
            # A decoding that rewrote already-streamed text (rare byte merges) is not re-sent.
            if text.startswith(self.emitted_text):
                delta = text[len(self.emitted_text) :]
                self.emitted_text = text
        return StreamEvent(
            text=delta,
            tokens=self.generated[before:],
            accept_length=accept_length,
            tree_size=tree_size,
            timings=step,
            logprobs=None if self.logprobs is None else self.logprobs[before:],
        )

    def _stop_cut(self, before: int) -> int | None:
        """Smallest token count (> before) whose decoding contains a stop string, if any."""
        tok = self.model.tokenizer
        full = tok.decode(self.generated, skip_special_tokens=True)
        if not any(s in full for s in self.stops):
            return None
        for n in range(max(1, before), len(self.generated) + 1):
            text = tok.decode(self.generated[:n], skip_special_tokens=True)
            if any(s in text for s in self.stops):
                return n
        return len(self.generated)

    def _text(self) -> str:
        """The full decoding of the output, cut before the first stop string (cached)."""
        tok = self.model.tokenizer
        if tok is None:
            return ""
        if self.final_text is not None and self.final_text[0] == len(self.generated):
            return self.final_text[1]
        text = tok.decode(self.generated, skip_special_tokens=True)
        if self.stops:
            cuts = [text.find(s) for s in self.stops if s in text]
            if cuts:
                text = text[: min(cuts)]
        self.final_text = (len(self.generated), text)
        return text


def node_rows(logits: torch.Tensor, acc: Acceptance) -> torch.Tensor:
    """The rows of a verified tree's ``logits`` that produced an acceptance's new tokens:
    the accepted nodes', root first (the bonus token's is the last)."""
    index = torch.tensor(acc.nodes, dtype=torch.long, device=logits.device)
    return logits.index_select(0, index)


class IncrementalText:
    """The decoding of a growing token list, a few tokens at a time.

    ``update(tokens)`` decodes only the tokens added since the last complete character, with
    the previous batch of tokens as left context (tokenizers that strip a leading space or
    join words with spaces then decode the seam as in the full text), and appends the
    difference; text ending in an incomplete character waits for the next tokens. A step
    thus costs two decodes of a few tokens instead of one of the whole output.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.text = ""
        self._context = 0  # first token of the decode window
        self._read = 0  # tokens whose text is in self.text

    def update(self, tokens: Sequence[int]) -> str:
        if len(tokens) <= self._read:
            return self.text
        decode = self.tokenizer.decode
        seen = decode(tokens[self._context : self._read], skip_special_tokens=True)
        window = decode(tokens[self._context :], skip_special_tokens=True)
        if window.endswith("\ufffd"):
            return self.text  # an incomplete character: wait for its remaining bytes
        if window.startswith(seen):
            self.text += window[len(seen) :]
        else:  # the new tokens rewrote the context's text: start over from the full decode
            self.text = decode(tokens, skip_special_tokens=True)
        if window != seen:
            self._context = self._read
        # else: the new tokens decode to nothing (special tokens only): the window keeps its
        # text as left context, else the next seam would be decoded after no text at all
        # (a leading space stripped, words not joined).
        self._read = len(tokens)
        return self.text


def _hold_back(text: str, stops: list[str]) -> str:
    """Withhold a trailing partial character and any suffix that may begin a stop string."""
    text = text.rstrip("\ufffd")
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                text = text[:-n]
                break
    return text
