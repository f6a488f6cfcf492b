"""``DartModel``: a target model, its DART head and the n-gram pruner, loaded together, and
its one generation entry point, :meth:`DartModel.generate` (``dart_generate`` and
``ar_generate`` are thin wrappers kept for existing callers)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dart_client.decoding.batch import BatchGenerator, generate_batch
from dart_client.decoding.config import (
    GenerationConfig,
    config_from,
    parse_tree_budget,
    resolve_tree_budget,
)
from dart_client.decoding.eagle3 import Eagle3Drafter, Eagle3TreeConfig
from dart_client.decoding.lookup import PromptLookupConfig, parse_prompt_lookup
from dart_client.decoding.loop import (
    DartDrafter,
    Drafter,
    GenerationResult,
    GenerationStream,
    PrefixCache,
    generate,
)
from dart_client.decoding.prune import PrunerTreeBuilder, TreeBuilder, pruner_max_nodes
from dart_client.errors import (
    DartError,
    EmptyPromptError,
    IncompatibleNGramError,
    InvalidArgumentError,
    InvalidTypeError,
)
from dart_client.loading import (
    check_ngram_open,
    gguf_unpacked,
    is_eagle3_spec,
    load_drafter,
    load_eagle3_head,
    load_head,
    load_ngram,
    load_pruner,
    load_target,
    note,
    torch_dtype,
)
from dart_client.models.eagle3 import Eagle3Head
from dart_client.models.head import DartHead
from dart_client.models.target import TargetModel
from dart_client.templates import TEMPLATE_REGISTRY, ChatTemplate

__all__ = [
    "DartModel",
    "GenerationConfig",
    "ar_generate",
    "build_model",
    "dart_generate",
    "gguf_unpacked",
    "load_ngram",
]

DEFAULT_DRAFT_TOP_K = 25

#: ``prompt_lookup``'s default: on for the pruner's trees, off for a custom tree builder.
DEFAULT_LOOKUP: Any = "default"


class DartModel:
    """Target + DART head + tree builder (the Rust pruner over an n-gram model).

    Build it with :meth:`from_pretrained` (paths or hub ids) or directly from loaded parts:
    ``DartModel(target_model, head, tokenizer=tok, ngram=NGram.open(...))``. ``head`` and
    the n-gram may be omitted for an autoregressive-only model (``ar_generate``).
    ``eagle3`` (an :class:`~dart_client.models.eagle3.Eagle3Head`) drafts with EAGLE-3's
    dynamic tree (``eagle3_tree``) instead of a DART head and pruner.
    ``tree_budget`` is the default node budget of :meth:`generate` (an int, or ``"auto"``:
    measured on this machine by :meth:`tune`, whose result lands in ``tree_tuning``).
    ``prompt_lookup`` merges a prompt-lookup proposal into every draft tree
    (:mod:`dart_client.decoding.lookup`): a ``PromptLookupConfig``, a path length (``0`` or
    ``None``: off, the paper's trees). By default it is on when the trees come from the
    pruner and off otherwise (a custom ``tree_builder`` then receives no ``lookup_path``).

    The n-gram must come from the target's tokenizer: its tokenizer fingerprint (when it
    records one) must equal the tokenizer's, and its vocabulary must fit the target's, else
    :class:`~dart_client.errors.IncompatibleNGramError`. ``check_tokenizer=False`` skips the
    check (experts: e.g. a tokenizer whose vocabulary was renamed but not renumbered).
    """

    def __init__(
        self,
        target: TargetModel | nn.Module,
        head: DartHead | None = None,
        *,
        tokenizer: Any = None,
        ngram: Any = None,
        pruner: Any = None,
        pruner_config: Any = None,
        tree_builder: TreeBuilder | None = None,
        template: str | ChatTemplate | None = None,
        tree_budget: int | str | None = None,
        prompt_lookup: int | PromptLookupConfig | None = DEFAULT_LOOKUP,
        check_tokenizer: bool = True,
        eagle3: Eagle3Head | None = None,
        eagle3_tree: Eagle3TreeConfig | None = None,
    ) -> None:
        self.tree_budget = parse_tree_budget(tree_budget)
        self.tree_tuning: Any = None
        #: ``tree_budget="auto"`` of fused batches, by batch size (:meth:`tune`).
        self.batch_tree_tunings: dict[int, Any] = {}
        if not isinstance(target, TargetModel):
            target = TargetModel(target, tokenizer)
        elif tokenizer is not None and target.tokenizer is None:
            target.tokenizer = tokenizer
            target.eos_token_ids = target._eos_ids()
        self.target = target
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.head = head
        if head is not None and eagle3 is not None:
            raise InvalidArgumentError("give a DART head or an EAGLE-3 head, not both")
        self.eagle3 = eagle3
        self.eagle3_tree = eagle3_tree or Eagle3TreeConfig()
        #: ``tree_budget="auto"`` with an EAGLE-3 head: the measured trees (:meth:`tune`).
        self.eagle3_tuning: Any = None
        for drafting in (head, eagle3):
            if drafting is not None:
                drafting.check_compatible(target.config)
                drafting.to(device=target.device, dtype=_float_dtype(target))
                drafting.eval()
                drafting.bind_embedding(target.embedding())
        if pruner is None and ngram is not None:
            from dart_client.ngram.pruner import Pruner, PrunerConfig

            pruner = Pruner(ngram, pruner_config if pruner_config is not None else PrunerConfig())
        self.ngram = ngram
        self.pruner = pruner
        if check_tokenizer:
            check_ngram_compatible(
                ngram if ngram is not None else getattr(pruner, "ngram", None),
                self.tokenizer,
                target.vocab_size,
            )
        pruner_trees = tree_builder is None and pruner is not None
        if pruner_trees:
            tree_builder = PrunerTreeBuilder(pruner)
        self.tree_builder = tree_builder
        if prompt_lookup is DEFAULT_LOOKUP:
            prompt_lookup = PromptLookupConfig() if pruner_trees else None
        self.prompt_lookup: PromptLookupConfig | None = parse_prompt_lookup(prompt_lookup)
        config = getattr(pruner, "config", None)
        self.draft_top_k = int(getattr(config, "top_k", DEFAULT_DRAFT_TOP_K))
        if isinstance(template, str):
            template = TEMPLATE_REGISTRY[template]
        if template is None and getattr(self.tokenizer, "chat_template", None):
            template = TEMPLATE_REGISTRY.from_tokenizer(self.tokenizer)
        self.template: ChatTemplate | None = template

    def new_drafter(self) -> Drafter | None:
        """What drafts one generation's trees: EAGLE-3's drafter when this model has an
        EAGLE-3 head, else DART's head + pruner (None with neither)."""
        if self.eagle3 is not None:
            return Eagle3Drafter(self.eagle3, self.eagle3_tree)
        if self.head is None or self.tree_builder is None:
            return None
        return DartDrafter(self.head, self.tree_builder, self.draft_top_k)

    # -- loading --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        base_model_name_or_path: str | Path | None,
        dart_model_name_or_path: str | Path | None,
        ngram_model_name_or_path: str | Path | None = None,
        *,
        ngram_server: str | None = None,
        is_small_ngram: bool = False,
        ngram_open: Mapping[str, bool] | None = None,
        torch_dtype: torch.dtype | str | None = None,
        device_map: Any = None,
        pruner_config: Any = None,
        template: str | ChatTemplate | None = None,
        double_final_norm: bool | None = None,
        tree_budget: int | str | None = None,
        cpu_kernels: bool = True,
        prompt_lookup: int | PromptLookupConfig | None = DEFAULT_LOOKUP,
        check_tokenizer: bool = True,
        **hf_kwargs: Any,
    ) -> DartModel:
        """Load the target (local path, hub id or a ``.gguf`` file), the head and the n-gram.

        The n-gram is a ``.ngram`` file, a directory holding ``full``/``small`` models
        (``is_small_ngram`` picks), a reference ``.trie`` (converted once and cached), or is
        served by the n-gram daemon at ``ngram_server`` (``host:port``). ``ngram_open``: how a
        local n-gram is opened (``NGram.open``'s options, e.g. ``{"checksums": False,
        "prefetch": True}`` for a model of many GB). ``tree_budget="auto"``
        tunes the budget now, at load time (a few seconds: see
        :mod:`dart_client.decoding.autotune`).
        ``cpu_kernels``: on the CPU, run the target on the decoding kernels of
        :class:`~dart_client.models.target.TargetModel` (packed weights, small-query attention).
        ``prompt_lookup``: see the class docstring.
        """
        check_ngram_open(ngram_open, daemon=ngram_server)  # before the (slow) target load
        model, tokenizer = load_target(
            base_model_name_or_path, dtype=torch_dtype, device_map=device_map, **hf_kwargs
        )
        # A DART head, or an EAGLE-3 draft model (its weights say which).
        drafter = load_drafter(
            dart_model_name_or_path,
            model.config,
            embedded_target=base_model_name_or_path is None,
            double_final_norm=double_final_norm,
        )
        eagle3 = drafter if isinstance(drafter, Eagle3Head) else None
        head = None if eagle3 is not None else drafter
        pruner = None
        ngram = None
        if ngram_server is not None:
            pruner = load_pruner(ngram_server, pruner_config)
        elif ngram_model_name_or_path is not None:
            ngram = load_ngram(
                ngram_model_name_or_path, is_small=is_small_ngram, open_options=ngram_open
            )
        dart = cls(
            TargetModel(model, tokenizer, cpu_kernels=cpu_kernels),
            head,
            tokenizer=tokenizer,
            ngram=ngram,
            pruner=pruner,
            pruner_config=pruner_config,
            template=template,
            tree_budget=tree_budget,
            prompt_lookup=prompt_lookup,
            check_tokenizer=check_tokenizer,
            eagle3=eagle3,
        )
        if dart.tree_budget == "auto" and dart.new_drafter() is not None:
            dart.tune()
        return dart

    # -- inputs -------------------------------------------------------------------------------

    def encode_input(
        self,
        prompt: str | None = None,
        messages: Sequence[dict[str, str]] | None = None,
        input_ids: Any = None,
    ) -> list[int]:
        """Token ids of exactly one of a text prompt, chat messages, or ids."""
        given = [
            name
            for name, v in (("prompt", prompt), ("messages", messages), ("input_ids", input_ids))
            if v is not None
        ]
        if len(given) != 1:
            raise InvalidArgumentError(
                f"give exactly one of prompt, messages or input_ids (got {given or 'none'})"
            )
        if input_ids is not None:
            return _as_ids(input_ids, self.target.vocab_size)
        if self.tokenizer is None:
            raise InvalidArgumentError("text input needs a tokenizer; pass input_ids instead")
        if messages is not None:
            if self.template is None:
                raise InvalidArgumentError(
                    "the tokenizer has no chat template: pass template=... to DartModel"
                )
            prompt = self.template.format(messages=messages, add_generation_prompt=True)
        if not isinstance(prompt, str):
            raise InvalidTypeError(f"prompt must be a str, got {type(prompt).__name__}")
        if not prompt:
            raise EmptyPromptError("the prompt is an empty string")
        bos = getattr(self.tokenizer, "bos_token", None)
        # A formatted chat prompt already carries its special tokens: never add a second BOS.
        add_special = not (messages is not None or (bos and prompt.startswith(bos)))
        return list(self.tokenizer(prompt, add_special_tokens=add_special)["input_ids"])

    # -- generation -----------------------------------------------------------------------------

    def tune(self, batch: int = 1, **kwargs: Any) -> int:
        """The node budget measured fastest on this machine (:mod:`dart_client.decoding.autotune`),
        tuned once; the result stays in ``tree_tuning`` (``batch_tree_tunings[batch]`` for
        the per-row budget of ``batch`` sequences decoded together). ``tree_budget="auto"``
        resolves here. With an EAGLE-3 head it tunes EAGLE-3's tree instead (top-k, depth and
        size: :func:`~dart_client.decoding.autotune.tune_eagle3_tree`), which then becomes
        ``eagle3_tree``; the result stays in ``eagle3_tuning``."""
        from dart_client.decoding.autotune import auto_budget, tune_eagle3_tree

        if self.eagle3 is not None:
            if batch > 1:
                raise InvalidArgumentError("batched generation drafts with a DART head only")
            if self.eagle3_tuning is None:
                self.eagle3_tuning = tune_eagle3_tree(self, **kwargs)
                self.eagle3_tree = self.eagle3_tuning.best_config()
            return self.eagle3_tree.budget
        return auto_budget(self, batch=batch, **kwargs)

    def resolved_tree_budget(self, call: int | str | None = None, batch: int = 1) -> int | None:
        """The node budget a call with ``tree_budget=call`` uses: the call's, else the
        model's, else the pruner configuration's ``max_nodes`` (``"auto"``: :meth:`tune`,
        for ``batch`` sequences decoded together)."""
        if self._auto_budget(call):
            return self.tune(batch=batch)
        return resolve_tree_budget(
            parse_tree_budget(call), self.tree_budget, pruner_max_nodes(self.pruner)
        )

    def _auto_budget(self, call: int | str | None) -> bool:
        """Whether a call with ``tree_budget=call`` takes the tuned budget."""
        call = parse_tree_budget(call)
        return call == "auto" or (call is None and self.tree_budget == "auto")

    def generate(
        self,
        prompt: str | Sequence[int] | Any = None,
        config: GenerationConfig | Mapping[str, Any] | None = None,
        *,
        messages: Sequence[dict[str, str]] | None = None,
        input_ids: Any = None,
        stream: bool = False,
        mode: str = "dart",
        prefix_cache: PrefixCache | None = None,
        stream_text: bool = True,
        **overrides: Any,
    ) -> GenerationResult | GenerationStream:
        """Generate from a text ``prompt`` (token ids work too), chat ``messages`` or
        ``input_ids`` with ``config`` (default :class:`GenerationConfig`), any field of which
        ``overrides`` replace (``max_new_tokens=64``). ``mode="ar"`` runs the autoregressive
        baseline on the same path. ``stream=True`` returns a :class:`GenerationStream`.
        ``prefix_cache`` (a :class:`~dart_client.decoding.loop.PrefixCache`, one per
        conversation) reuses the caches of the previous turn: only new tokens are prefilled.
        ``stream_text=False``: a stream's events carry no text (the result's is decoded once
        at the end), for a caller that reads only their tokens and statistics."""
        if isinstance(prompt, (list, tuple, np.ndarray, torch.Tensor)):
            if input_ids is not None:
                raise InvalidArgumentError("give the ids as prompt or as input_ids, not both")
            prompt, input_ids = None, prompt
        config = self._resolved(config_from(config, overrides), mode)
        return generate(
            self,
            config,
            mode=mode,
            prompt=prompt,
            messages=messages,
            input_ids=input_ids,
            stream=stream,
            prefix_cache=prefix_cache,
            stream_text=stream_text,
        )

    def generate_batch(
        self,
        prompts: Sequence[Any],
        config: GenerationConfig | Mapping[str, Any] | None = None,
        *,
        mode: str = "dart",
        max_batch: int | None = None,
        admit_together: bool | str = "auto",
        **overrides: Any,
    ) -> list[GenerationResult]:
        """Generate for every prompt (text or token ids) at once, fused: per step one head
        forward, one pruner call and one target forward for the whole batch
        (:mod:`dart_client.decoding.batch`). Each result equals what :meth:`generate` gives
        that prompt alone (greedy: the same tokens; sampling: the same distribution). At
        most ``max_batch`` (default: all) run at once, the others joining as rows free up.
        ``tree_budget="auto"`` is tuned for that many rows, and as rows finish the rest take
        the budget of the smallest tuned batch size that holds them (a lone sequence's once
        :meth:`tune` has measured it). ``admit_together``: prefill the prompts that join at
        one step in one forward (``"auto"``: on cuda). For requests that come and go, use
        :meth:`batch_generator`."""
        rows = len(prompts) if max_batch is None else min(max_batch, len(prompts))
        config = self._resolved(config_from(config, overrides), mode, max(1, rows))
        return generate_batch(
            self, prompts, config, mode=mode, max_batch=max_batch, admit_together=admit_together
        )

    def batch_generator(
        self,
        *,
        mode: str = "dart",
        max_batch: int = 8,
        max_length: int = 2048,
        static: bool | str = "auto",
        admit_together: bool | str = "auto",
    ) -> BatchGenerator:
        """A :class:`~dart_client.decoding.batch.BatchGenerator` (continuous batching) over
        this model; configs given to its ``add`` take :meth:`resolve_config` first (with
        ``batch=max_batch``), or keep ``tree_budget="auto"`` to have each step's trees sized
        for the rows live then (from the tunings held: :meth:`tune` for 1, 2, 4, ...
        ``max_batch`` rows first). ``static``: the static path (``"auto"``: on one cuda
        device); ``admit_together``: prefill the requests joining at one step in one forward
        (``"auto"``: on cuda)."""
        return BatchGenerator(
            self,
            mode=mode,
            max_batch=max_batch,
            max_length=max_length,
            static=static,
            admit_together=admit_together,
        )

    def resolve_config(
        self, config: GenerationConfig, mode: str = "dart", batch: int = 1
    ) -> GenerationConfig:
        """``config`` with its tree budget resolved for ``mode`` (as :meth:`generate` does;
        ``"auto"`` tuned for ``batch`` sequences decoded together). For a batch (``batch`` >
        1) an ``auto`` DART budget stays ``"auto"`` once tuned: the batch sizes each step's
        trees for the rows live then."""
        return self._resolved(config, mode, batch)

    def _resolved(self, config: GenerationConfig, mode: str, batch: int = 1) -> GenerationConfig:
        if mode == "dart" and self.eagle3 is not None:
            budget = parse_tree_budget(config.tree_budget)
            budget = self.tree_budget if budget is None else budget
            if budget == "auto":
                budget = self.tune(batch=batch)
            return config.replace(tree_budget=self.eagle3_tree.budget if budget is None else budget)
        if mode == "dart" and self.head is not None and self.tree_builder is not None:
            budget = self.resolved_tree_budget(config.tree_budget, batch)
            if batch > 1 and self._auto_budget(config.tree_budget):
                return config.replace(tree_budget="auto")  # tuned above; sized per step
            return config.replace(tree_budget=budget)
        return config.replace(tree_budget=None)  # no tree: nothing to resolve

    def ar_generate(self, *args: Any, **kwargs: Any) -> GenerationResult | GenerationStream:
        """``generate(..., mode="ar")``: plain autoregressive decoding."""
        return self.generate(*args, mode="ar", **kwargs)


