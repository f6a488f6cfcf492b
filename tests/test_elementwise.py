"""The native element-wise kernels (RMS norm, rotary embedding, SiLU product) against
transformers' own code, and the switch that installs them on a model."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from conftest import make_tiny_target
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers.models.llama import modeling_llama

from dart_client import _native
from dart_client.models import elementwise
from dart_client.models.target import TargetModel


@contextlib.contextmanager
def one_call_layers(on: bool, calls: list[bool] | None = None) -> Iterator[None]:
    """The one-call layer on (each kernel call's outcome appended to ``calls``), or off: the
    layers' kernels called one by one, and no whole-model native forward."""
    run_plan, native_layer, native_forward = (
        elementwise._run_plan,
        elementwise._native_layer,
        elementwise.native_forward,
    )

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        out = run_plan(*args, **kwargs)
        assert calls is not None
        calls.append(out is not None)
        return out

    try:
        if not on:
            elementwise._native_layer = lambda *a, **k: None
            elementwise.native_forward = lambda *a, **k: None
        elif calls is not None:
            elementwise._run_plan = counted
        yield
    finally:
        elementwise._run_plan = run_plan
        elementwise._native_layer = native_layer
        elementwise.native_forward = native_forward


def bf16(*shape: int, scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in bf16 steps (same sign assumed where they differ by little)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 6),
    tokens=st.integers(1, 9),
    half=st.integers(1, 40),
    seed=st.integers(0, 2**16),
    shared_angles=st.booleans(),
)
def test_rotary_gives_transformers_bits(
    batch: int, heads: int, tokens: int, half: int, seed: int, shared_angles: bool
) -> None:
    dim = 2 * half
    # Laid out as transformers lays q out: (b, tokens, heads, dim) memory seen as (b, h, n, d).
    q = bf16(batch, tokens, heads, dim, scale=3, seed=seed).transpose(1, 2)
    k = bf16(batch, tokens, 1, dim, scale=3, seed=seed + 1).transpose(1, 2)
    angles = torch.rand(1 if shared_angles else batch, tokens, dim) * 100
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    want = modeling_llama.apply_rotary_pos_emb(q, k, cos, sin)
    got = (elementwise.rotary(q, cos, sin), elementwise.rotary(k, cos, sin))
    for w, g in zip(want, got, strict=True):
        assert g.shape == w.shape
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 12), dim=st.integers(1, 300), scale=st.sampled_from([0.01, 1.0, 30.0]))
def test_rms_norm_is_transformers_norm_within_a_bf16_step(
    rows: int, dim: int, scale: float
) -> None:
    norm = modeling_llama.LlamaRMSNorm(dim, eps=1e-6).to(torch.bfloat16)
    norm.weight.data = bf16(dim, seed=dim)
    x = bf16(1, rows, dim, scale=scale, seed=rows)
    want = norm(x)
    got = elementwise.rms_norm(x, norm.weight, 1e-6)
    # Only the mean's summation order differs: at most one bf16 step, and rarely.
    assert ulps_apart(got, want).max() <= 1
    assert (got != want).float().mean() < 0.05


def test_silu_mul_is_transformers_product_within_a_bf16_step() -> None:
    gate, up = bf16(37, 1536, scale=6, seed=1), bf16(37, 1536, scale=2, seed=2)
    want = nn.functional.silu(gate) * up
    got = elementwise.silu_mul(gate, up)
    assert ulps_apart(got, want).max() <= 1
    assert (got != want).float().mean() < 0.01
    # Saturation: large |gate| gives gate (or -0) times up, never inf or NaN.
    edge = torch.tensor([[-1e4, -100.0, 0.0, 100.0, 1e4]], dtype=torch.bfloat16)
    out = elementwise.silu_mul(edge, torch.ones_like(edge))
    assert torch.isfinite(out).all()
    assert torch.equal(out, (nn.functional.silu(edge) * 1).to(torch.bfloat16))


