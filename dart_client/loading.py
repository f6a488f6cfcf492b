"""Loading the parts of a DartModel from what users name on a command line or in code.

- targets (:func:`load_target`): ``None`` (the embedded SmolLM2-135M-Instruct), a local
  transformers directory, a hub id, or a ``.gguf`` file;
- heads (:func:`load_head`): a directory or hub id, ``"random"`` (untrained), ``"auto"`` (the
  shipped trained head for the embedded target, else random);
- n-grams (:func:`load_ngram`): a ``.ngram`` file, a ``full``/``small`` directory, a reference
  ``.trie`` (converted once and cached), a hub id, ``"embedded"`` (the embedded ShareGPT
  3-gram), or a daemon URL (``grpc://host:port``) through :func:`load_pruner`.

``DartModel.from_pretrained``, ``dart_model.build_model`` (the CLIs, bench and UI) and the
training CLIs load through here; nothing here parses arguments.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dart_client.errors import InvalidArgumentError, MissingResourceError

if TYPE_CHECKING:
    import torch

__all__ = [  # and DTYPES (name -> torch dtype), built on first use by __getattr__
    "DTYPE_NAMES",
    "NGRAM_OPEN_OPTIONS",
    "check_ngram_open",
    "check_spec",
    "gguf_unpacked",
    "is_hub_id",
    "load_head",
    "load_ngram",
    "load_pruner",
    "load_target",
    "note",
    "torch_dtype",
    "unpacked_gguf",
]

#: Command-line dtype names (``--dtype``, ``--target-dtype``, ``--head-dtype``), in the order
#: of :data:`DTYPES`. Known without importing torch, so argument parsing stays fast.
DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp64")


def __getattr__(name: str) -> Any:
    # ``DTYPES`` (name -> torch dtype) is built on first use: this module imports torch only
    # when something is loaded.
    if name == "DTYPES":
        import torch

        dtypes: dict[str, torch.dtype] = dict(
            zip(
                DTYPE_NAMES,
                (torch.bfloat16, torch.float16, torch.float32, torch.float64),
                strict=True,
            )
        )
        globals()["DTYPES"] = dtypes
        return dtypes
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


#: Files that make a directory a transformers model.
_MODEL_FILES = ("config.json",)


def torch_dtype(name: str) -> torch.dtype | str:
    """A :data:`DTYPES` name as a torch dtype; ``"auto"`` stays ``"auto"`` (the checkpoint's)."""
    if name == "auto":
        return "auto"
    dtypes: dict[str, torch.dtype] = __getattr__("DTYPES")
    try:
        return dtypes[name]
    except KeyError:
        raise InvalidArgumentError(
            f"dtype {name!r}; expected one of {[*DTYPE_NAMES, 'auto']}"
        ) from None


def is_hub_id(spec: str) -> bool:
    """Whether ``spec`` reads as a Hugging Face hub id (``owner/name``), not a local path."""
    return spec.count("/") == 1 and not spec.startswith((".", "/", "~")) and ":" not in spec


def check_spec(kind: str, spec: str, *, suffixes: tuple[str, ...] = ()) -> None:
    """Raises :class:`MissingResourceError` when ``spec`` (a ``kind``: "target", "head",
    "n-gram") is neither an existing path nor a hub id: checked before anything loads. A path
    ending in one of ``suffixes`` (e.g. ``.gguf``) must exist even when it looks like a hub id."""
    path = Path(spec).expanduser()
    if path.exists():
        return
    if suffixes and spec.endswith(suffixes):
        raise MissingResourceError(f"{spec}: {kind} file not found")
    if not is_hub_id(spec):
        raise MissingResourceError(f"{spec}: no such {kind} (neither a local path nor a hub id)")


def gguf_unpacked() -> dict[str, Any]:
    """``from_pretrained`` keyword arguments that load a GGUF file's weights unpacked into
    the requested dtype. transformers' GGUF loader unpacks them anyway; saying so spares users
    its warning that the weights "stay quantized", which it prints although they do not."""
    try:
        from transformers import GgufConfig
    except ImportError:  # transformers before GgufConfig: always unpacks, says nothing
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_target(
    spec: str | Path | None,
    *,
    dtype: torch.dtype | str | None = None,
    device_map: Any = None,
    **hf_kwargs: Any,
) -> tuple[Any, Any]:
    """``(model, tokenizer)`` of a transformers causal LM, in eval mode.

    ``spec``: None (the embedded SmolLM2), a ``.gguf`` file, a local directory (it must hold a
    ``config.json``) or a hub id. ``dtype`` and ``device_map`` go to ``from_pretrained``.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec is None:
        from dart_client.embedded import smollm2_gguf

        spec = smollm2_gguf()
    load_kwargs = dict(hf_kwargs)
    if dtype is not None:
        load_kwargs["dtype"] = dtype
    if device_map is not None:
        load_kwargs["device_map"] = device_map
    path = Path(spec)
    tok_kwargs: dict[str, Any]
    if path.suffix == ".gguf":
        if not path.is_file():
            raise MissingResourceError(f"{path}: GGUF file not found")
        if "quantization_config" in load_kwargs:  # the caller's own GGUF handling
            location, tok_kwargs = str(path.parent), {"gguf_file": path.name}
            load_kwargs["gguf_file"] = path.name
        else:
            # The weights are unpacked into the dtype once and kept as safetensors; every
            # later load reads those (the decoding kernels repack them for oneDNN).
            location, tok_kwargs = str(unpacked_gguf(path, dtype)), {}
    else:
        location, tok_kwargs = str(spec), {}
        if path.is_dir() and not any((path / f).is_file() for f in _MODEL_FILES):
            raise MissingResourceError(
                f"{path}: not a model directory (no {' or '.join(_MODEL_FILES)}); expected a "
                "transformers model directory, a .gguf file or a hub id"
            )
        if path.exists() and not path.is_dir():
            raise MissingResourceError(
                f"{path}: not a model (expected a transformers model directory, a .gguf file "
                "or a hub id)"
            )
    try:
        tokenizer = AutoTokenizer.from_pretrained(location, **tok_kwargs)
        model = AutoModelForCausalLM.from_pretrained(location, **load_kwargs)
    except Exception as err:
        if path.exists() or not is_hub_id(str(spec)):
            raise
        # A hub id that does not resolve (offline, misspelt, gated): one line, not the
        # transformers / huggingface_hub traceback.
        raise MissingResourceError(
            f"{spec}: not a local path, and loading it from the Hugging Face hub failed "
            f"({type(err).__name__}: {_first_line(err)})"
        ) from None
    return model.eval(), tokenizer


def unpacked_gguf(gguf: Path, dtype: torch.dtype | str | None = None) -> Path:
    """A transformers model directory (config, safetensors, tokenizer) holding ``gguf``'s
    weights unpacked into ``dtype``: written once into the cache directory, keyed by the
    file (path, size, modification time), the dtype and the transformers version, and
    reused by every later load. Unpacking a GGUF takes seconds; reading safetensors does not.
    """
    import os
    import shutil

    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dart_client.embedded import cache_dir

    stat = gguf.stat()
    dtype_name = str(dtype).replace("torch.", "")
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{dtype_name}:"
    key += transformers.__version__
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{dtype_name}-{digest}"
    if (out / "config.json").is_file():
        return out
    load_kwargs: dict[str, Any] = {"gguf_file": gguf.name, **gguf_unpacked()}
    if dtype is not None:
        load_kwargs["dtype"] = dtype
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), **load_kwargs)
    # Written beside the final name and renamed into place: a reader never sees half of it.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    del model
    try:
        tmp.rename(out)
    except OSError:  # another process got there first: theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else "no message"


def load_head(
    spec: str | Path | None,
    target_config: Any = None,
    *,
    embedded_target: bool = False,
    double_final_norm: bool | None = None,
    notes: list[str] | None = None,
) -> Any:
    """A :class:`~dart_client.models.head.DartHead`, or None when ``spec`` is None.

    ``spec``: a directory or hub id; ``"random"`` (an untrained head for ``target_config``);
    ``"auto"`` (the shipped trained head when the target is the embedded one and the head is
    installed, else random). What was chosen, and why, is appended to ``notes`` (printed to
    stderr when ``notes`` is None)."""
    from dart_client.embedded import SHIPPED_HEAD_DIR
    from dart_client.models.head import DartHead

    return _load_draft_model(
        spec,
        target_config,
        DartHead,
        SHIPPED_HEAD_DIR,
        "head",
        embedded_target=embedded_target,
        notes=notes,
        double_final_norm=double_final_norm,
    )


def load_drafter(
    spec: str | Path | None,
    target_config: Any = None,
    *,
    embedded_target: bool = False,
    double_final_norm: bool | None = None,
    notes: list[str] | None = None,
) -> Any:
    """The draft model at ``spec``: an :class:`~dart_client.models.eagle3.Eagle3Head` when its
    weights say so (:func:`~dart_client.models.head.is_eagle3_checkpoint`), else a DART head as
    :func:`load_head` loads it (``"auto"``, ``"random"`` and None included)."""
    if is_eagle3_spec(spec):
        if double_final_norm is not None:
            raise InvalidArgumentError(
                f"{spec} is an EAGLE-3 head: double_final_norm is a DART head's setting"
            )
        return load_eagle3_head(spec, target_config, embedded_target=embedded_target, notes=notes)
    return load_head(
        spec,
        target_config,
        embedded_target=embedded_target,
        double_final_norm=double_final_norm,
        notes=notes,
    )


def is_eagle3_spec(spec: str | Path | None) -> bool:
    """Whether a ``--head`` / ``from_pretrained`` head argument is an EAGLE-3 checkpoint."""
    if spec is None or str(spec) in ("auto", "random"):
        return False
    from dart_client.models.head import is_eagle3_checkpoint

    return is_eagle3_checkpoint(spec)


def load_eagle3_head(
    spec: str | Path | None,
    target_config: Any = None,
    *,
    embedded_target: bool = False,
    notes: list[str] | None = None,
) -> Any:
    """An :class:`~dart_client.models.eagle3.Eagle3Head` (a published EAGLE-3 checkpoint
    directory or hub id), chosen as :func:`load_head` chooses a DART head (``"auto"``: the
    one shipped for the embedded target)."""
    from dart_client.embedded import SHIPPED_EAGLE3_DIR
    from dart_client.models.eagle3 import Eagle3Head

    return _load_draft_model(
        spec,
        target_config,
        Eagle3Head,
        SHIPPED_EAGLE3_DIR,
        "EAGLE-3 head",
        embedded_target=embedded_target,
        notes=notes,
    )


def _load_draft_model(
    spec: str | Path | None,
    target_config: Any,
    cls: Any,
    shipped: Path,
    what: str,
    *,
    embedded_target: bool,
    notes: list[str] | None,
    **from_kwargs: Any,
) -> Any:
    if spec is None:
        return None
    spec = str(spec)
    if spec == "auto":
        from dart_client.embedded import display_path

        if embedded_target and (shipped / "model.safetensors").is_file():
            note(notes, f"{what}: {display_path(shipped)}")
            spec = str(shipped)
        else:
            spec = "random"
    if spec == "random":
        if target_config is None:
            raise InvalidArgumentError(f"a random {what} needs the target's config")
        note(
            notes,
            f"{what}: an untrained random {what} drafts nothing useful (tau near 1): speedups "
            "then reflect the overhead, not the method",
        )
        vocab = int(target_config.vocab_size)
        return cls.random_init(target_config, draft_vocab_size=min(8192, vocab))
    return cls.from_pretrained(spec, **from_kwargs)


#: What a user may ask of a local n-gram model's opening (``ngram_open=`` in code,
#: ``--ngram-open`` on command lines): :meth:`dart_client.ngram.model.NGram.open`'s options.
#: For a model of many GB, ``checksums=False, prefetch=True`` opens in milliseconds instead of
#: reading the whole file first, and warms the page cache in the background.
NGRAM_OPEN_OPTIONS = (
    "checksums",
    "prefetch",
    "populate",
    "in_memory",
    "huge_pages",
    "random_access",
    "lock",
    "verify",
)


def load_ngram(
    spec: str | Path, *, is_small: bool = False, open_options: Mapping[str, bool] | None = None
) -> Any:
    """An n-gram model: ``.ngram`` file, ``full``/``small`` directory, ``.trie``, hub id,
    ``"embedded"`` (the ShareGPT 3-gram of the embedded default, built once), or a daemon URL
    (``grpc://``/``grpcs://``: a connected ``RemoteNGram``). ``open_options``: keyword
    arguments of ``NGram.open`` (names in :data:`NGRAM_OPEN_OPTIONS`) for a local model."""
    from dart_client.ngram.model import NGram

    text = str(spec)
    remote = text.startswith(("grpc://", "grpcs://"))
    options = check_ngram_open(open_options, daemon=text if remote else None)
    if remote:
        from dart_client.ngram.remote import connect

        return connect(text)
    if text == "embedded":
        from dart_client.ngram.embedded import ensure_ngram

        return NGram.open(str(ensure_ngram().path), **options)
    p = Path(spec)
    name = "small" if is_small else "full"
    if p.is_dir():
        for candidate in (p / f"{name}.ngram", p / f"{name}.trie"):
            if candidate.is_file():
                p = candidate
                break
        else:
            raise MissingResourceError(f"{spec}: no {name}.ngram or {name}.trie in this directory")
    elif not p.exists():
        if not is_hub_id(text):
            raise MissingResourceError(f"{spec}: no such n-gram model")
        try:
            from huggingface_hub import hf_hub_download

            p = Path(hf_hub_download(text, f"{name}.trie"))
        except Exception as err:  # hub errors vary by version; report what happened
            raise MissingResourceError(
                f"{spec}: not a local n-gram model, and downloading {name}.trie failed ({err})"
            ) from None
    if p.suffix == ".trie":
        p = _converted_trie(p)
    return NGram.open(str(p), **options)


def check_ngram_open(
    options: Mapping[str, bool] | None, *, daemon: str | None = None
) -> dict[str, bool]:
    """``options`` checked as ``NGram.open`` keywords (names in :data:`NGRAM_OPEN_OPTIONS`,
    True/False values); refused with any when the n-gram is served by ``daemon``."""
    if not options:
        return {}
    if daemon is not None:
        raise InvalidArgumentError(
            f"n-gram open options ({', '.join(options)}) apply to a local model; the daemon at "
            f"{daemon} opens its own (dart-ngram serve --prefetch, --in-memory, ...)"
        )
    unknown = sorted(set(options) - set(NGRAM_OPEN_OPTIONS))
    if unknown:
        raise InvalidArgumentError(
            f"unknown n-gram open option(s) {', '.join(unknown)}; "
            f"known: {', '.join(NGRAM_OPEN_OPTIONS)}"
        )
    for key, value in options.items():
        if not isinstance(value, bool):
            raise InvalidArgumentError(f"n-gram open option {key}={value!r}: expected True/False")
    return dict(options)


def load_pruner(address: str, pruner_config: Any = None) -> Any:
    """A pruner served by the n-gram daemon (``grpc://host:port``; a bare host:port works)."""
    from dart_client.ngram.remote import connect

    url = address if "://" in address else f"grpc://{address}"
    return connect(url).pruner(pruner_config)


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


def note(notes: list[str] | None, text: str) -> None:
    """Append ``text`` to ``notes``, or print it to stderr as a note when ``notes`` is None."""
    if notes is None:
        print(f"note: {text}", file=sys.stderr)
    else:
        notes.append(text)
