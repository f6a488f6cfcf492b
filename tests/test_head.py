"""The DART head: published checkpoint layout, strict loading, forward semantics."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import TEST_DEVICE, make_tiny_target
from safetensors.torch import save_file

from dart_client.errors import CheckpointError, IncompatibleHeadError
from dart_client.models.head import CHECKPOINT_KEYS, DartHead, DartHeadConfig
from dart_client.models.linear import cpu_packing_available, set_cpu_matmul

H = 64


@pytest.fixture(scope="module")
def target() -> Any:
    # On the CPU whatever DART_TEST_DEVICE says: these tests check the head's CPU math and
    # kernels against plain PyTorch (the backend test below runs on the test device itself).
    return make_tiny_target("qwen3", seed=1, device="cpu")


def published_checkpoint(directory: Path, target: Any, draft_vocab: int = 100) -> dict:
    """Write a checkpoint the way the published ``fvliang/qwen*-dart`` repos lay it out:
    a LlamaConfig-style config.json and a flat safetensors file with the reference's keys."""
    g = torch.Generator().manual_seed(5)
    hd, heads, kv, inter = 16, 4, 2, 128

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    vocab = target.config.vocab_size
    ids = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": rnd(H, 3 * H),
        "midlayer.mask_rep": rnd(2 * H),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": rnd(H, heads * hd),
        "midlayer.mlp.gate_proj.weight": rnd(inter, H),
        "midlayer.mlp.up_proj.weight": rnd(inter, H),
        "midlayer.mlp.down_proj.weight": rnd(H, inter),
        "midlayer.hidden_norm.weight": 1 + rnd(H),
        "midlayer.input_layernorm.weight": 1 + rnd(H),
        "midlayer.post_attention_layernorm.weight": 1 + rnd(H),
        "norm.weight": 1 + rnd(H),
        "lm_head.weight": rnd(draft_vocab, H),
        "d2t": ids - torch.arange(draft_vocab),
        "t2d": t2d,
    }
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": H,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": draft_vocab,
        "draft_length": 3,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 512,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(state, str(directory / "model.safetensors"))
    return state


def reference_forward(
    head: DartHead, embed: torch.nn.Module, taps: torch.Tensor, next_ids: torch.Tensor, m: int
) -> torch.Tensor:
    """The head written out as plain math over the whole sequence (no cache), per docs/design.md."""
    cfg = head.config
    layer = head.midlayer

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w * x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)

    r = taps.shape[1]
    fch = taps @ head.fc.weight.T
    real = torch.cat(
        [rms(embed(next_ids), layer.input_layernorm.weight), rms(fch, layer.hidden_norm.weight)],
        dim=-1,
    )
    x = torch.cat([real, layer.mask_rep.expand(1, m, -1)], dim=1)
    residual = torch.cat([fch, layer.mask_rep[:H].expand(1, m, -1)], dim=1)
    n = r + m
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    q = (x @ layer.self_attn.q_proj.weight.T).view(1, n, nh, hd).transpose(1, 2)
    k = (x @ layer.self_attn.k_proj.weight.T).view(1, n, nkv, hd).transpose(1, 2)
    v = (x @ layer.self_attn.v_proj.weight.T).view(1, n, nkv, hd).transpose(1, 2)
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)

    def rope(t: torch.Tensor) -> torch.Tensor:
        half = t.shape[-1] // 2
        rot = torch.cat([-t[..., half:], t[..., :half]], dim=-1)
        return t * cos + rot * sin

    q, k = rope(q), rope(k)
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(1, n, nh * hd)
    h = (residual + attn @ layer.self_attn.o_proj.weight.T)[:, -(m + 1) :]
    mlp = layer.mlp
    z = rms(h, layer.post_attention_layernorm.weight)
    h = (
        h
        + (F.silu(z @ mlp.gate_proj.weight.T) * (z @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    )
    h = rms(h, head.norm.weight)
    if cfg.double_final_norm:
        h = rms(h, head.norm.weight)
    return h @ head.lm_head.weight.T


def test_published_layout_loads_strictly(tmp_path: Path, target: Any) -> None:
    state = published_checkpoint(tmp_path / "head", target)
    head = DartHead.from_pretrained(tmp_path / "head")
    assert set(head.state_dict()) == set(CHECKPOINT_KEYS)
    for key, value in state.items():
        assert torch.equal(head.state_dict()[key].to(value.dtype), value), key
    assert head.config.draft_length == 3 and head.config.draft_vocab_size == 100
    assert head.config.double_final_norm  # the reference's inference behaviour by default
    head.check_compatible(target.config)
    ids = head.draft_to_target
    assert torch.equal(head.t2d.nonzero().flatten(), ids)


def test_embedding_key_is_tolerated(tmp_path: Path, target: Any) -> None:
    state = published_checkpoint(tmp_path / "h", target)
    state["embed_tokens.weight"] = torch.zeros(target.config.vocab_size, H)
    save_file(state, str(tmp_path / "h" / "model.safetensors"))
    head = DartHead.from_pretrained(tmp_path / "h")
    assert "embed_tokens.weight" not in head.state_dict()


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda s: s.pop("midlayer.mask_rep"), r"missing keys \['midlayer.mask_rep'\]"),
        (lambda s: s.update({"midlayer.extra": torch.zeros(1)}), "unexpected keys"),
        (
            lambda s: s.update({"fc.weight": torch.zeros(64, 100)}),
            r"fc.weight: shape \(64, 100\), expected \(64, 192\)",
        ),
        (lambda s: s.update({"lm_head.weight": torch.zeros(99, 64)}), "lm_head.weight: shape"),
        (lambda s: s.update({"d2t": torch.full((100,), 10_000)}), "outside the target vocabulary"),
        (lambda s: s.update({"d2t": torch.zeros(100)}), "integer tensor"),
        (lambda s: s.update({"d2t": -torch.arange(100)}), "same target id"),
    ],
)
def test_bad_checkpoints_name_the_problem(
    tmp_path: Path, target: Any, edit: Any, fragment: str
) -> None:
    state = published_checkpoint(tmp_path / "h", target)
    edit(state)
    save_file(state, str(tmp_path / "h" / "model.safetensors"))
    with pytest.raises(CheckpointError, match=fragment) as info:
        DartHead.from_pretrained(tmp_path / "h")
    assert "model.safetensors" in str(info.value)