def test_the_kernels_refuse_arrays_that_do_not_fit() -> None:
    x, w = bf16(2, 8), bf16(6)
    out = torch.empty_like(x)
    bits = lambda t: t.view(torch.uint16).numpy()  # noqa: E731
    with pytest.raises(_native.KernelError, match="dim the weight's length"):
        _native.rms_norm(bits(x), bits(w), 1e-5, bits(out))
    with pytest.raises(_native.KernelError, match="even dim"):
        _native.rotary(bits(bf16(1, 2, 3)), bits(bf16(1, 3)), bits(bf16(1, 3)), bits(bf16(1, 2, 3)))
    with pytest.raises(_native.KernelError, match="up"):
        _native.silu_mul(bits(x), bits(bf16(3, 8)), bits(out))
    with pytest.raises(_native.KernelError, match="C-contiguous"):
        _native.silu_mul(bits(x), bits(x), bits(torch.empty(8, 2, dtype=torch.bfloat16)).T)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_switch_gives_the_same_logits_and_is_undone(arch: str) -> None:
    model = make_tiny_target(arch, dtype=torch.bfloat16, seed=3)
    ids = torch.tensor([[5, 9, 17, 5, 9, 40, 41, 7]])
    with torch.no_grad():
        plain = model(ids).logits
    modeling = sys.modules[type(model).__module__]
    # Another model of this process (a fixture's) may have switched the module's function.
    original_rotary = getattr(
        modeling.apply_rotary_pos_emb, "__wrapped__", modeling.apply_rotary_pos_emb
    )
    norms = sum(type(m).__name__.endswith("RMSNorm") for m in model.modules())
    mlps = sum(type(m).__name__.endswith("MLP") for m in model.modules())
    # Llama's decoder layers get the lean forward too; Qwen3's attention is other code.
    lean = len(model.model.layers) if arch == "llama" else 0
    switched = elementwise.use_native_elementwise(model)
    assert switched == norms + mlps + lean + 1  # norms (Qwen3's q/k too), MLPs, layers, rotary
    assert modeling.apply_rotary_pos_emb.__wrapped__ is original_rotary
    with torch.no_grad():
        native = model(ids).logits
    # The norms may round a mean differently: logits agree to bf16 noise, argmax everywhere.
    assert torch.allclose(native.float(), plain.float(), atol=0.1, rtol=0.05)
    assert torch.equal(native.argmax(-1), plain.argmax(-1))
    elementwise.restore(model)
    users = elementwise._rotary_users.get(modeling.__name__)
    if users is None:
        assert modeling.apply_rotary_pos_emb is original_rotary
    else:  # still switched for the other models using it
        assert id(model) not in users
    assert not any("forward" in m.__dict__ for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, plain)


