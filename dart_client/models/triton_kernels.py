"""The Triton kernels of :mod:`dart_client.models.gpu_kernels` (imported on first use: importing
Triton costs 0.3 s, which a process that never decodes on a GPU should not pay)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _round(x, CODE: tl.constexpr):
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
    X, W, Y, x_stride, y_stride, N, eps,
    BLOCK: tl.constexpr, CODE: tl.constexpr,
):  # fmt: skip
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
def _silu_mul_kernel(G, U, Y, n, BLOCK: tl.constexpr, CODE: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offsets < n
    g = tl.load(G + offsets, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(U + offsets, mask=inside, other=0.0).to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), CODE)
    tl.store(Y + offsets, _round(silu * u, CODE).to(Y.dtype.element_ty), mask=inside)


@triton.jit
def _rotary_kernel(
    X, COS, SIN, Y,
    heads, tokens, dim,
    xb, xh, xn, xd, cb, cn, cd,
    BLOCK: tl.constexpr, CODE: tl.constexpr,
):  # fmt: skip
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


@triton.jit
def _tree_attention_kernel(
    Q, K, V, MASK, OUT,
    qb, qh, qn, qd, kb, kh, kn, kd, vb, vh, vn, vd,
    mb, mh, mn, mk, ob, on, oh, od,
    kv_heads, groups, nodes, keys, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr, PV_PRECISION: tl.constexpr, CODE: tl.constexpr,
):  # fmt: skip
    """One K/V head's query rows (its ``groups`` query heads x ``nodes`` queries) against
    its keys, a block of rows per program: online softmax over blocks of keys, float32.
    Inputs are widened to float32. ``PRECISION``: "tf32" for half inputs (their products
    are exact in TF32), "ieee" for float32 ones. ``PV_PRECISION``: the probabilities are
    float32, which TF32 would round to 10 bits; "tf32x3" keeps them near float32's.
    """
    pid = tl.program_id(0)
    b = pid // kv_heads
    kv = pid % kv_heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    live = rows < groups * nodes
    head = kv * groups + rows // nodes
    node = rows % nodes
    dims = tl.arange(0, BLOCK_D)
    q = tl.load(
        Q + b * qb + head[:, None] * qh + node[:, None] * qn + dims[None, :] * qd,
        mask=live[:, None], other=0.0,
    ).to(tl.float32)  # fmt: skip
    best = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for start in range(0, keys, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < keys
        k = tl.load(
            K + b * kb + kv * kh + cols[None, :] * kn + dims[:, None] * kd,
            mask=inside[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        scores = tl.dot(q, k, input_precision=PRECISION) * scale
        bias = tl.load(
            MASK + b * mb + head[:, None] * mh + node[:, None] * mn + cols[None, :] * mk,
            mask=live[:, None] & inside[None, :], other=0.0,
        ).to(tl.float32)  # fmt: skip
        scores = tl.where(inside[None, :], scores + bias, float("-inf"))
        new_best = tl.maximum(best, tl.max(scores, 1))
        keep = tl.exp(best - new_best)
        p = tl.exp(scores - new_best[:, None])
        total = total * keep + tl.sum(p, 1)
        v = tl.load(
            V + b * vb + kv * vh + cols[:, None] * vn + dims[None, :] * vd,
            mask=inside[:, None], other=0.0,
        ).to(tl.float32)  # fmt: skip
        acc = acc * keep[:, None] + tl.dot(p, v, input_precision=PV_PRECISION)
        best = new_best
    # Rounded to nearest on the bits first: the interpreter's float32 cast truncates.
    out = _round(acc / total[:, None], CODE)
    tl.store(
        OUT + b * ob + node[:, None] * on + head[:, None] * oh + dims[None, :] * od,
        out.to(OUT.dtype.element_ty), mask=live[:, None],
    )  # fmt: skip
