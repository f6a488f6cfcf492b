"""The Triton element-wise kernels for cuda (``dart_client.models.gpu_kernels``), run here
under Triton's CPU interpreter: bf16 results equal transformers' bit for bit (norm, SiLU
product, rotary embedding of strided heads with one or per-row tables), and a model switched
to them decodes as the plain one. ``DART_TEST_DEVICE=cuda`` runs the same on a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import TEST_DEVICE

from dart_client.errors import InvalidArgumentError

pytest.importorskip("triton")

CHECK = textwrap.dedent(
    """
    import os, sys
    import torch
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
    from dart_client.models import elementwise, gpu_kernels as gk
    from dart_client.models.target import TargetModel

    device = sys.argv[1]
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        exact = dtype == torch.bfloat16
        def same(want, got, what):
            if exact:
                assert torch.equal(want, got), (what, (want != got).sum().item())
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=what)
        x = torch.randn(3, 5, 576, device=device).to(dtype)
        norm = LlamaRMSNorm(576, eps=1e-5).to(device=device, dtype=dtype)
        norm.weight.data = torch.randn(576, device=device).to(dtype)
        with torch.no_grad():
            same(norm(x), gk.rms_norm(x, norm.weight, 1e-5), "norm")
        g, u = (torch.randn(4, 7, 1536, device=device).to(dtype) for _ in range(2))
        same(F.silu(g) * u, gk.silu_mul(g, u), "silu_mul")
        q = torch.randn(2, 5, 9, 64, device=device).to(dtype).transpose(1, 2)
        k = torch.randn(2, 5, 3, 64, device=device).to(dtype).transpose(1, 2)
        for rows in (1, 2):
            cos, sin = (torch.randn(rows, 5, 64, device=device).to(dtype) for _ in range(2))
            wq, wk = apply_rotary_pos_emb(q, k, cos, sin)
            same(wq, gk.rotary(q, cos, sin), "rotary q")
            same(wk, gk.rotary(k, cos, sin), "rotary k")

    config = LlamaConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=256)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    ids = torch.randint(3, 384, (2, 11), device=device)
    with torch.no_grad():
        want = model(ids).logits
    calls = []
    for name in ("rms_norm", "silu_mul", "rotary"):
        kernel = getattr(gk, name)
        def counted(*a, _k=kernel, _n=name, **kw):
            calls.append(_n)
            return _k(*a, **kw)
        setattr(gk, name, counted)
    # On the CPU (the interpreter), DART's own CPU kernels would take bf16 inputs first.
    elementwise._native_bf16 = lambda *tensors: False
    switched = elementwise.use_native_elementwise(model, gpu=True)
    with torch.no_grad():
        got = model(ids).logits
    assert switched >= 7 and torch.equal(want, got)
    assert {"rms_norm", "silu_mul", "rotary"} <= set(calls), set(calls)
    elementwise.restore(model)
    calls.clear()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, want)
    assert not calls
    # The tree attention kernel against exact attention (float64; strided K/V views of a
    # longer cache, per-row and shared masks, query heads grouped over K/V heads): float32
    # within 1e-5; bf16 as close as the exact result rounded once (float32 math inside,
    # rounded to nearest: a truncating store doubles the mean error).
    def reference(q, k, v, mask):
        g = q.shape[1] // k.shape[1]
        kk, vv = (t.repeat_interleave(g, 1).double() for t in (k, v))
        s = q.double() @ kk.transpose(-1, -2) * q.shape[-1] ** -0.5
        s = s + mask[..., : k.shape[2]].double()
        return (s.softmax(-1) @ vv).transpose(1, 2)
    for dtype in (torch.float32, torch.bfloat16):
        for b, h, kv, n, length, d in ((1, 9, 3, 1, 37, 64), (2, 9, 3, 5, 300, 64),
                                       (1, 4, 2, 64, 130, 16), (1, 32, 8, 3, 70, 128)):
            k = torch.randn(b, kv, length + 40, d, device=device).to(dtype)[:, :, :length]
            v = torch.randn(b, kv, length + 40, d, device=device).to(dtype)[:, :, :length]
            q = torch.randn(b, n, h, d, device=device).to(dtype).transpose(1, 2)
            mask = torch.zeros(b, 1, n, length + 40, device=device)
            mask.masked_fill_(torch.rand(mask.shape, device=device) < 0.3, torch.finfo(dtype).min)
            mask[..., 0] = 0
            mask = mask.to(dtype)
            exact = reference(q, k, v, mask)
            error = (gk.tree_attention(q, k, v, mask).double() - exact).abs()
            what = (dtype, b, h, n)
            if dtype == torch.float32:
                assert error.max() < 1e-5, what
            else:
                rounding = (exact.to(dtype).double() - exact).abs()
                assert error.mean() <= 1.1 * rounding.mean(), (what, error.mean(), rounding.mean())
    if device == "cuda":
        os.environ["DART_GPU_KERNELS"] = "triton"
        target = TargetModel(model)
        assert target.gpu_kernels > 0
        target.close()
        assert target.gpu_kernels == 0
        # DART_GPU_ATTENTION=triton: the static path's forward on the tree attention kernel.
        from dart_client.decoding.static import StaticVerifier
        from dart_client.decoding.verify import Tree
        tree = Tree.build([5, 6, 7, 8, 9], [-1, 0, 0, 1, 1])
        logits = {}
        for switch in ("torch", "triton"):
            os.environ["DART_GPU_ATTENTION"] = switch
            target = TargetModel(model)
            assert (target.replaced_attention is not None) == (switch == "triton")
            cache = target.new_cache(512)
            target.forward(ids[:1], torch.arange(11, device=device)[None], cache)
            logits[switch] = StaticVerifier(target, cache, 8, graphs=True).forward(tree)[0].float()
            target.close()
        assert (logits["torch"] - logits["triton"]).abs().max() < 0.25
    print("OK")
    """
)


def run_check(device: str, interpret: bool) -> None:
    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", CHECK, device],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("OK"), done.stderr[-3000:]


@pytest.mark.skipif(
    TEST_DEVICE == "cuda",
    reason="the GPU runs the kernels themselves (and the GPU machine's Triton interpreter "
    "fails on a loop over a runtime bound under its NumPy)",
)
def test_the_kernels_compute_transformers_values_in_the_interpreter() -> None:
    run_check("cpu", interpret=True)


@pytest.mark.skipif(TEST_DEVICE != "cuda", reason="a GPU: DART_TEST_DEVICE=cuda")
def test_the_kernels_compute_transformers_values_on_the_gpu() -> None:
    run_check("cuda", interpret=False)


def test_the_switch_is_asked_for_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from dart_client.models import gpu_kernels

    monkeypatch.delenv("DART_GPU_KERNELS", raising=False)
    assert gpu_kernels.requested()  # the default
    monkeypatch.setenv("DART_GPU_KERNELS", " Triton ")
    assert gpu_kernels.requested()
    for off in ("torch", "off"):
        monkeypatch.setenv("DART_GPU_KERNELS", off)
        assert not gpu_kernels.requested()
    monkeypatch.setenv("DART_GPU_KERNELS", "trition")
    with pytest.raises(InvalidArgumentError, match="DART_GPU_KERNELS = 'trition'"):
        gpu_kernels.requested()
    # The tree attention kernel: on by default from Ampere on (TF32 tensor cores), PyTorch's
    # SDPA when asked for (or on older GPUs unless asked for).
    monkeypatch.delenv("DART_GPU_ATTENTION", raising=False)
    assert gpu_kernels.attention_requested((9, 0)) and gpu_kernels.attention_requested((8, 0))
    assert not gpu_kernels.attention_requested((7, 5))
    monkeypatch.setenv("DART_GPU_ATTENTION", "Torch")
    assert not gpu_kernels.attention_requested((9, 0))
    monkeypatch.setenv("DART_GPU_ATTENTION", "triton")
    assert gpu_kernels.attention_requested((7, 5))
    monkeypatch.setenv("DART_GPU_ATTENTION", "flash")
    with pytest.raises(InvalidArgumentError, match="DART_GPU_ATTENTION = 'flash'"):
        gpu_kernels.attention_requested((9, 0))