def test_the_lean_layer_gives_the_layers_bits_and_steps_aside() -> None:
    """With DART's attention and a cache (a TargetModel's forward), the lean decoder layer
    computes what the layer's own forward computes on the same kernels, bit for bit; a hook
    on one of its parts sends it back to the plain forward (which runs the hook)."""
    target = TargetModel(make_tiny_target("llama", dtype=torch.bfloat16, seed=6))
    try:
        if target.replaced_attention is None:
            pytest.skip("the CPU decoding kernels are off on this machine")
        layers = target.model.model.layers
        assert all("forward" in layer.__dict__ for layer in layers)
        ids = torch.tensor([[5, 9, 17, 5, 9, 40, 41, 7, 8, 30]])

        def logits() -> torch.Tensor:
            cache = target.new_cache(32)
            target.forward(ids[:, :6], torch.arange(6)[None], cache, taps=False)
            tree = torch.tensor(
                [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool
            )
            out, _ = target.forward(ids[:, 6:], torch.arange(6, 10)[None], cache, tree_mask=tree)
            return out

        fallbacks = []
        for layer in layers:  # count the lean forward's calls of the plain one
            plain_forward = layer.__dict__[elementwise._PLAIN]
            layer.__dict__[elementwise._PLAIN] = lambda *a, _f=plain_forward, **k: (
                fallbacks.append(1),
                _f(*a, **k),
            )[1]
        lean = logits()
        assert not fallbacks  # every layer ran the lean forward
        plain_forwards = {id(layer): layer.__dict__.pop("forward") for layer in layers}
        plain = logits()  # the layers' own forward, on the same norms, MLPs and kernels
        for layer in layers:
            layer.forward = plain_forwards[id(layer)]
        assert torch.equal(lean.view(torch.int16), plain.view(torch.int16))
        seen = []
        handle = layers[0].self_attn.o_proj.register_forward_hook(lambda *a: seen.append(1))
        assert torch.equal(logits().view(torch.int16), lean.view(torch.int16))
        assert len(seen) == 2  # both forwards went through the plain layer 0 and its hook
        assert len(fallbacks) == 2  # layer 0 only, once per forward
        handle.remove()
    finally:
        target.close()
    assert not any("forward" in layer.__dict__ for layer in target.model.model.layers)


def test_other_dtypes_and_gradients_keep_transformers_code() -> None:
    model = make_tiny_target("llama", dtype=torch.float32, seed=4)
    ids = torch.tensor([[5, 9, 17, 5]])
    with torch.no_grad():
        plain = model(ids).logits
    elementwise.use_native_elementwise(model)
    try:
        with torch.no_grad():
            assert torch.equal(model(ids).logits, plain)  # fp32: transformers' code, same bits
        bf = make_tiny_target("llama", dtype=torch.bfloat16, seed=4).train()
        elementwise.use_native_elementwise(bf)
        bf(ids).logits.float().sum().backward()  # needs gradients: transformers' code
        assert all(p.grad is not None for p in bf.model.norm.parameters())
        elementwise.restore(bf)
    finally:
        elementwise.restore(model)


def test_a_norm_with_other_code_is_left_alone() -> None:
    class ShiftedRMSNorm(nn.Module):  # Gemma's kind: (1 + weight), not Llama's code
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8, dtype=torch.bfloat16))
            self.variance_epsilon = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            var = x.float().pow(2).mean(-1, keepdim=True)
            return (x.float() * torch.rsqrt(var + 1e-6) * (1 + self.weight.float())).to(x.dtype)

    holder = nn.Sequential(ShiftedRMSNorm())
    assert elementwise.use_native_elementwise(holder) == 0
    assert "forward" not in holder[0].__dict__


def test_a_bf16_target_on_the_cpu_switches_its_kernels() -> None:
    target = TargetModel(make_tiny_target("llama", dtype=torch.bfloat16, seed=5))
    try:
        if target.replaced_attention is None:
            pytest.skip("the CPU decoding kernels are off on this machine")
        assert target.native_elementwise > 0
        target.set_cpu_kernels(False)
        assert target.native_elementwise == 0
        assert not any("forward" in m.__dict__ for m in target.model.modules())
    finally:
        target.close()


