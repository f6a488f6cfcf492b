"""A decoder layer's element-wise parts and its decoding attention on cuda as Triton kernels.

On a GPU a small model's decoding step is mostly tiny kernels: transformers' RMS norm is
about 8 of them (casts, square, mean, add, rsqrt, two products), its rotary embedding about 6
per tensor, the SiLU-gated product 2. On an H200 a SmolLM2-135M step ran about 900 kernels
for 3.3 ms of GPU time, 1-5 us each even inside a CUDA graph (docs/gpu.md). Here each is one
kernel: :func:`rms_norm`, :func:`rotary` and :func:`silu_mul`, rounding where PyTorch's
operations round (round to nearest even, done on the bits so that Triton's CPU interpreter,
which truncates, computes the same values as a GPU), the norm's sum of squares in its own
order, the exponential and reciprocal square root as Triton computes them: equal to
transformers' up to the last bit of some values.

On by default for cuda targets (``DART_GPU_KERNELS=torch`` keeps PyTorch's own,
:func:`requested`), through the same module switch as the CPU's kernels
(:func:`dart_client.models.elementwise.use_native_elementwise`). On an H200 they took a
SmolLM2-135M decoding step from 3.94 to 2.67 ms (docs/gpu.md).
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Any

import torch

from dart_client.errors import InvalidArgumentError

#: Triton's CPU interpreter (the tests' way of running the kernels), as the process started.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
#: Output dtypes the kernels write, as the constexpr they take.
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


#: The switches' values: these kernels, or PyTorch's own.
SWITCH = {"triton": True, "on": True, "torch": False, "off": False}


def _switch(name: str, default: bool) -> bool:
    """The environment variable ``name`` as a :data:`SWITCH` value (unset: ``default``)."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return default
    if value not in SWITCH:
        raise InvalidArgumentError(
            f"{name} = {value!r}; expected 'triton' or 'torch' "
            f"(the default: {'triton' if default else 'torch'})"
        )
    return SWITCH[value]


def requested() -> bool:
    """Whether cuda targets take these kernels: unless ``DART_GPU_KERNELS`` is ``torch``
    (or ``off``)."""
    return _switch("DART_GPU_KERNELS", default=True)


@functools.cache
def available() -> bool:
    """Whether Triton is installed (it ships with PyTorch's CUDA wheels); it is imported
    only when a kernel first runs."""
    return importlib.util.find_spec("triton") is not None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these: one device that is cuda (or any device under
    Triton's interpreter, which the tests use), a dtype they write, no gradient wanted."""
    if not available():
        return False
    grad = torch.is_grad_enabled()
    interpret = _INTERPRET
    first = tensors[0]
    return all(
        (t.device.type == "cuda" or interpret)
        and t.device == first.device
        and t.dtype == first.dtype
        and t.dtype in _DTYPE_CODE
        and not (grad and t.requires_grad)
        for t in tensors
    )


def _kernels() -> Any:
    from dart_client.models import triton_kernels

    return triton_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm`` over the last axis of ``x`` in one kernel."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        k = _kernels()
        block = k.triton.next_power_of_2(n)
        k._rms_norm_kernel[(rows.shape[0],)](
            rows, weight, out, rows.stride(0), out.stride(0), n, eps,
            BLOCK=block, CODE=_DTYPE_CODE[x.dtype],
        )  # fmt: skip
    return out.view(x.shape)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel, rounded as PyTorch's two operations round."""
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        k = _kernels()
        block = 1024
        k._silu_mul_kernel[(k.triton.cdiv(n, block),)](
            gate, up, out, n, BLOCK=block, CODE=_DTYPE_CODE[gate.dtype]
        )
    return out


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotary embedding of ``x`` ``(b, heads, n, d)`` (any strides) with ``cos`` /
    ``sin`` ``(b | 1, n, d)``; the result ``(b, heads, n, d)``, contiguous."""
    b, heads, n, d = x.shape
    out = torch.empty((b, heads, n, d), dtype=x.dtype, device=x.device)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if out.numel():
        table_batch = cos.stride(0) if cos.shape[0] == b else 0
        k = _kernels()
        k._rotary_kernel[(b * heads * n,)](
            x, cos, sin, out, heads, n, d,
            x.stride(0), x.stride(1), x.stride(2), x.stride(3),
            table_batch, cos.stride(1), cos.stride(2),
            BLOCK=k.triton.next_power_of_2(d), CODE=_DTYPE_CODE[x.dtype],
        )  # fmt: skip
    return out


def attention_requested(capability: tuple[int, int]) -> bool:
    """Whether a cuda target on a GPU of compute ``capability`` attends with
    :func:`tree_attention`: by default from Ampere (8.0) on, whose tensor cores take its
    TF32 products; ``DART_GPU_ATTENTION=triton`` / ``torch`` (PyTorch's SDPA) choose. On an
    H200 it took SmolLM2-135M's one-token step from 2.69 to 1.78 ms and its 61-node tree
    step from 3.00 to 2.23 ms, as close to exact attention as SDPA's memory-efficient
    kernel (docs/gpu.md)."""
    return _switch("DART_GPU_ATTENTION", default=capability >= (8, 0))


def tree_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None = None,
) -> torch.Tensor:
    """Attention of a few dozen queries (a tree, or one token) over a cache window, in one
    kernel: ``query`` ``(b, h, n, d)``, ``key`` / ``value`` ``(b, kv, L, d)`` (any strides:
    views of the static cache), ``mask`` additive ``(b | 1, 1 | h, n, >= L)``. The query heads
    of a K/V head are rows of one program, which reads each key once. Returns ``(b, n, h, d)``
    (transformers' layout), computed in float32."""
    b, h, n, d = query.shape
    kv, length = key.shape[1], key.shape[2]
    if h % kv or d & (d - 1) or d < 16:
        raise InvalidArgumentError(f"tree_attention: {h} query heads over {kv}, head size {d}")
    groups = h // kv
    out = torch.empty((b, n, h, d), dtype=query.dtype, device=query.device)
    if not out.numel():
        return out
    mask = mask[..., :length]
    mb = mask.stride(0) if mask.shape[0] == b and b > 1 else 0
    mh = mask.stride(1) if mask.shape[1] == h and h > 1 else 0
    k = _kernels()
    block_m = 16 if groups * n <= 16 else 64
    grid = (b * kv, k.triton.cdiv(groups * n, block_m))
    wide = query.dtype == torch.float32
    k._tree_attention_kernel[grid](
        query, key, value, mask, out,
        *query.stride(), *key.stride(), *value.stride(),
        mb, mh, mask.stride(2), mask.stride(3), *out.stride(),
        kv, groups, n, length, scaling if scaling is not None else d**-0.5,
        BLOCK_M=block_m, BLOCK_N=64, BLOCK_D=d,
        PRECISION="ieee" if wide else "tf32", PV_PRECISION="ieee" if wide else "tf32x3",
        CODE=_DTYPE_CODE[query.dtype],
    )  # fmt: skip
    return out
