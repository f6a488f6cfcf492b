"""Linear layers on the CPU: weights packed for multiplying a few rows.

PyTorch's plain ``F.linear`` on the CPU multiplies a few rows (a draft step, a tree of a few
dozen nodes) much slower per weight byte than one row, so a tree forward costs far more than
an autoregressive one. Two packed kernels close that gap (measurements:
``docs/performance-notes.md``):

- bf16 weights on CPUs with AVX-512 or AVX2+FMA use DART's own matmul
  (``dart_kernels::PackedMatrix``, bound as ``dart_client._native.PackedMatrix``): a panel
  layout streamed once per call with software prefetch, up to 12 rows per weight load, f32
  FMAs. Every row is computed in the same order whatever the row count, so a tree's products
  equal one-token decoding's bit for bit. On CPUs with AMX-BF16 the same layout is
  multiplied in tiles, up to 32 rows per weight load; on CPUs with AVX512-BF16 (AMD Zen 4
  and later, Intel Cooper Lake) by ``vdpbf16ps``, two inputs per instruction straight from
  the packed bf16 pairs (2x the FMA kernel's throughput from 4 rows on a Zen 4); on CPUs
  with AVX2 and FMA but no AVX-512 (AMD Zen 1-3, Intel client cores), in 8-lane registers
  (``_native.decoding_matmul_backend()`` says which kernel runs). The AVX2, AVX-512 and
  scalar kernels give the same bits (one f32 FMA per input, in input order, per output); AMX
  and AVX512-BF16 round their own way, but their rows too are independent of each other.
- fp32 weights, and bf16 on CPUs without AVX2, use oneDNN's prepacked weights (the kernels
  IPEX and vLLM's CPU backend use). A single row keeps PyTorch's kernel there.

The packed copy lives beside the parameters (the checkpoint layout never changes) and is
rebuilt when a weight changes. :func:`set_cpu_matmul` chooses between the kernels (for
benchmarks); :func:`project` is the matmul of the DART head (several projections stacked into
one); :func:`pack_linear_layers` makes every ``nn.Linear`` of a target model use it.
"""

from __future__ import annotations

import logging
import os
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module

from dart_client import _native
from dart_client.models.native import (
    DECODING_ROWS,
    NATIVE_BF16_GEMM,
    SIMD_KERNELS,
    bf16_bits,
    from_bits,
)

log = logging.getLogger(__name__)

#: dtypes the packed kernels take (both are faster packed on x86 CPUs with AVX-512 / AMX).
PACKABLE = (torch.bfloat16, torch.float32)

CpuMatmul = Literal["auto", "dart", "onednn"]
_cpu_matmul: CpuMatmul = "auto"


def set_cpu_matmul(kind: CpuMatmul) -> None:
    """Which packed kernel multiplies bf16 weights from now on: ``"auto"`` (DART's own where
    the CPU has AVX-512 or AVX2+FMA, otherwise oneDNN), ``"dart"`` (an error without them) or
    ``"onednn"``. Each kind keeps its own packed copies (switching back costs nothing, each
    kind in use costs the weights' size again)."""
    global _cpu_matmul
    if kind not in ("auto", "dart", "onednn"):
        raise ValueError(f"cpu matmul {kind!r}; expected 'auto', 'dart' or 'onednn'")
    if kind == "dart" and not SIMD_KERNELS:
        raise RuntimeError(
            "DART's CPU matmul needs AVX-512 (F, BW, VL) or AVX2 with FMA; this CPU has neither"
        )
    _cpu_matmul = kind


def cpu_matmul() -> CpuMatmul:
    """The kind :func:`set_cpu_matmul` chose last."""
    return _cpu_matmul


def _dart_matmul_for(dtype: torch.dtype) -> bool:
    return (
        dtype == torch.bfloat16
        and _cpu_matmul != "onednn"
        and (_cpu_matmul == "dart" or SIMD_KERNELS)
    )


class DartMatmul:
    """A bf16 weight packed for DART's decoding matmul; ``self(x, bias)`` is
    ``F.linear(x, weight, bias)`` (same shapes, bf16 result)."""

    dtype = torch.bfloat16

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = _native.PackedMatrix(bf16_bits(weight.contiguous()))

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        # This runs per linear layer and step: the kernel takes x's leading dimensions as
        # rows and allocates the result (torch.empty and reshapes cost more than the kernel
        # call on a small matrix).
        if not x.is_contiguous():
            x = x.contiguous()
        return from_bits(
            self.packed.matmul(
                x.view(torch.uint16).numpy(),
                None,
                None if bias is None else bf16_bits(bias.to(torch.bfloat16)),
                torch.get_num_threads(),
            )
        )