def dart_generate(
    model: DartModel,
    prompt: str | None = None,
    *,
    config: GenerationConfig | Mapping[str, Any] | None = None,
    stream: bool = False,
    **kwargs: Any,
) -> GenerationResult | GenerationStream:
    """``model.generate(prompt, config, **kwargs)``: speculative generation. Kept for existing
    callers; old keyword names (``max_new_token_num``) work with a deprecation warning."""
    if model.new_drafter() is None:
        raise InvalidArgumentError(
            "this DartModel has no draft head / n-gram pruner: use ar_generate, or load one"
        )
    return model.generate(prompt, config, stream=stream, **kwargs)


def ar_generate(
    model: DartModel,
    prompt: str | None = None,
    *,
    config: GenerationConfig | Mapping[str, Any] | None = None,
    stream: bool = False,
    **kwargs: Any,
) -> GenerationResult | GenerationStream:
    """``model.generate(prompt, config, mode="ar", **kwargs)``: autoregressive decoding on the
    same target path (``tree_budget`` is ignored)."""
    return model.generate(prompt, config, stream=stream, mode="ar", **kwargs)


def build_model(
    base: str | None,
    head: str | None,
    ngram: str | None,
    *,
    dtype: str = "bf16",
    device: str = "cpu",
    template: str = "auto",
    small_ngram: bool = False,
    ngram_server: str | None = None,
    ngram_open: Mapping[str, bool] | None = None,
    ar: bool = False,
    cpu_kernels: bool = True,
    prompt_lookup: int = 8,
    tree_budget: int | str | None = None,
    tune_batch: int = 1,
    tune_prompts: Sequence[str] | None = None,
    notes: list[str] | None = None,
) -> DartModel:
    """The DartModel that command-line options describe (the CLIs, bench and UI load through
    here): a target (None = the embedded SmolLM2), a head (directory, ``"random"`` or
    ``"auto"``) and an n-gram (a path, ``"embedded"``, or a daemon address in
    ``ngram_server``; ``ngram_open``: ``NGram.open``'s options for a local one);
    ``prompt_lookup``: the longest prompt-lookup path merged into each tree (0 = off);
    ``template``: ``auto`` (the tokenizer's), ``none`` or a registry name. ``ar`` loads the
    target only. ``tree_budget="auto"`` tunes now (cached on disk): for one sequence and,
    with ``tune_batch`` > 1, per row of up to that many decoded together (a server's batch:
    :func:`~dart_client.decoding.autotune.tuned_batch_sizes`), on ``tune_prompts`` when
    given. Notes on what was chosen go to ``notes`` (else stderr)."""
    from dart_client.devices import check_device

    if device != "auto":  # device_map="auto" lets accelerate place the layers
        check_device(device)
    if template not in ("auto", "none"):
        TEMPLATE_REGISTRY[template]  # an unknown name fails before the load
    check_ngram_open(ngram_open, daemon=ngram_server)
    eagle3 = not ar and is_eagle3_spec(head)
    if not ar:
        if head is None:
            raise DartError("pass --head DIR (or --head random for an untrained head), or use --ar")
        if eagle3 and tune_batch > 1:
            raise DartError(
                f"{head} is an EAGLE-3 head: batched decoding drafts with a DART head, so an "
                "EAGLE-3 head decodes one request at a time (--max-batch 1)"
            )
        if not eagle3 and not ngram and not ngram_server:
            raise DartError("pass --ngram PATH (or --ngram embedded), --ngram-server, or use --ar")
    target, tokenizer = load_target(
        base,
        dtype=torch_dtype(dtype),
        device_map=None if device == "cpu" else device,
    )
    target_model = TargetModel(target, tokenizer, cpu_kernels=cpu_kernels)
    chosen: str | ChatTemplate | None = None
    if template == "auto":
        chosen = None
    elif template != "none":
        chosen = TEMPLATE_REGISTRY[template]
    if ar or eagle3:
        model = DartModel(
            target_model,
            tokenizer=tokenizer,
            template=chosen,
            eagle3=load_eagle3_head(head, target_model.config, notes=notes) if eagle3 else None,
            tree_budget=tree_budget if eagle3 else None,
        )
        if template == "none":
            model.template = None
        if eagle3:
            if ngram or ngram_server:
                note(notes, "n-gram: not used (an EAGLE-3 head grows its tree alone)")
            if parse_tree_budget(tree_budget) == "auto":
                model.tune()
                t = model.eagle3_tree
                note(
                    notes,
                    f"EAGLE-3 tree tuned on this machine: top-k {t.top_k}, depth {t.depth}, "
                    f"{t.total_tokens} tokens (--tree-budget N skips the tuning)",
                )
        return model
    pruner = None
    ngram_model = None
    if ngram_server:
        pruner = load_pruner(ngram_server, None)
    else:
        assert ngram is not None
        ngram_model = load_ngram(ngram, is_small=small_ngram, open_options=ngram_open)
    model = DartModel(
        target_model,
        load_head(head, target_model.config, embedded_target=base is None, notes=notes),
        tokenizer=tokenizer,
        ngram=ngram_model,
        pruner=pruner,
        template=chosen,
        prompt_lookup=prompt_lookup,
        tree_budget=tree_budget,
    )
    if template == "none":
        model.template = None
    if parse_tree_budget(tree_budget) == "auto" and model.tree_builder is not None:
        from dart_client.decoding.autotune import tune_cached, tuned_batch_sizes

        key = {
            "target": _identity(base),
            "head": _identity(head, embedded=base is None),
            "ngram": ngram_server if ngram_server else _identity(ngram),
            "small_ngram": small_ngram,
            "device": str(target_model.device),
            "dtype": str(target_model.dtype),
            "cpu_kernels": cpu_kernels,
            "prompt_lookup": prompt_lookup,
        }
        for batch in tuned_batch_sizes(tune_batch):
            note(notes, tune_cached(model, key, batch=batch, prompts=tune_prompts))
    return model