def test_bad_config_and_missing_files(tmp_path: Path, target: Any) -> None:
    with pytest.raises(CheckpointError, match="no such head directory"):
        DartHead.from_pretrained(tmp_path / "nowhere")
    published_checkpoint(tmp_path / "h", target)
    (tmp_path / "h" / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        DartHead.from_pretrained(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(CheckpointError, match="missing required field"):
        DartHead.from_pretrained(tmp_path / "h")
    (tmp_path / "h" / "config.json").write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "intermediate_size": 8,
                "num_attention_heads": 3,
                "num_key_value_heads": 2,
                "vocab_size": 10,
            }
        )
    )
    with pytest.raises(CheckpointError, match="multiple of num_key_value_heads"):
        DartHead.from_pretrained(tmp_path / "h")
    (tmp_path / "h" / "model.safetensors").write_bytes(b"garbage")
    published = tmp_path / "h2"
    published_checkpoint(published, target)
    (published / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors"):
        DartHead.from_pretrained(published)


def test_save_pretrained_round_trip(tmp_path: Path, target: Any) -> None:
    head = DartHead.random_init(
        target.config,
        draft_length=5,
        draft_vocab=torch.arange(3, 200),
        double_final_norm=False,
        seed=4,
    )
    head.save_pretrained(tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "model.safetensors"]
    loaded = DartHead.from_pretrained(tmp_path / "out")
    saved = loaded.config.to_dict()
    assert saved.pop("torch_dtype") == "float32"
    assert saved == head.config.to_dict()
    assert not loaded.config.double_final_norm
    for key, value in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert loaded.draft_to_target.tolist() == list(range(3, 200))


@pytest.mark.parametrize("double", [True, False])
def test_forward_matches_plain_math_and_cache_is_incremental(
    tmp_path: Path, target: Any, double: bool
) -> None:
    published_checkpoint(tmp_path / "h", target)
    head = DartHead.from_pretrained(tmp_path / "h", double_final_norm=double).double()
    embed = target.get_input_embeddings()
    head.bind_embedding(embed)
    m = head.config.draft_length
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(1, 9, 3 * H, generator=g, dtype=torch.float64)
    nxt = torch.randint(0, target.config.vocab_size, (1, 9), generator=g)
    with torch.no_grad():
        want = reference_forward(head, embed, taps, nxt, m)
        full = head(taps, nxt, head.new_cache(32))
        # Incremental: the cache keeps real positions only, so feeding 4 + 3 + 2 positions
        # ends with the same rows as feeding all 9 at once.
        cache = head.new_cache(32)
        head(taps[:, :4], nxt[:, :4], cache)
        assert cache.length == 4
        head(taps[:, 4:7], nxt[:, 4:7], cache)
        last = head(taps[:, 7:], nxt[:, 7:], cache)
        assert cache.length == 9
    assert full.shape == (1, m + 1, head.config.draft_vocab_size)
    # transformers computes RoPE angles in float32, hence 1e-6 against the float64 math.
    torch.testing.assert_close(full, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(last, full, rtol=1e-10, atol=1e-10)


def test_double_final_norm_changes_the_logits(tmp_path: Path, target: Any) -> None:
    published_checkpoint(tmp_path / "h", target)
    outs = []
    for double in (True, False):
        head = DartHead.from_pretrained(tmp_path / "h", double_final_norm=double).double()
        head.bind_embedding(target.get_input_embeddings())
        taps = torch.ones(1, 2, 3 * H, dtype=torch.float64)
        with torch.no_grad():
            outs.append(head(taps, torch.tensor([[5, 6]]), head.new_cache(8)))
    assert not torch.allclose(outs[0], outs[1])


def test_compatibility_names_every_difference(target: Any) -> None:
    config = DartHeadConfig(
        hidden_size=32,
        intermediate_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=99,
        draft_vocab_size=10,
    )
    with pytest.raises(IncompatibleHeadError) as info:
        DartHead(config).check_compatible(target.config)
    text = str(info.value)
    for fragment in (
        "hidden_size: head 32, target 64",
        "head_dim: head 8, target 16",
        "vocab_size: head 99, target 384",
    ):
        assert fragment in text


def test_random_init_and_draft_vocab_checks(target: Any) -> None:
    head = DartHead.random_init(target.config, draft_vocab_size=50)
    assert head.lm_head.weight.shape == (50, H)
    assert head.draft_to_target.tolist() == list(range(50))
    assert int(head.t2d.sum()) == 50
    with pytest.raises(CheckpointError, match="distinct"):
        head.set_draft_vocab(torch.tensor([1] * 50))
    with pytest.raises(CheckpointError, match="lie in"):
        head.set_draft_vocab(torch.arange(50) + 1000)


# ---- the inference fast path: fused/packed weights, grouped attention, RoPE table ---------


def bf16_head(target: Any, tmp_path: Path) -> DartHead:
    published_checkpoint(tmp_path / "h", target)
    head = DartHead.from_pretrained(tmp_path / "h").to(torch.bfloat16).eval()
    head.bind_embedding(target.get_input_embeddings().to(torch.bfloat16))
    return head


@pytest.mark.filterwarnings("ignore:TF32 acceleration")
def test_packed_weights_give_the_plain_products(tmp_path: Path, target: Any) -> None:
    """The cached (fused, packed) weights compute what the separate layers compute."""
    g = torch.Generator().manual_seed(3)
    taps = torch.randn(1, 6, 3 * H, generator=g).to(torch.bfloat16)
    nxt = torch.randint(0, target.config.vocab_size, (1, 6), generator=g)
    with torch.no_grad():
        fast = bf16_head(target, tmp_path / "a")
        got = fast(taps, nxt, fast.new_cache(16))
        # Neither packed kernel: oneDNN switched off and DART's matmul not chosen.
        set_cpu_matmul("onednn")
        try:
            with torch.backends.mkldnn.flags(enabled=False):
                plain = bf16_head(target, tmp_path / "b")
                want = plain(taps, nxt, plain.new_cache(16))
        finally:
            set_cpu_matmul("auto")
    cached = {
        key: value
        for module in fast.modules()
        for key, (_, value) in module.__dict__.get("_derived_weights", {}).items()
    }
    linear = {names: v for (kind, names), v in cached.items() if kind.startswith("linear")}
    assert set(linear) == {("fc",), ("q_proj", "k_proj", "v_proj"), ("o_proj",),
                           ("gate_proj", "up_proj"), ("down_proj",), ("lm_head",)}  # fmt: skip
    # Where no packed bf16 kernel exists (no AVX-512 / AMX for DART's, no AVX-512 or
    # AVX-NE-CONVERT for oneDNN's), the plain product runs and nothing is cached as packed.
    packable = cpu_packing_available(torch.bfloat16)
    used = [p is not None for _, p in linear.values()]
    assert all(used) if packable else not any(used), f"packable={packable}, packed={used}"
    scale = want.float().abs().max()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.02 * float(scale))


def test_cached_weights_follow_in_place_updates_and_dtype_changes(
    tmp_path: Path, target: Any
) -> None:
    head = bf16_head(target, tmp_path)
    taps = torch.ones(1, 2, 3 * H, dtype=torch.bfloat16)
    nxt = torch.tensor([[5, 6]])
    with torch.no_grad():
        before = head(taps, nxt, head.new_cache(8))
        head.lm_head.weight.neg_()  # an optimizer-style in-place update
        flipped = head(taps, nxt, head.new_cache(8))
        head.midlayer.self_attn.k_proj.weight.mul_(3)  # one part of the fused q/k/v weight
        rekeyed = head(taps, nxt, head.new_cache(8))
        head.double()
        wide = head(taps.double(), nxt, head.new_cache(8))
    assert torch.equal(flipped, -before)
    assert not torch.equal(rekeyed, flipped)
    assert wide.dtype == torch.float64
    torch.testing.assert_close(wide.float(), rekeyed.float(), rtol=0.05, atol=0.05)


def test_autograd_reaches_every_fused_weight(tmp_path: Path, target: Any) -> None:
    published_checkpoint(tmp_path / "h", target)
    head = DartHead.from_pretrained(tmp_path / "h").double().train()
    head.bind_embedding(target.get_input_embeddings())
    taps = torch.randn(1, 3, 3 * H, dtype=torch.float64)
    head(taps, torch.tensor([[5, 6, 7]]), head.new_cache(8)).sum().backward()
    attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
    for layer in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj, head.fc):
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0
    for norm in (head.midlayer.input_layernorm, head.midlayer.hidden_norm):
        assert norm.weight.grad is not None and norm.weight.grad.abs().sum() > 0