class OneDnnMatmul:
    """A weight in oneDNN's blocked layout; ``self(x, bias)`` is ``F.linear(x, weight, bias)``."""

    def __init__(self, packed: torch.Tensor, dtype: torch.dtype) -> None:
        self.packed = packed
        self.dtype = dtype

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")


PackedWeight = DartMatmul | OneDnnMatmul


def project(
    module: nn.Module,
    names: tuple[str, ...],
    x: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x`` times the weights of ``module``'s linear layers ``names`` stacked along the
    output dimension (one matmul for several projections: q/k/v, gate/up), plus ``bias``.

    Under autograd the stack is built per call from the live parameters, so gradients reach
    each of them. Otherwise it is built once (:func:`derived_weight`), and on the CPU packed
    (:func:`pack_for_cpu`), at the cost of a second copy of the weights. The ``nn.Linear``
    layers stay the parameters: the checkpoint layout does not change.
    """

    if len(names) == 1 and (
        # One row (a decoding step) without DART's matmul: the plain kernel reads the weight
        # as fast, and its call costs a few microseconds less than oneDNN's (per layer, per
        # token).
        (x.numel() == x.shape[-1] and not _dart_matmul_for(x.dtype))
        # A prompt's prefill where PyTorch multiplies bf16 natively: its kernel beats the
        # decoding one on long blocks. The layer's own weight, so no packed copy is made for
        # it (a layer that decodes through fused_projection never needs its own).
        or (prompt_block(x) and _dart_matmul_for(x.dtype))
    ):
        return F.linear(x, module._modules[names[0]]._parameters["weight"], bias)

    weight, packed = derived_weight(module, f"linear-{_cpu_matmul}", names, _stack_and_pack)
    # The packed kernels have no backward: an input that needs a gradient takes F.linear.
    if (
        packed is not None
        and x.dtype == packed.dtype
        and not (x.requires_grad and torch.is_grad_enabled())
        # A stack's prompt-sized block: PyTorch's kernel (as for one layer above).
        and not (isinstance(packed, DartMatmul) and prompt_block(x))
    ):
        return packed(x, bias)
    return F.linear(x, weight, bias)


def projection_matrix(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> Any:
    """The DART-packed matrix (a ``_native.PackedMatrix``) that :func:`project` multiplies
    ``x`` by for ``module``'s layers ``names`` (the same cached copy), for a caller that
    runs the kernel itself; None where :func:`project` would not use DART's matmul."""
    if not _dart_matmul_for(x.dtype) or prompt_block(x) or torch.is_grad_enabled():
        return None
    _, packed = derived_weight(module, f"linear-{_cpu_matmul}", names, _stack_and_pack)
    return packed.packed if isinstance(packed, DartMatmul) else None


def fused_projection(
    module: nn.Module, names: tuple[str, ...], x: torch.Tensor
) -> torch.Tensor | None:
    """``x`` times ``module``'s linear layers ``names`` stacked along the output dimension
    (q/k/v, gate/up: one weight pass and one call instead of several), plus their biases,
    where DART's decoding matmul takes ``x`` (:func:`decoding_matrix`); None where it does
    not (the caller runs the layers one by one).

    Each output column is computed on its own, so the stacked product is the layers'
    products bit for bit."""
    found = decoding_matrix(module, names, x)
    return None if found is None else found[0](x, found[1])


def decoding_matrix(
    module: nn.Module, names: tuple[str, ...], x: torch.Tensor
) -> tuple[DartMatmul, torch.Tensor | None] | None:
    """The DART-packed matrix of ``module``'s linear layers ``names`` (their weights stacked
    along the output dimension when several) and their stacked bias, for multiplying ``x``
    without calling the layers; None where DART's decoding matmul does not take ``x``, the
    layers were not switched by :func:`pack_linear_layers`, a gradient is wanted, or a hook
    would miss the call.

    One layer's matrix is the one its own packed forward uses (:func:`project`); a stack is
    packed once (:func:`derived_weight`) and stands in for its layers' own copies, which
    decoding then never builds: memory stays as :func:`pack_linear_layers` reported.
    """
    if not _dart_matmul_for(x.dtype) or prompt_block(x):
        return None
    submodules: dict[str, Any] = module._modules
    layers = [submodules[name] for name in names]
    if not all("_plain_forward" in layer.__dict__ for layer in layers):
        return None
    if torch.is_grad_enabled() and (
        x.requires_grad or any(layer._parameters["weight"].requires_grad for layer in layers)
    ):
        return None
    # The layers' forward is bypassed: a hook on one of them must see its call.
    if any(layer._forward_hooks or layer._forward_pre_hooks for layer in layers) or (
        hooks_anywhere()
    ):
        return None
    biases = [layer._parameters["bias"] for layer in layers]
    if len(names) == 1:
        _, packed = derived_weight(module, f"linear-{_cpu_matmul}", names, _stack_and_pack)
        return (packed, biases[0]) if isinstance(packed, DartMatmul) else None
    if any(b is not None for b in biases) and any(b is None for b in biases):
        return None

    def build(weights: list[torch.Tensor], live: bool) -> tuple[DartMatmul, torch.Tensor | None]:
        bias = None if biases[0] is None else torch.cat(biases).to(torch.bfloat16)
        return DartMatmul(torch.cat(weights)), bias

    stacked: tuple[DartMatmul, torch.Tensor | None] = derived_weight(
        module, "fused-dart", names, build
    )
    return stacked


def prompt_block(x: torch.Tensor) -> bool:
    """Whether ``x`` is a prompt-sized block (a prefill) on a CPU where PyTorch multiplies
    bf16 natively: its kernel beats DART's decoding matmul there."""
    return NATIVE_BF16_GEMM and x.numel() > DECODING_ROWS * x.shape[-1]


def _stack_and_pack(
    weights: list[torch.Tensor], live: bool
) -> tuple[torch.Tensor, PackedWeight | None]:
    """:func:`project`'s derived weight: the weights stacked, and packed unless ``live``."""
    weight = weights[0] if len(weights) == 1 else torch.cat(weights)
    return weight, None if live else pack_for_cpu(weight)


def hooks_anywhere() -> bool:
    """Whether global module hooks are registered (they run for every module call, so a
    path that bypasses module calls must not run)."""
    return bool(
        nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
        or getattr(nn_module, "_global_forward_hooks_always_called", None)
    )


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


def pack_for_cpu(weight: torch.Tensor) -> PackedWeight | None:
    """``weight`` packed for the CPU's matmul of a few rows (DART's own for bf16 on AVX-512/AVX2,
    otherwise oneDNN's), or None where neither applies (other devices and dtypes, builds
    without oneDNN, CPUs it does not support)."""
    if weight.device.type != "cpu" or weight.dtype not in PACKABLE or weight.dim() != 2:
        return None
    probe = weight.new_ones((1, weight.shape[1]))
    packed: PackedWeight
    try:
        if _dart_matmul_for(weight.dtype):
            packed = DartMatmul(weight)
        elif torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled:
            reordered = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            packed = OneDnnMatmul(reordered, weight.dtype)
        else:
            return None
        got = packed(probe, None)
    except (RuntimeError, AttributeError):
        return None
    want = F.linear(probe, weight)
    # Never trade correctness for speed: the packed product must be the plain one.
    return packed if torch.allclose(got, want, rtol=1e-2, atol=1e-3) else None


def cpu_packing_available(dtype: torch.dtype) -> bool:
    """Whether this CPU and torch build have a packed matmul for ``dtype`` weights (probed
    the way :func:`pack_for_cpu` packs; oneDNN's bf16 path needs AVX-512 or AVX-NE-CONVERT)."""
    return pack_for_cpu(torch.ones(8, 32, dtype=dtype)) is not None


@dataclass
class PackReport:
    """What :func:`pack_linear_layers` did: layers switched, the bytes of their weights (the
    packed copies take about as much again), or why nothing was packed."""

    layers: int
    weight_bytes: int
    skipped: str | None = None


def pack_linear_layers(model: nn.Module, *, max_memory_fraction: float = 0.5) -> PackReport:
    """Make every CPU ``nn.Linear`` of ``model`` in bf16/fp32 multiply with packed weights
    (:func:`project`); other layers are left alone.

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
    if pack_for_cpu(parents[0][2].weight) is None:
        return PackReport(0, 0, "no packed CPU matmul (DART's or oneDNN's) on this build or CPU")
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
