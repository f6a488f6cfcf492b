"""``DartModel``: a target model, its DART head and the n-gram pruner, loaded together."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from dart_client.errors import (
    EmptyPromptError,
    InvalidArgumentError,
    InvalidTypeError,
    MissingResourceError,
)
from dart_client.decoding.loop import (
    GenerationResult,
    GenerationStream,
    PrunerTreeBuilder,
    TreeBuilder,
    ar_generate,
    dart_generate,
)
from dart_client.decoding.lookup import PromptLookupConfig, parse_prompt_lookup
from dart_client.models.head import DartHead
from dart_client.models.target import TargetModel
from dart_client.templates import TEMPLATE_REGISTRY, ChatTemplate

DEFAULT_DRAFT_TOP_K = 25

#: ``prompt_lookup``'s default: on for the pruner's trees, off for a custom tree builder.
DEFAULT_LOOKUP: Any = "default"


def gguf_unpacked() -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load a GGUF file's weights unpacked into
    the requested dtype. transformers' GGUF loader unpacks them anyway; saying so spares users
    its warning that the weights "stay quantized", which it prints although they do not."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers before GgufConfig: always unpacks, says nothing
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


class DartModel:
    """Target + DART head + tree builder (the Rust pruner over an n-gram model).

    Build it with :meth:`from_pretrained` (paths or hub ids) or directly from loaded parts:
    ``DartModel(target_model, head, tokenizer=tok, ngram=NGram.open(...))``. ``head`` and
    the n-gram may be omitted for an autoregressive-only model (``ar_generate``).
    ``tree_budget`` is the default node budget of ``dart_generate`` (an int, or ``"auto"``:
    measured on this machine by :mod:`dart_client.decoding.autotune`, whose result lands in
    ``tree_tuning``). ``prompt_lookup`` merges a prompt-lookup proposal into every draft tree
    (:mod:`dart_client.decoding.lookup`): a :class:`~dart_client.decoding.lookup.PromptLookupConfig`, a path
    length (``0`` or ``None``: off, the paper's trees). By default it is on when the trees
    come from the pruner and off otherwise (a custom ``tree_builder`` then receives no
    ``lookup_path``).
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
    ) -> None:
        if tree_budget not in (None, "auto") and (
            isinstance(tree_budget, bool) or not isinstance(tree_budget, int) or tree_budget < 0
        ):
            raise InvalidArgumentError(
                f"tree_budget must be an int >= 0, 'auto' or None, got {tree_budget!r}"
            )
        self.tree_budget = tree_budget
        self.tree_tuning: Any = None
        if not isinstance(target, TargetModel):
            target = TargetModel(target, tokenizer)
        elif tokenizer is not None and target.tokenizer is None:
            target.tokenizer = tokenizer
            target.eos_token_ids = target._eos_ids()
        self.target = target
        self.tokenizer = tokenizer if tokenizer is not None else target.tokenizer
        self.head = head
        if head is not None:
            head.check_compatible(target.config)
            head.to(device=target.device, dtype=_float_dtype(target))
            head.eval()
            head.bind_embedding(target.embedding())
        if pruner is None and ngram is not None:
            from dart_client.ngram.pruner import Pruner, PrunerConfig

            pruner = Pruner(ngram, pruner_config if pruner_config is not None else PrunerConfig())
        self.ngram = ngram
        self.pruner = pruner
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

    # -- loading --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        base_model_name_or_path: str | Path,
        dart_model_name_or_path: str | Path | None,
        ngram_model_name_or_path: str | Path | None = None,
        *,
        ngram_server: str | None = None,
        is_small_ngram: bool = False,
        torch_dtype: torch.dtype | str | None = None,
        device_map: Any = None,
        pruner_config: Any = None,
        template: str | ChatTemplate | None = None,
        double_final_norm: bool | None = None,
        tree_budget: int | str | None = None,
        cpu_kernels: bool = True,
        prompt_lookup: int | PromptLookupConfig | None = DEFAULT_LOOKUP,
        **hf_kwargs: Any,
    ) -> DartModel:
        """Load the target (local path, hub id or a ``.gguf`` file), the head and the n-gram.

        The n-gram is a ``.ngram`` file, a directory holding ``full``/``small`` models
        (``is_small_ngram`` picks), a reference ``.trie`` (converted once and cached), or is
        served by the n-gram daemon at ``ngram_server`` (``host:port``). ``tree_budget="auto"``
        tunes the budget now, at load time (a few seconds: see :mod:`dart_client.decoding.autotune`).
        ``cpu_kernels``: on the CPU, run the target on the decoding kernels of
        :class:`~dart_client.models.target.TargetModel` (packed weights, small-query attention).
        ``prompt_lookup``: see the class docstring.
        """
        from transformers import AutoModelForCausalLM, AutoTokenizer

        base = Path(base_model_name_or_path)
        load_kwargs = dict(hf_kwargs)
        if torch_dtype is not None:
            load_kwargs["dtype"] = torch_dtype
        if device_map is not None:
            load_kwargs["device_map"] = device_map
        if base.suffix == ".gguf":
            if not base.is_file():
                raise MissingResourceError(f"{base}: GGUF file not found")
            location, tok_kwargs = str(base.parent), {"gguf_file": base.name}
            load_kwargs["gguf_file"] = base.name
            if device_map in (None, "cpu") and "quantization_config" not in load_kwargs:
                # On the CPU the weights are unpacked into torch_dtype (the decoding kernels
                # repack them for oneDNN).
                load_kwargs.update(gguf_unpacked())
        else:
            location, tok_kwargs = str(base_model_name_or_path), {}
        tokenizer = AutoTokenizer.from_pretrained(location, **tok_kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, **load_kwargs)
        model.eval()
        head = None
        if dart_model_name_or_path is not None:
            head = DartHead.from_pretrained(
                dart_model_name_or_path, double_final_norm=double_final_norm
            )
        pruner = None
        ngram = None
        if ngram_server is not None:
            pruner = _remote_pruner(ngram_server, pruner_config)
        elif ngram_model_name_or_path is not None:
            ngram = load_ngram(ngram_model_name_or_path, is_small=is_small_ngram)
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
        )
        if tree_budget == "auto" and dart.head is not None and dart.tree_builder is not None:
            from dart_client.decoding.autotune import auto_budget

            auto_budget(dart)
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

    def generate(self, *args: Any, **kwargs: Any) -> GenerationResult | GenerationStream:
        """``dart_generate(self, ...)``."""
        return dart_generate(self, *args, **kwargs)

    def ar_generate(self, *args: Any, **kwargs: Any) -> GenerationResult | GenerationStream:
        """``ar_generate(self, ...)``."""
        return ar_generate(self, *args, **kwargs)


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