def test_grouped_query_rows_equal_repeated_kv(tmp_path: Path, target: Any) -> None:
    """Attention with the query heads of a K/V group as extra rows (decoding) is the same
    as repeating K/V per query head."""
    from dart_client.models.head import causal_mask

    published_checkpoint(tmp_path / "h", target)
    head = DartHead.from_pretrained(tmp_path / "h").double()
    attn = head.midlayer.self_attn
    groups = attn.num_heads // attn.num_kv_heads
    assert groups > 1
    n, past = 5, 7
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, n, 2 * H, generator=g, dtype=torch.float64)
    prefix = torch.randn(1, past, 2 * H, generator=g, dtype=torch.float64)
    outs = []
    for rows in (1, groups):
        cache = head.new_cache(32)
        with torch.no_grad():
            attn(prefix, head.rope(0, past, x), cache, causal_mask(past, 0, x.dtype, x.device))
            mask = causal_mask(n, past, x.dtype, x.device, rows)
            assert mask.shape == (1, 1, rows * n, past + n)
            outs.append(attn(x, head.rope(past, n, x), cache, mask))
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-12, atol=1e-12)


def _sdpa_backends_here(device: str, dtype: torch.dtype) -> list[Any]:
    """The SDPA backends that run a small masked attention on ``device`` in ``dtype``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.zeros(1, 2, 4, 16, device=device, dtype=dtype)
    mask = torch.zeros(1, 1, 4, 4, device=device, dtype=dtype)
    found = []
    names = ("MATH", "FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
    for backend in (getattr(SDPBackend, name) for name in names if hasattr(SDPBackend, name)):
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        except RuntimeError:
            continue
        found.append(backend)
    return found


def test_grouped_query_rows_work_on_every_sdpa_backend(tmp_path: Path, target: Any) -> None:
    """The head's attention (query heads of a K/V group as extra rows) gives the same rows
    on every attention backend the test device has, in the dtypes it decodes in. Backends
    may return the output in (b, n, heads, d) memory order (CUDA's efficient and flash
    kernels do); the head must regroup it with a copy, not a view."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from dart_client.models.head import causal_mask

    device = TEST_DEVICE
    published_checkpoint(tmp_path / "h", target)
    dtypes = [torch.float32] + ([torch.bfloat16] if device == "cuda" else [])
    tried = 0
    for dtype in dtypes:
        head = DartHead.from_pretrained(tmp_path / "h").to(device=device, dtype=dtype)
        attn = head.midlayer.self_attn
        groups = attn.num_heads // attn.num_kv_heads
        n, past = 5, 7
        g = torch.Generator().manual_seed(2)
        x = torch.randn(1, n, 2 * H, generator=g).to(device=device, dtype=dtype)
        prefix = torch.randn(1, past, 2 * H, generator=g).to(device=device, dtype=dtype)
        outs = {}
        for backend in _sdpa_backends_here(device, dtype):
            cache = head.new_cache(32)
            with torch.no_grad(), sdpa_kernel([backend, SDPBackend.MATH]):
                attn(prefix, head.rope(0, past, x), cache, causal_mask(past, 0, dtype, device))
                mask = causal_mask(n, past, dtype, device, groups)
                outs[backend] = attn(x, head.rope(past, n, x), cache, mask).float()
        reference = outs.pop(SDPBackend.MATH)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        for backend, out in outs.items():
            torch.testing.assert_close(out, reference, rtol=tol, atol=tol, msg=str(backend))
            tried += 1
    if not tried:
        pytest.skip(f"only the math SDPA backend runs on {device}: nothing to compare")


