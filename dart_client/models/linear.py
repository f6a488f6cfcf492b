"""Linear layers on the CPU: weights kept in oneDNN's blocked layout.

PyTorch's plain ``F.linear`` on the CPU multiplies a few rows (a draft step, a tree of a few
dozen nodes) much slower per weight byte than one row, so a tree forward looked 1.5x as
expensive as an autoregressive one already at 2 tokens. oneDNN's prepacked weights close
most of that gap (the same kernels IPEX and vLLM's CPU backend use): measured on SmolLM2-135M
on one thread (with small-query attention, `python -m dart_client.bench.kernels`), a bf16
forward over 2 / 8 / 16 tokens costs 1.09x / 1.38x / 1.75x one token instead of 1.52x / 1.61x /
2.16x, an fp32 one over 8 tokens 1.99x instead of 3.40x. A single row keeps PyTorch's kernel,
which is as fast there. The packed copy lives beside the parameters (the checkpoint layout
never changes) and is rebuilt when a weight changes.

:func:`project` is the matmul of the DART head (several projections stacked into one);
:func:`pack_linear_layers` makes every ``nn.Linear`` of a target model use it.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

#: dtypes oneDNN packs (both are faster packed on x86 CPUs with AVX-512 / AMX).
PACKABLE = (torch.bfloat16, torch.float32)


def project(
    module: nn.Module,
    names: tuple[str, ...],
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` times the weights of ``module``'s linear layers ``names`` stacked along the
    output dimension (one matmul for several projections: q/k/v, gate/up), plus ``bias``.

    Under autograd the stack is built per call from the live parameters, so gradients reach
    each of them. Otherwise it is built once (:func:`derived_weight`), and on the CPU kept in
    oneDNN's blocked layout (:func:`pack_for_cpu`), at the cost of a second copy of the
    weights. The ``nn.Linear`` layers stay the parameters: the checkpoint layout does not
    change.
    """

    if len(names) == 1 and x.numel() == x.shape[-1]:
        # One row (a decoding step): the plain kernel reads the weight as fast, and its call
        # costs a few microseconds less than oneDNN's (x 211 layers of SmolLM2: 9% per token).
        return F.linear(x, module._modules[names[0]]._parameters["weight"], bias)

    def build(weights: list[torch.Tensor], live: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight = weights[0] if len(weights) == 1 else torch.cat(weights)
        return weight, None if live else pack_for_cpu(weight)

    weight, packed = derived_weight(module, "linear", names, build)
    if packed is not None and x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def derived_weight(
    module: nn.Module,
    kind: str,
    names: tuple[str, ...],
    build: Callable[[list[torch.Tensor], bool], Any],
) -> Any:
    """``build(weights, live)`` over the ``.weight`` of ``module``'s submodules ``names``.

    Under autograd (a weight requires grad) it is called per use with ``live=True``, so
    gradients flow; otherwise its result is cached on ``module`` and rebuilt only when a
    weight changes (new storage, dtype or device, or an in-place update).
    """
    # The registries directly: nn.Module.__getattr__ costs microseconds per call.
    submodules: dict[str, Any] = module._modules
    weights: list[torch.Tensor] = [submodules[name]._parameters["weight"] for name in names]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return build(weights, True)
    key = tuple((w.data_ptr(), w._version, w.dtype, w.device) for w in weights)
    cache: dict[tuple[str, tuple[str, ...]], tuple[Any, Any]] = module.__dict__.setdefault(
        "_derived_weights", {}
    )
    hit = cache.get((kind, names))
    if hit is None or hit[0] != key:
        with torch.no_grad():
            hit = (key, build(weights, False))
        cache[(kind, names)] = hit
    return hit[1]


def pack_for_cpu(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` reordered for oneDNN's CPU matmul, or None where that is not available
    (other devices and dtypes, builds without oneDNN, CPUs it does not support)."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in PACKABLE
        or weight.dim() != 2
        or not torch.backends.mkldnn.is_available()
        or not torch.backends.mkldnn.enabled
    ):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        probe = weight.new_ones((1, weight.shape[1]))
        got = torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "")
    except (RuntimeError, AttributeError):
        return None
    want = F.linear(probe, weight)
    # Never trade correctness for speed: the packed product must be the plain one.
    return packed if torch.allclose(got, want, rtol=1e-2, atol=1e-3) else None


@dataclass
class PackReport:
    """What :func:`pack_linear_layers` did: layers switched, the bytes of their weights (the
    packed copies take about as much again), or why nothing was packed."""

    layers: int
    weight_bytes: int
    skipped: str | None = None


def pack_linear_layers(model: nn.Module, *, max_memory_fraction: float = 0.5) -> PackReport:
    """Make every CPU ``nn.Linear`` of ``model`` in bf16/fp32 multiply with oneDNN-packed
    weights (:func:`project`); other layers are left alone.

    The packed copies are built on first use and need about as much memory again as those
    weights; when that exceeds ``max_memory_fraction`` of the memory available now, nothing
    is packed and the report says why. :func:`unpack_linear_layers` undoes it.
    """
    parents = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.weight.device.type == "cpu"
        and child.weight.dtype in PACKABLE
        and "_plain_forward" not in child.__dict__
    ]
    if not parents:
        return PackReport(0, 0, "no CPU bf16/fp32 nn.Linear layers")
    if not torch.backends.mkldnn.is_available() or pack_for_cpu(parents[0][2].weight) is None:
        return PackReport(0, 0, "oneDNN packing is not available on this build or CPU")
    # A tied weight (lm_head = embedding) is one tensor: count every storage once.
    sizes = {
        child.weight.data_ptr(): child.weight.numel() * child.weight.element_size()
        for _, _, child in parents
    }
    needed = sum(sizes.values())
    available = _available_memory()
    if available is not None and needed > max_memory_fraction * available:
        return PackReport(
            0,
            needed,
            f"packed weights need {needed / 2**20:.0f} MiB, more than "
            f"{max_memory_fraction:.0%} of the {available / 2**20:.0f} MiB available",
        )
    for parent, name, child in parents:
        child.__dict__["_plain_forward"] = child.forward
        child.forward = types.MethodType(_packed_forward(parent, name), child)
    return PackReport(len(parents), needed)


def unpack_linear_layers(model: nn.Module) -> int:
    """Undo :func:`pack_linear_layers`: the layers' own forward again, the copies dropped."""
    undone = 0
    for module in model.modules():
        plain = module.__dict__.pop("_plain_forward", None)
        if plain is not None:
            module.__dict__.pop("forward", None)
            undone += 1
        module.__dict__.pop("_derived_weights", None)
    return undone


def _packed_forward(parent: nn.Module, name: str) -> Callable[[nn.Linear, torch.Tensor], Any]:
    names = (name,)

    def forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        return project(parent, names, x, self.bias)

    return forward


def _available_memory() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    if hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None