def _identity(spec: str | None, *, embedded: bool = False) -> str:
    """What names a loaded part in the tuning cache's key: a local file or directory with its
    size and modification time (a rebuilt one is a new part), else the name as given."""
    if spec is None:
        from dart_client.embedded import smollm2_gguf

        return _identity(str(smollm2_gguf()))
    if spec == "auto" and embedded:
        from dart_client.embedded import SHIPPED_HEAD_DIR

        spec = str(SHIPPED_HEAD_DIR / "model.safetensors")
    if spec == "embedded":
        from dart_client.ngram.embedded import ensure_ngram

        spec = str(ensure_ngram().path)
    path = Path(spec).expanduser()
    if not path.exists():
        return spec
    files = sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]
    stamps = ",".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    return f"{path.resolve()}[{stamps}]"


def check_ngram_compatible(ngram: Any, tokenizer: Any, target_vocab: int) -> None:
    """Raises :class:`IncompatibleNGramError` when ``ngram`` was built for another tokenizer
    (fingerprints differ) or its vocabulary does not fit the target's. An n-gram that records
    no tokenizer (built from token ids) is checked by its vocabulary size only."""
    if ngram is None:
        return
    vocab = getattr(ngram, "vocab_size", None)
    where = getattr(ngram, "path", None) or getattr(ngram, "url", None) or "the n-gram model"
    if vocab is not None and int(vocab) > target_vocab:
        raise IncompatibleNGramError(
            f"{where} has a vocabulary of {vocab} tokens, more than the target's {target_vocab}: "
            "it was built for another tokenizer (pass check_tokenizer=False to override)"
        )
    recorded = str(getattr(ngram, "fingerprint", "") or "")
    if tokenizer is None or not recorded or set(recorded) <= {"0"}:
        return
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return
    from dart_client.ngram.build import hf_tokenizer_fingerprint

    actual = hf_tokenizer_fingerprint(tokenizer)
    if actual != recorded:
        raise IncompatibleNGramError(
            f"{where} was built with tokenizer {recorded[:16]}..., but the target's tokenizer "
            f"is {actual[:16]}...: its probabilities would be noise for this model (rebuild it "
            "with this tokenizer, or pass check_tokenizer=False to override)"
        )


