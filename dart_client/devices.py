"""Device strings from the command line, checked before anything is loaded or moved.

torch reports an unknown device type, a machine without a GPU or a missing GPU index with a
traceback from deep inside the first ``.to()``; the commands check ``--device`` up front instead
and say what is wrong and what is there.
"""

from __future__ import annotations

import torch

from dart_client.errors import InvalidArgumentError


def check_device(spec: str) -> torch.device:
    """``spec`` as a ``torch.device`` that exists on this machine, or an
    :class:`InvalidArgumentError` naming the problem."""
    try:
        device = torch.device(spec)
    except (RuntimeError, TypeError, ValueError) as err:
        raise InvalidArgumentError(f"unknown device {spec!r}: {err}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            raise InvalidArgumentError(
                f"device {spec!r}: no CUDA GPU is usable here (torch {torch.__version__}, "
                f"{build}); use --device cpu"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise InvalidArgumentError(
                f"device {spec!r}: this machine has {count} CUDA device(s), "
                f"cuda:0..cuda:{count - 1}"
            )
    elif device.type == "mps" and not torch.backends.mps.is_available():
        raise InvalidArgumentError(f"device {spec!r}: Apple's MPS backend is not available here")
    return device