def test_the_whole_layer_in_one_native_call_gives_the_kernels_bits_on_ragged_rows() -> None:
    """A batched verification (rows of different cached lengths, trees under a mask) through
    ``_native.decoder_layer`` gives the logits and cache of the same kernels called one by
    one from Python, bit for bit; prefill (buffers not yet allocated) and layers with biases
    take the one-by-one path."""
    from dart_client.decoding.verify import Tree, verify_trees

    target = TargetModel(make_tiny_target("llama", dtype=torch.bfloat16, seed=8))
    if target.replaced_attention is None:
        pytest.skip("the CPU decoding kernels are off on this machine")
    calls: list[bool] = []
    trees = [
        Tree.build([5, 9, 17], [-1, 0, 0]),
        Tree.build([40, 41, 7, 8], [-1, 0, 1, 1]),
        Tree.build([30], [-1]),
    ]

    def verify(native: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        with one_call_layers(native, calls):
            cache = target.new_cache(40, len(trees))
            for row, length in enumerate((7, 12, 3)):
                alone = target.new_cache(40)
                ids = torch.arange(length)[None] * 7 % 300 + row
                target.forward(ids, torch.arange(length)[None], alone, taps=False)
                cache.put_row(row, alone)
            logits, _ = verify_trees(target, cache, trees, taps=False)
            # Every written position (the buffers past them are uninitialised).
            return logits, [torch.cat([layer.keys, layer.values]) for layer in cache.layers]

    want, want_cache = verify(native=False)
    got, got_cache = verify(native=True)
    layers = len(target.model.model.layers)
    # Each prompt's prefill allocates its cache on the Python path; the tree step is native.
    assert calls.count(True) == layers and calls.count(False) == 3 * layers
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert all(torch.equal(a, b) for a, b in zip(got_cache, want_cache, strict=True))
    attn = target.model.model.layers[0].self_attn
    attn.o_proj.bias = nn.Parameter(torch.zeros(attn.o_proj.out_features, dtype=torch.bfloat16))
    calls.clear()
    verify(native=True)
    assert calls.count(True) == layers - 1  # layer 0 (a bias) ran its kernels one by one


def test_the_native_layer_refuses_weights_and_caches_that_do_not_fit() -> None:
    import numpy as np

    def packed(n: int, k: int) -> object:
        return _native.PackedMatrix(np.zeros((n, k), dtype=np.uint16))

    width, heads, kv, d, inner = 16, 2, 1, 4, 8
    u16 = np.uint16
    args = dict(
        hidden=np.zeros((1, 2, width), u16),
        input_norm=np.zeros(width, u16),
        post_attention_norm=np.zeros(width, u16),
        eps=1e-5,
        qkv=packed((heads + 2 * kv) * d, width),
        o=packed(width, heads * d),
        gate_up=packed(2 * inner, width),
        down=packed(width, inner),
        heads=heads,
        kv_heads=kv,
        scale=0.5,
        cos=np.zeros((1, 2, d), u16),
        sin=np.zeros((1, 2, d), u16),
        keys=np.zeros((1, kv, 8, d), u16),
        values=np.zeros((1, kv, 8, d), u16),
        start=3,
    )
    out = _native.decoder_layer(**args)
    assert out.shape == (1, 2, width)
    with pytest.raises(_native.KernelError, match="qkv has shape"):
        _native.decoder_layer(**{**args, "qkv": packed(5 * d, width)})
    with pytest.raises(_native.KernelError, match="cache has shape"):
        _native.decoder_layer(**{**args, "start": 7})
    with pytest.raises(_native.KernelError, match="cos/sin have shapes"):
        _native.decoder_layer(**{**args, "cos": np.zeros((1, 3, d), u16)})
    read_only = np.zeros((1, kv, 8, d), u16)
    read_only.flags.writeable = False
    with pytest.raises(_native.KernelError, match="keys cannot be written"):
        _native.decoder_layer(**{**args, "keys": read_only})
    # An input the caller normed (a draft head's): its rows must be the hidden rows, its
    # width q/k/v's inputs.
    prenormed = {**args, "input_norm": None}
    normed = _native.decoder_layer(**prenormed, normed=np.zeros((1, 2, width), u16))
    assert normed.shape == (1, 2, width)
    with pytest.raises(_native.KernelError, match="normed has shape"):
        _native.decoder_layer(**prenormed, normed=np.zeros((1, 3, width), u16))
    with pytest.raises(_native.KernelError, match="normed"):
        _native.decoder_layer(**prenormed, normed=np.zeros((1, 2, width + 1), u16))
    with pytest.raises(_native.KernelError, match="not both"):
        _native.decoder_layer(**args, normed=np.zeros((1, 2, width), u16))
    with pytest.raises(_native.KernelError, match="not both"):
        _native.decoder_layer(**prenormed)


def test_the_native_layer_follows_weight_updates_and_kernel_switches() -> None:
    """The one-call layer reuses what it hands the kernel per layer (``_LayerPlan``) only
    while the layer is as it was: a weight updated in place, a norm weight replaced, a
    weight's data assigned or another CPU matmul chosen is seen at the next forward."""
    from dart_client.decoding.verify import Tree, verify_trees
    from dart_client.models.linear import set_cpu_matmul

    target = TargetModel(make_tiny_target("llama", dtype=torch.bfloat16, seed=8))
    if target.replaced_attention is None:
        pytest.skip("the CPU decoding kernels are off on this machine")
    calls: list[bool] = []

    def verify(native: bool) -> torch.Tensor:
        with one_call_layers(native, calls):
            cache = target.new_cache(40, 1)
            alone = target.new_cache(40)
            ids = torch.arange(9)[None] * 7 % 300
            target.forward(ids, torch.arange(9)[None], alone, taps=False)
            cache.put_row(0, alone)
            return verify_trees(target, cache, [Tree.build([5, 9, 17], [-1, 0, 0])], taps=False)[0]

    before = verify(native=True)
    layer = target.model.model.layers[1]
    with torch.no_grad():
        layer.self_attn.q_proj.weight.mul_(1.5)
    norm = layer.post_attention_layernorm
    norm.weight = nn.Parameter(norm.weight.detach() * 0.5)
    up = target.model.model.layers[0].mlp.up_proj  # alone in its layer
    up.weight.data = up.weight.detach() * 0.75  # the same parameter, new storage
    calls.clear()
    got, want = verify(native=True), verify(native=False)
    layers = len(target.model.model.layers)
    assert calls.count(True) == layers  # the updated layer still runs in one call
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert not torch.equal(got.view(torch.int16), before.view(torch.int16))
    set_cpu_matmul("onednn")
    try:
        calls.clear()
        got, want = verify(native=True), verify(native=False)
        # DART's matmul is off: the layers step aside (a stale plan would use it).
        assert not any(calls)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    finally:
        set_cpu_matmul("auto")


def test_the_native_forward_gives_the_models_logits_taps_and_cache() -> None:
    """``native_forward`` (the decoder layers looped without transformers' plumbing) gives
    the logits, the tapped states and the cache of the model's own forward with the same
    one-call layers, bit for bit, for a lone sequence and a batch; a hook it does not own
    sends the forward back to the model (and the hook runs)."""
    from dart_client.decoding.verify import Tree, verify_tree, verify_trees

    target = TargetModel(make_tiny_target("llama", dtype=torch.bfloat16, seed=3))
    if target.replaced_attention is None:
        pytest.skip("the CPU decoding kernels are off on this machine")
    native_forward = elementwise.native_forward
    ran: list[bool] = []

    def recorded(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        out = native_forward(*args, **kwargs)
        ran.append(out is not None)
        return out

    tree = Tree.build([5, 9, 17, 4], [-1, 0, 0, 1])

    def steps(stack: bool) -> list[torch.Tensor]:
        elementwise.native_forward = recorded if stack else lambda *a, **k: None
        try:
            outs = []
            lone = target.new_cache(60)
            ids = torch.arange(11)[None] * 5 % 300
            target.forward(ids, torch.arange(11)[None], lone)
            batch = target.new_cache(60, 2)
            batch.put_row(0, lone)
            batch.put_row(1, lone)
            for _ in range(3):
                start = lone.length
                logits, taps = verify_tree(target, lone, tree)
                lone.keep(start, [0, 1, 3], torch.device("cpu"))
                frontier = batch.length
                blogits, btaps = verify_trees(target, batch, [tree, Tree.build([8], [-1])])
                assert btaps is not None
                batch.keep_rows(frontier, [[0, 2], [0]], torch.device("cpu"))
                outs += [logits, taps, blogits, btaps]
            outs += [torch.cat([layer.keys, layer.values]) for layer in lone.layers]
            outs += [torch.cat([layer.keys, layer.values]) for layer in batch.layers]
            return outs
        finally:
            elementwise.native_forward = native_forward

    want = steps(stack=False)
    got = steps(stack=True)
    assert ran.count(True) == 6  # every step after the prefill
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    seen: list[int] = []
    handle = target.layers[1].register_forward_hook(lambda *a: seen.append(1))
    try:
        ran.clear()
        steps(stack=True)
        assert not any(ran) and seen  # the model's own forward, which runs the hook
    finally:
        handle.remove()