def test_rope_table_rows_are_the_rotary_embedding(target: Any) -> None:
    head = DartHead.random_init(target.config)
    like = torch.zeros(1, dtype=torch.bfloat16)
    for start, n in ((0, 3), (250, 12), (600, 9), (5, 2)):  # grows past its first 256 rows
        cos, sin = head.rope(start, n, like)
        want = head.rotary(like, torch.arange(start, start + n).unsqueeze(0))
        assert torch.equal(cos, want[0]) and torch.equal(sin, want[1])


def test_the_native_head_layer_gives_a_batch_row_its_bits_alone(
    tmp_path: Path, target: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On DART's CPU kernels a draft step's layer is one native call: each query from its
    own keys, so a batched draft row has the bits of the same sequence drafted alone (over
    two steps, the second after rows kept different numbers of positions), and the draft's
    logits are PyTorch's layer's up to bf16 rounding."""
    import dart_client.models.head as head_module
    from dart_client.decoding.draft import draft_rows, draft_rows_batch
    from dart_client.models.native import SIMD_KERNELS

    if not (SIMD_KERNELS and cpu_packing_available(torch.bfloat16)):
        pytest.skip("DART's bf16 CPU kernels do not run here")
    head = bf16_head(target, tmp_path)
    native = head_module._native_head_layer
    used: list[bool] = []

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        out = native(*args, **kwargs)
        used.append(out is not None)
        return out

    monkeypatch.setattr(head_module, "_native_head_layer", counted)
    g = torch.Generator().manual_seed(5)
    lengths = (5, 9)
    taps = [torch.randn(n + 3, 3 * H, generator=g).to(torch.bfloat16) for n in lengths]
    ids = [torch.randint(0, target.config.vocab_size, (n + 3,), generator=g) for n in lengths]
    steps = [(0, 1), (1, 3)]  # positions (from, to) each step adds after the prompt

    def prefilled(b: int) -> Any:
        # In two chunks: the second runs natively (the cache is allocated by then).
        cache = head.new_cache(40)
        n = lengths[b]
        head(taps[b][None, :2], ids[b][None, 1:3], cache, num_masks=0)
        head(taps[b][None, 2 : n - 1], ids[b][None, 3:n], cache, num_masks=0)
        return cache

    with torch.no_grad():
        alone = []
        for b in range(2):
            cache = prefilled(b)
            rows = []
            for lo, hi in steps:
                n = lengths[b]
                rows.append(draft_rows(head, cache, taps[b][None, n - 1 + lo : n - 1 + hi],
                                       ids[b][None, n + lo : n + hi], 4))  # fmt: skip
            alone.append(rows)
        batch = head.new_cache(40, 2)
        for b in range(2):
            batch.put_row(b, prefilled(b))
        together = []
        for lo, hi in steps:
            together.append(draft_rows_batch(
                head, batch,
                [taps[b][lengths[b] - 1 + lo : lengths[b] - 1 + hi] for b in range(2)],
                [ids[b][lengths[b] + lo : lengths[b] + hi].tolist() for b in range(2)],
                4,
            ))  # fmt: skip
    # Every draft step, lone and batched, and each prompt's second chunk (twice: alone and
    # put in the batch).
    assert used.count(True) == 2 * len(steps) + len(steps) + 4
    for b in range(2):
        for step in range(len(steps)):
            assert (together[step][b].ids == alone[b][step].ids).all()
            assert (together[step][b].probs == alone[b][step].probs).all()
    # Against PyTorch's layer (the native call switched off), the same step alone.
    with torch.no_grad():
        monkeypatch.setattr(head_module, "_native_head_layer", lambda *a, **k: None)
        cache = prefilled(1)
        n = lengths[1]
        want = head(taps[1][None, n - 1 : n], ids[1][None, n : n + 1], cache)
        monkeypatch.setattr(head_module, "_native_head_layer", native)
        cache = prefilled(1)
        got = head(taps[1][None, n - 1 : n], ids[1][None, n : n + 1], cache)
    scale = float(want.float().abs().max())
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.03 * scale)