def load_ngram(path: str | Path, *, is_small: bool = False) -> Any:
    """Open an n-gram model: ``.ngram`` file, ``full``/``small`` directory, ``.trie``, hub id."""
    from dart_client.ngram import NGram

    p = Path(path)
    name = "small" if is_small else "full"
    if p.is_dir():
        for candidate in (p / f"{name}.ngram", p / f"{name}.trie"):
            if candidate.is_file():
                p = candidate
                break
        else:
            raise MissingResourceError(f"{path}: no {name}.ngram or {name}.trie in this directory")
    elif not p.exists():
        text = str(path)
        if text.count("/") != 1 or text.startswith((".", "/", "~")):
            raise MissingResourceError(f"{path}: no such n-gram model")
        try:
            from huggingface_hub import hf_hub_download

            p = Path(hf_hub_download(text, f"{name}.trie"))
        except Exception as err:  # hub errors vary by version; report what happened
            raise MissingResourceError(
                f"{path}: not a local n-gram model, and downloading {name}.trie failed ({err})"
            ) from None
    if p.suffix == ".trie":
        p = _converted_trie(p)
    return NGram.open(str(p))


def _converted_trie(trie: Path) -> Path:
    """Convert a reference ``.trie`` once; later loads reuse the cached ``.ngram``."""
    from dart_client.embedded import cache_dir
    from dart_client.ngram.build import import_dart

    stat = trie.stat()
    key = hashlib.sha256(f"{trie.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache_dir() / "imported" / f"{trie.stem}-{key[:16]}.ngram"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        import_dart(str(trie), str(out))
    return out


def _remote_pruner(address: str, pruner_config: Any) -> Any:
    """A pruner served by the n-gram daemon (``grpc://host:port``; a bare host:port works)."""
    from dart_client.ngram.remote import connect

    url = address if "://" in address else f"grpc://{address}"
    return connect(url).pruner(pruner_config)
