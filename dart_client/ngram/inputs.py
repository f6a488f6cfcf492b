"""Input coercion shared by the n-gram model, the in-process pruner and the daemon client.

Lists, numpy arrays and torch tensors (on any device) become the C-contiguous int64 /
float32 arrays the native code reads, without a copy when they already are. Only the type
and the shape are checked here; values (vocabulary, budgets, probabilities) are validated
once, by the Rust core. Each caller names the exception class its API documents.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = ["as_numpy", "budget", "ids", "lookup_path", "probs"]


def as_numpy(x: Any) -> Any:
    """A torch tensor (any device, any float width) as a numpy array (a view for CPU
    tensors numpy can hold); anything else unchanged."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()  # numpy has no bfloat16
        return t.numpy()
    return x


def _ready(x: Any, dtype: type[np.generic], ndim: int) -> bool:
    """Whether ``x`` is already the C-contiguous array of ``dtype`` and ``ndim`` asked for."""
    return type(x) is np.ndarray and x.dtype == dtype and x.ndim == ndim and x.flags.c_contiguous


def ids(
    x: Any,
    ndim: int,
    what: str,
    error: type[Exception],
    out_of_vocab: type[Exception] | None = None,
) -> npt.NDArray[np.int64]:
    """Integer token ids as a C-contiguous int64 array of ``ndim`` dimensions. ``error`` for a
    wrong dtype or shape; ``out_of_vocab`` (default ``error``) for uint64 ids beyond int64."""
    if _ready(x, np.int64, ndim):
        return x  # the decoding loop's arrays, every row of every step: nothing to convert
    a = np.asarray(as_numpy(x))
    if a.size == 0 and a.dtype.kind == "f":
        a = a.astype(np.int64)  # np.asarray([]) is float64
    if a.dtype.kind not in "iu":
        raise error(f"{what} must hold integer token ids, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise error(f"{what} must be {ndim}-dimensional, got shape {a.shape}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise (out_of_vocab or error)(f"{what} holds {int(a.max())}, not a valid token id")
    return np.ascontiguousarray(a, dtype=np.int64)


def probs(x: Any, ndim: int, what: str, error: type[Exception]) -> npt.NDArray[np.float32]:
    """Probabilities as a C-contiguous float32 array of ``ndim`` dimensions."""
    if _ready(x, np.float32, ndim):
        return x
    a = np.asarray(as_numpy(x))
    if a.dtype.kind != "f" and a.size:
        raise error(f"{what} must hold floating-point probabilities, got dtype {a.dtype}")
    if a.ndim != ndim:
        raise error(f"{what} must be {ndim}-dimensional, got shape {a.shape}")
    return np.ascontiguousarray(a, dtype=np.float32)


def budget(b: Any, what: str, error: type[Exception], maximum: int | None = None) -> int | None:
    """A node budget: None, or an integer (the Rust core checks its range); ``maximum``: what
    the transport can carry."""
    if b is None:
        return None
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)):
        raise error(f"{what} = {b!r}; expected an integer >= 0 or None")
    if maximum is not None and not 0 <= b <= maximum:
        raise error(f"{what} = {b!r}; expected an integer in [0, {maximum}]")
    return int(b)


def lookup_path(
    path: Any, what: str, error: type[Exception], out_of_vocab: type[Exception] | None = None
) -> npt.NDArray[np.int64] | None:
    """A lookup path as int64 ids (None or empty: no path)."""
    if path is None:
        return None
    a = ids(path, 1, what, error, out_of_vocab)
    return a if a.size else None
