"""A decoder layer's element-wise parts on cuda as single Triton kernels (experimental).

On a GPU a small model's decoding step is mostly tiny kernels: transformers' RMS norm is
about 8 of them (casts, square, mean, add, rsqrt, two products), its rotary embedding about 6
per tensor, the SiLU-gated product 2. On an H200 a SmolLM2-135M step ran about 900 kernels
for 3.3 ms of GPU time, 1-5 us each even inside a CUDA graph (docs/gpu.md). Here each is one
kernel: :func:`rms_norm`, :func:`rotary` and :func:`silu_mul`, rounding where PyTorch's
operations round (round to nearest even, done on the bits so that Triton's CPU interpreter,
which truncates, computes the same values as a GPU), the norm's sum of squares in its own
order, the exponential and reciprocal square root as Triton computes them: equal to
transformers' up to the last bit of some values.

Switched on with ``DART_GPU_KERNELS=triton`` (:func:`requested`) through the same module
switch as the CPU's kernels (:func:`dart_client.models.elementwise.use_native_elementwise`).
Not yet measured on a GPU: off by default until it is.
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:  # Triton ships with PyTorch's CUDA wheels; elsewhere these kernels are unavailable.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

#: Output dtypes the kernels write, as the constexpr they take.
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def requested() -> bool:
    """Whether ``DART_GPU_KERNELS=triton`` asks for these kernels on cuda targets."""
    return os.environ.get("DART_GPU_KERNELS", "").strip().lower() == "triton"


def available() -> bool:
    return triton is not None


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these: one device that is cuda (or any device under
    Triton's interpreter, which the tests use), a dtype they write, no gradient wanted."""
    if triton is None:
        return False
    grad = torch.is_grad_enabled()
    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    first = tensors[0]
    return all(
        (t.device.type == "cuda" or interpret)
        and t.device == first.device
        and t.dtype == first.dtype
        and t.dtype in _DTYPE_CODE
        and not (grad and t.requires_grad)
        for t in tensors
    )


if triton is not None:

    @triton.jit
    def _round(x: Any, CODE: tl.constexpr) -> Any:
        """``x`` (float32) rounded to the output dtype, as a float32 value."""
        if CODE == 1:
            # bfloat16, round to nearest even on the bits (finite values).
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        elif CODE == 2:
            return x.to(tl.float16).to(tl.float32)
        else:
            return x

    @triton.jit
    def _rms_norm_kernel(
        X: Any, W: Any, Y: Any, x_stride: Any, y_stride: Any, N: Any, eps: Any,
        BLOCK: tl.constexpr, CODE: tl.constexpr,
    ) -> None:  # fmt: skip
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        inside = cols < N
        x = tl.load(X + row * x_stride + cols, mask=inside, other=0.0).to(tl.float32)
        variance = tl.sum(x * x, axis=0) / N
        normed = _round(x * tl.rsqrt(variance + eps), CODE)
        w = tl.load(W + cols, mask=inside, other=0.0).to(tl.float32)
        out = _round(w * normed, CODE)
        tl.store(Y + row * y_stride + cols, out.to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _silu_mul_kernel(
        G: Any, U: Any, Y: Any, n: Any, BLOCK: tl.constexpr, CODE: tl.constexpr
    ) -> None:
        offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offsets < n
        g = tl.load(G + offsets, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(U + offsets, mask=inside, other=0.0).to(tl.float32)
        silu = _round(g / (1.0 + tl.exp(-g)), CODE)
        tl.store(Y + offsets, _round(silu * u, CODE).to(Y.dtype.element_ty), mask=inside)

    @triton.jit
    def _rotary_kernel(
        X: Any, COS: Any, SIN: Any, Y: Any,
        heads: Any, tokens: Any, dim: Any,
        xb: Any, xh: Any, xn: Any, xd: Any, cb: Any, cn: Any, cd: Any,
        BLOCK: tl.constexpr, CODE: tl.constexpr,
    ) -> None:  # fmt: skip
        pid = tl.program_id(0)
        b = pid // (heads * tokens)
        h = (pid // tokens) % heads
        t = pid % tokens
        i = tl.arange(0, BLOCK)
        inside = i < dim
        half = dim // 2
        partner = tl.where(i < half, i + half, i - half)
        sign = tl.where(i < half, -1.0, 1.0)
        base = X + b * xb + h * xh + t * xn
        x = tl.load(base + i * xd, mask=inside, other=0.0).to(tl.float32)
        other = tl.load(base + partner * xd, mask=inside, other=0.0).to(tl.float32)
        table = b * cb + t * cn + i * cd
        cos = tl.load(COS + table, mask=inside, other=0.0).to(tl.float32)
        sin = tl.load(SIN + table, mask=inside, other=0.0).to(tl.float32)
        # transformers: q * cos + rotate_half(q) * sin, each product rounded, then the sum.
        out = _round(_round(x * cos, CODE) + _round(sign * other * sin, CODE), CODE)
        y = Y + ((b * heads + h) * tokens + t) * dim + i
        tl.store(y, out.to(Y.dtype.element_ty), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``LlamaRMSNorm`` over the last axis of ``x`` in one kernel."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
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
        block = 1024
        _silu_mul_kernel[(triton.cdiv(n, block),)](
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
        _rotary_kernel[(b * heads * n,)](
            x, cos, sin, out, heads, n, d,
            x.stride(0), x.stride(1), x.stride(2), x.stride(3),
            table_batch, cos.stride(1), cos.stride(2),
            BLOCK=triton.next_power_of_2(d), CODE=_DTYPE_CODE[x.dtype],
        )  # fmt: skip
    return out
