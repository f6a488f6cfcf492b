"""How far the decoding attention kernels land from exact attention in bf16 on a GPU: the
Triton tree attention (DART_GPU_ATTENTION=triton) against PyTorch's memory-efficient SDPA
(the static path's default), both against a float64 reference, at SmolLM2-135M's head shape
(9 query heads over 3 K/V heads, head size 64) for one query and a 61-node tree over a
300-position window. Run on the GPU machine: python3 attention_error.py"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dart_client.models import gpu_kernels as gk


def reference(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, 1).double() for t in (k, v))
    s = q.double() @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5 + mask.double()
    return s.softmax(-1) @ vv  # (b, h, n, d)


def sdpa(q, k, v, mask):
    g = q.shape[1] // k.shape[1]
    kk, vv = (t.repeat_interleave(g, 1) for t in (k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        return F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask)


torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
print("| queries | kernel | max abs error | mean abs error | max error / output scale |")
print("|---:|---|---:|---:|---:|")
for n in (1, 61):
    errs = {"sdpa (mem-efficient)": [], "triton tree attention": []}
    scale = []
    for _ in range(20):
        length = 300
        # Real keys carry large per-channel offsets (attention sinks); scale like a trained layer.
        q = (torch.randn(1, 9, n, 64, device=dev) * 2).to(dt)
        offset = torch.randn(1, 3, 1, 64, device=dev) * 3
        k = (torch.randn(1, 3, length, 64, device=dev) * 2 + offset).to(dt)
        v = torch.randn(1, 3, length, 64, device=dev).to(dt)
        mask = torch.zeros(1, 1, n, length, device=dev)
        mask[..., length - n :] = torch.where(
            torch.rand(n, n, device=dev) < 0.2, 0.0, torch.finfo(dt).min
        ).tril()
        mask[..., length - n :].diagonal(dim1=-2, dim2=-1).zero_()
        mask = mask.to(dt)
        want = reference(q, k, v, mask)
        got_sdpa = sdpa(q, k, v, mask).double()
        got_tri = gk.tree_attention(q, k, v, mask).transpose(1, 2).double()
        errs["sdpa (mem-efficient)"].append((got_sdpa - want).abs())
        errs["triton tree attention"].append((got_tri - want).abs())
        scale.append(want.abs().max())
    for name, e in errs.items():
        e = torch.stack(e)
        print(f"| {n} | {name} | {e.max():.3e} | {e.mean():.3e} | {e.max() / max(scale):.3e} |")