def _float_dtype(target: TargetModel) -> torch.dtype:
    dtype = target.dtype
    return dtype if dtype.is_floating_point else torch.float32


def _as_ids(input_ids: Any, vocab_size: int) -> list[int]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise InvalidTypeError(f"input_ids must hold integers, got {input_ids.dtype}")
        if input_ids.dim() == 2 and input_ids.shape[0] == 1:
            input_ids = input_ids[0]
        if input_ids.dim() != 1:
            raise InvalidArgumentError(
                f"input_ids must be 1-D or (1, n) (batch size 1), got shape "
                f"{tuple(input_ids.shape)}"
            )
        ids = [int(x) for x in input_ids.tolist()]
    elif isinstance(input_ids, np.ndarray):
        if input_ids.dtype.kind not in "iu":
            raise InvalidTypeError(f"input_ids must hold integers, got {input_ids.dtype}")
        return _as_ids(torch.from_numpy(input_ids.astype(np.int64)), vocab_size)
    elif isinstance(input_ids, (list, tuple)):
        if any(isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in input_ids):
            raise InvalidTypeError("input_ids must be a list of ints")
        ids = [int(x) for x in input_ids]
    else:
        raise InvalidTypeError(
            f"input_ids must be a list of ints, a numpy array or a tensor, got "
            f"{type(input_ids).__name__}"
        )
    bad = [x for x in ids if not 0 <= x < vocab_size]
    if bad:
        raise InvalidArgumentError(
            f"input_ids contain {bad[:5]}, outside the target vocabulary [0, {vocab_size})"
        )
    return ids
