"""Model shape, parameter count, FLOPs formula, config validation and save/load round trip; every
architecture and objective option: causal, counted, and computing a known value."""

from __future__ import annotations

import math
import re

import pydantic
import pytest
import torch
import torch.nn.functional as F

from kiln.tasks.train.config import ModelConfig, OptimConfig, RopeScaling, TrainRunConfig
from kiln.tasks.train.loss import chunk_rows, linear_cross_entropy, objective
from kiln.tasks.train.model import (
    AttentionPattern,
    Transformer,
    _apply_rope,
    alibi_slopes,
    attention_mask,
    block_parameters,
    build_model,
    count_parameters,
    flops_per_token,
    load_model,
    rope_frequencies,
    rope_tables,
    save_model,
)

V = 97


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(d_model=64, n_layers=2, n_heads=4),
        ModelConfig(d_model=96, n_layers=3, n_heads=3, tie_embeddings=False, qk_norm=True),
        ModelConfig(d_model=48, n_layers=1, n_heads=2, ffn_multiplier=4.0),
        ModelConfig(d_model=96, n_layers=2, n_heads=6, n_kv_heads=2, tie_embeddings=False),
    ],
)
def test_count_parameters_matches_module(cfg: ModelConfig) -> None:
    model = build_model(cfg, V)
    assert count_parameters(cfg, V) == sum(p.numel() for p in model.parameters())


def test_count_parameters_exact_numbers() -> None:
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4)
    # ffn hidden: 8/3 * 64 = 170.67 -> 192; per layer 4*64^2 + 3*64*192 + 2*64 = 53376
    assert cfg.ffn_hidden == 192
    assert count_parameters(cfg, V) == V * 64 + 2 * 53376 + 64
    # untying adds a second V x d matrix
    untied = cfg.model_copy(update={"tie_embeddings": False})
    assert count_parameters(untied, V) - count_parameters(cfg, V) == V * 64


def test_ffn_hidden_rounding_ignores_float_noise() -> None:
    assert ModelConfig(d_model=96, n_heads=4).ffn_hidden == 256  # 8/3 * 96 is 255.999... in floats
    assert ModelConfig(d_model=128, n_heads=4).ffn_hidden == 352


def test_flops_per_token() -> None:
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4)
    n = count_parameters(cfg, V)
    assert flops_per_token(cfg, V, 32) == 6 * n + 12 * 2 * 64 * 32
    untied = cfg.model_copy(update={"tie_embeddings": False})
    # the untied input embedding is a lookup, so it adds no FLOPs
    assert flops_per_token(untied, V, 32) == flops_per_token(cfg, V, 32)


def test_forward_shape_and_causality() -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=16)
    torch.manual_seed(0)
    model = build_model(cfg, V).eval()
    idx = torch.randint(0, V, (2, 10))
    logits = model(idx)
    assert logits.shape == (2, 10, V)
    changed = idx.clone()
    changed[:, 7] = (changed[:, 7] + 1) % V
    # positions before the change cannot see it, not even in a last bit: the same shapes take the same kernels,
    # and a later position's scores are masked to exact zeros (exact on any CPU)
    torch.testing.assert_close(model(changed)[:, :7], logits[:, :7], rtol=0, atol=0)
    assert not torch.equal(model(changed)[:, 7:], logits[:, 7:])
    with pytest.raises(ValueError, match="max_seq_len=16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_residual_projections_use_scaled_init() -> None:
    cfg = ModelConfig(d_model=256, n_layers=8, n_heads=4)
    torch.manual_seed(0)
    model = build_model(cfg, V)
    assert model.blocks[0].attn.wq.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert model.blocks[0].attn.proj.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.blocks[0].mlp.down.weight.std().item() == pytest.approx(0.02 / 4, rel=0.02)
    assert model.lm_head.weight is model.tok_emb.weight


def test_config_validation_messages() -> None:
    with pytest.raises(pydantic.ValidationError, match="not divisible by model.n_heads=3"):
        ModelConfig(d_model=64, n_heads=3)
    with pytest.raises(pydantic.ValidationError, match="head size"):
        ModelConfig(d_model=36, n_heads=4)
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ModelConfig(vocab_size=10)
    with pytest.raises(ValueError, match="seq_len=512 exceeds model.max_seq_len=256"):
        TrainRunConfig(seq_len=512).check_fits(ModelConfig())


def test_grouped_query_attention_is_multi_head_attention_with_shared_kv_heads() -> None:
    """A model with 8 query heads and 2 K/V heads computes what the 8-head model computes when
    each of its K/V heads is the GQA model's head of that query head's group (4 query heads each)."""
    gqa_cfg = ModelConfig(d_model=64, n_layers=2, n_heads=8, n_kv_heads=2, max_seq_len=32)
    mha_cfg = gqa_cfg.model_copy(update={"n_kv_heads": None})
    gqa = build_model(gqa_cfg, V, seed=0).eval()
    state = dict(gqa.state_dict())
    for name, weight in gqa.state_dict().items():
        if name.endswith(("attn.wk.weight", "attn.wv.weight")):  # [2 heads x 8 dims, d] -> [8 heads x 8 dims, d]
            state[name] = weight.unflatten(0, (2, 8)).repeat_interleave(4, dim=0).flatten(0, 1)
    mha = build_model(mha_cfg, V, seed=1).eval()
    mha.load_state_dict(state)
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(gqa(idx), mha(idx), rtol=0, atol=1e-6)
    assert count_parameters(mha_cfg, V) - count_parameters(gqa_cfg, V) == 2 * 2 * 64 * (64 - 16)
    with pytest.raises(pydantic.ValidationError, match="model.n_kv_heads=3 does not divide model.n_heads=8"):
        ModelConfig(d_model=64, n_heads=8, n_kv_heads=3)


def test_n_kv_heads_equal_to_n_heads_is_the_model_without_it() -> None:
    """Keys (and checkpoints' identity) of models written before grouped-query attention existed stay valid."""
    plain = ModelConfig(d_model=64, n_heads=4)
    assert "n_kv_heads" not in plain.identity()
    assert plain.model_copy(update={"n_kv_heads": 4}).identity() == plain.identity()
    assert ModelConfig(d_model=64, n_heads=4, n_kv_heads=2).identity()["n_kv_heads"] == 2


def test_initialisation_is_a_function_of_seed_and_parameter_name() -> None:
    """What lets every rank fill just its shard: the same seed gives the same weights, whatever
    else is built, and each parameter has its own stream."""
    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, tie_embeddings=False)
    a, b = build_model(cfg, V, seed=3), build_model(cfg.model_copy(update={"n_layers": 3}), V, seed=3)
    # bit for bit by design: one generator per (seed, name) drawing the same shape
    assert torch.equal(a.blocks[1].attn.wq.weight, b.blocks[1].attn.wq.weight)  # a deeper model, same blocks
    assert not torch.equal(a.blocks[0].attn.wq.weight, a.blocks[1].attn.wq.weight)
    assert not torch.equal(a.blocks[0].attn.wq.weight, build_model(cfg, V, seed=4).blocks[0].attn.wq.weight)


def test_runtime_fields_are_not_identity() -> None:
    ident = TrainRunConfig(device="cuda", num_threads=4, log_every=1).identity()
    assert ident == TrainRunConfig().identity()
    assert "device" not in ident and "steps" in ident


def test_save_load_round_trip(tmp_path) -> None:
    cfg = ModelConfig(d_model=32, n_layers=2, n_heads=2, qk_norm=True, tie_embeddings=False)
    torch.manual_seed(1)
    model = build_model(cfg, V).eval()
    save_model(model, cfg, V, tmp_path / "m")
    loaded, loaded_cfg = load_model(tmp_path / "m")
    assert loaded_cfg == cfg and loaded.cfg == cfg and loaded.vocab_size == V
    assert not loaded.training
    idx = torch.randint(0, V, (2, 12))
    with torch.no_grad():  # the saved bytes, the same input and kernels in one process: bit-identical
        assert torch.equal(loaded(idx), model(idx))


def test_model_copy_updates_are_revalidated() -> None:
    # sweeps vary widths with model_copy(update=...), which pydantic does not validate
    bad = ModelConfig(d_model=64, n_heads=4).model_copy(update={"n_heads": 5})
    with pytest.raises(pydantic.ValidationError, match="not divisible by model.n_heads=5"):
        build_model(bad, V)


# ---- architecture and objective options ------------------------------------------------------

OPTION_CASES = {
    "alibi": {"position": "alibi"},
    "alibi-6-heads-gqa": {"position": "alibi", "n_heads": 8, "n_kv_heads": 2},
    "nope": {"position": "nope"},
    "learned": {"position": "learned"},
    "rope-linear": {"rope_scaling": RopeScaling(kind="linear", factor=4.0, original_max_seq_len=8)},
    "rope-ntk": {"rope_scaling": RopeScaling(kind="ntk", factor=4.0, original_max_seq_len=8)},
    "rope-yarn": {"rope_scaling": RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=8)},
    "layernorm": {"norm": "layernorm"},
    "post": {"norm_placement": "post"},
    "reordered-qk-projection": {"norm_placement": "reordered", "qk_norm": True, "qk_norm_scope": "projection"},
    "layernorm-qk-head": {"norm": "layernorm", "qk_norm": True},
    "sliding": {"sliding_window": 4},
    "local-global": {"sliding_window": 4, "global_every": 2},
    "gelu": {"mlp": "gelu"},
    "mtp": {"mtp_heads": 2},
}


def option_model(update: dict, seed: int = 0, **base) -> tuple[ModelConfig, Transformer]:
    cfg = ModelConfig.model_validate({"d_model": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 32} | base | update)
    return cfg, build_model(cfg, V, seed=seed).eval()


@pytest.mark.parametrize("update", OPTION_CASES.values(), ids=OPTION_CASES.keys())
def test_every_option_is_causal_and_counted(update: dict) -> None:
    """A changed token changes no logit before it (and some after); the parameters are what
    `count_parameters` says; the training loss is finite and differentiable."""
    cfg, model = option_model(update)
    assert count_parameters(cfg, V) == sum(p.numel() for p in model.parameters())
    idx = torch.randint(0, V, (2, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[:, 9] = (changed[:, 9] + 1) % V
    with torch.no_grad():
        before, after = model(idx), model(changed)
    assert torch.equal(before[:, :9], after[:, :9])
    assert not torch.equal(before[:, 9:], after[:, 9:])
    ce, total = model(idx[:, :-1], targets=idx[:, 1:], mtp_weight=0.5)
    total.backward()
    assert all(p.grad is not None and p.grad.isfinite().all() for p in model.parameters())


def test_a_sliding_window_sees_window_tokens_and_a_global_layer_sees_all() -> None:
    """One local layer of window 4: position 12's logits depend on tokens 9..12 and on no earlier
    one; with a window reaching back to 0, or a global second layer, on every earlier token."""
    idx = torch.randint(0, V, (1, 16), generator=torch.Generator().manual_seed(1))
    for window, global_every, n_layers, sees_token_8 in ((4, None, 1, False), (13, None, 1, True), (4, 2, 2, True)):
        _, model = option_model({"sliding_window": window, "global_every": global_every}, n_layers=n_layers)
        changed_8, changed_9 = idx.clone(), idx.clone()
        changed_8[0, 8] = (idx[0, 8] + 1) % V
        changed_9[0, 9] = (idx[0, 9] + 1) % V
        with torch.no_grad():
            base = model(idx)[0, 12]
            assert torch.equal(model(changed_8)[0, 12], base) != sees_token_8
            assert not torch.equal(model(changed_9)[0, 12], base)
    cfg = ModelConfig(d_model=32, n_layers=6, n_heads=4, sliding_window=4, global_every=3)
    assert [cfg.window(i) for i in range(6)] == [4, 4, None, 4, 4, None]  # the 3rd and 6th layers are global


def test_attention_mask_known_values() -> None:
    window = attention_mask(AttentionPattern(window=2), 0, 4, 4, torch.device("cpu"), torch.float32)
    assert window.tolist() == [[True, False, False, False], [True, True, False, False],
                               [False, True, True, False], [False, False, True, True]]
    # ALiBi: -slope x distance, -inf above the diagonal; queries offset by 2 (a later chunk)
    bias = attention_mask(AttentionPattern(slopes=(0.5, 0.25)), 2, 2, 4, torch.device("cpu"), torch.float32)
    inf = float("-inf")
    assert bias.tolist() == [[[[-1.0, -0.5, 0.0, inf], [-1.5, -1.0, -0.5, 0.0]],
                              [[-0.5, -0.25, 0.0, inf], [-0.75, -0.5, -0.25, 0.0]]]]
    assert alibi_slopes(8) == tuple(2.0**-i for i in range(1, 9))
    # not a power of two: 8 heads' slopes, odd-numbered first (Press et al.; MPT; BLOOM)
    assert alibi_slopes(6) == (2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3)


def test_rope_scaling_known_frequencies() -> None:
    cfg = ModelConfig(d_model=64, n_heads=2, rope_theta=10000.0)  # head_dim 32: 16 pairs
    base, scale = rope_frequencies(cfg)
    assert scale == 1.0 and base[1].item() == pytest.approx(10000.0 ** (-2 / 32))
    linear, _ = rope_frequencies(cfg.model_copy(update={"rope_scaling": RopeScaling(kind="linear", factor=4.0,
                                                                                    original_max_seq_len=64)}))
    torch.testing.assert_close(linear, base / 4)
    ntk, _ = rope_frequencies(cfg.model_copy(update={"rope_scaling": RopeScaling(kind="ntk", factor=4.0,
                                                                                 original_max_seq_len=64)}))
    # the base becomes theta * 4^(32/30): the fastest pair keeps its frequency, the slowest is divided by ~4
    assert ntk[0].item() == 1.0 and ntk[-1].item() == pytest.approx(base[-1].item() / 4 ** (30 / 30), rel=1e-12)
    yarn_cfg = cfg.model_copy(update={"rope_scaling": RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=64)})
    yarn, mscale = rope_frequencies(yarn_cfg)
    assert mscale == pytest.approx(0.1 * math.log(4) + 1)
    # pairs turning more than 32 times over 64 positions keep their frequency; fewer than once: interpolated
    turns = 64 * base / (2 * math.pi)
    assert torch.equal(yarn[turns > 32], base[turns > 32])
    torch.testing.assert_close(yarn[turns < 1], base[turns < 1] / 4)
    cos, sin = rope_tables(yarn_cfg)
    assert cos[0, 0].item() == pytest.approx(mscale)  # cos and sin scaled by YaRN's attention factor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_bit_for_bit_the_half_width_rotation_forward_and_backward(dtype: torch.dtype) -> None:
    """`_apply_rope`'s full-width form (4 passes) gives exactly the numbers of the two halves
    rotated apart, values and gradients: the rewrite changes no run's loss."""
    cos, sin = rope_tables(ModelConfig(d_model=64, n_heads=2, max_seq_len=16))
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(2, 2, 16, 32, generator=generator).to(dtype).requires_grad_()
    grad = torch.randn(2, 2, 16, 32, generator=generator).to(dtype)
    x1, x2 = x.chunk(2, dim=-1)
    expected = torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)
    out = _apply_rope(x, cos, sin)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.equal(torch.autograd.grad(out, x, grad)[0], torch.autograd.grad(expected, x, grad)[0])


def test_no_positions_make_the_last_token_blind_to_the_order_before_it() -> None:
    """NoPE: causal attention alone orders tokens, so permuting the tokens before the last leaves a
    one-layer model's last logits unchanged; RoPE's do change."""
    idx = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(2))
    permuted = torch.cat((idx[:, :11].flip(1), idx[:, 11:]), dim=1)
    for position, invariant in (("nope", True), ("rope", False), ("learned", False), ("alibi", False)):
        _, model = option_model({"position": position}, n_layers=1)
        with torch.no_grad():
            same = torch.allclose(model(idx)[0, -1], model(permuted)[0, -1], rtol=0, atol=1e-5)
        assert same == invariant, position


def test_norm_placements_compute_what_they_say() -> None:
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(3))
    for placement in ("pre", "post", "reordered"):
        cfg, model = option_model({"norm_placement": placement, "norm": "layernorm"})
        block = model.blocks[0]
        cos, sin = model.rope_cos[:8], model.rope_sin[:8]
        with torch.no_grad():
            out = block(x, cos, sin)
            if placement == "pre":
                h = x + block.attn(block.attn_norm(x), cos, sin)
                expected = h + block.mlp(block.mlp_norm(h))
            elif placement == "post":
                h = block.attn_norm(x + block.attn(x, cos, sin))
                expected = block.mlp_norm(h + block.mlp(h))
                # LayerNorm last: every position leaves normalised (gains are ones at init)
                torch.testing.assert_close(out.mean(-1), torch.zeros(2, 8), rtol=0, atol=1e-5)
            else:
                h = x + block.attn_norm(block.attn(x, cos, sin))
                expected = h + block.mlp_norm(block.mlp(h))
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        assert (model.norm is None) == (placement == "post")


def test_gelu_mlp_holds_two_matrices() -> None:
    swiglu, gelu = ModelConfig(d_model=64, n_heads=4), ModelConfig(d_model=64, n_heads=4, mlp="gelu", ffn_multiplier=4)
    assert gelu.ffn_hidden == 256 and swiglu.ffn_hidden == 192
    assert count_parameters(gelu, V) == count_parameters(swiglu, V) - 4 * (3 * 64 * 192 - 2 * 64 * 256)
    model = build_model(gelu, V, seed=0)
    x = torch.randn(3, 64)
    mlp = model.blocks[0].mlp
    torch.testing.assert_close(mlp(x), mlp.down(torch.nn.functional.gelu(mlp.up(x))), rtol=0, atol=0)


def test_multi_token_prediction_leaves_the_next_token_path_unchanged() -> None:
    """The same trunk and head weights give the same logits with and without extra heads; the
    training loss adds mtp_weight times the mean of the extra heads' cross-entropies, head k
    scored on the token k + 2 ahead; the reported loss is the next-token one."""
    cfg, mtp = option_model({"mtp_heads": 2})
    plain = Transformer(cfg.model_copy(update={"mtp_heads": 0}), V)
    plain.load_state_dict({k: v for k, v in mtp.state_dict().items() if not k.startswith("mtp_")})
    idx = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(4))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        assert torch.equal(mtp(x), plain.eval()(x))
        ce, total = mtp(x, targets=y, mtp_weight=0.25)
        plain_ce, plain_total = plain(x, targets=y, mtp_weight=0.25)
        extra = [F.cross_entropy(logits[:, : 16 - k - 1].flatten(0, 1), y[:, k + 1:].flatten())
                 for k, logits in enumerate(mtp.mtp_logits(x))]
    assert ce.item() == pytest.approx(plain_ce.item(), rel=1e-6) and plain_total.item() == pytest.approx(ce.item())
    assert total.item() == pytest.approx(ce.item() + 0.25 * (extra[0] + extra[1]).item() / 2, rel=1e-5)
    assert count_parameters(cfg, V) - count_parameters(plain.cfg, V) == 2 * (block_parameters(cfg) + cfg.d_model)


@pytest.mark.parametrize("z_loss", [0.0, 1e-2])
def test_fused_linear_cross_entropy_is_the_unfused_loss_and_gradients(z_loss: float) -> None:
    """Chunk by chunk (several chunks here), with gradients computed in forward: the same loss and
    gradients as the logits followed by `objective`, in fp32 and under bf16 autocast."""
    gen = torch.Generator().manual_seed(5)
    hidden, weight = torch.randn(300, 16, generator=gen), torch.randn(40000, 16, generator=gen) * 0.3
    targets = torch.randint(0, 40000, (300,), generator=gen)
    assert 300 % chunk_rows(40000) and chunk_rows(40000) < 100  # several chunks and a short last one
    for autocast, rtol in ((False, 1e-5), (True, 2e-2)):
        results = []
        for fused in (True, False):
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                ce, total = linear_cross_entropy(h, w, targets, z_loss) if fused else \
                    objective((h @ w.T)[None], targets[None], z_loss)
            (2 * total).backward()
            results.append((ce.float(), total.float(), h.grad, w.grad))
        for fused, unfused in zip(*results):
            torch.testing.assert_close(fused, unfused.to(fused.dtype), rtol=rtol, atol=rtol * 1e-2)


@pytest.mark.parametrize("update,problem", [
    ({"rope_scaling": {"kind": "linear", "factor": 2.0, "original_max_seq_len": 8}, "position": "alibi"},
     "rope_scaling scales rotary positions, but model.position='alibi'"),
    ({"qk_norm_scope": "projection"}, "qk_norm_scope='projection' without model.qk_norm"),
    ({"global_every": 2}, "model.sliding_window is not set"),
    ({"sliding_window": 8, "global_every": 5}, "global_every=5 exceeds model.n_layers=4"),
    ({"rope_scaling": {"kind": "yarn", "factor": 1.0, "original_max_seq_len": 8}}, "greater than 1"),
])
def test_option_combinations_that_mean_nothing_are_refused(update: dict, problem: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=re.escape(problem)):
        ModelConfig(**update)


def test_options_at_their_defaults_stay_out_of_the_identity() -> None:
    """Keys and checkpoints of models written before the options existed stay valid: an option
    enters the identity only when it differs from its default."""
    before = {"d_model": 128, "n_layers": 4, "n_heads": 4, "ffn_multiplier": 8 / 3, "max_seq_len": 256,
              "rope_theta": 10000.0, "tie_embeddings": True, "qk_norm": False, "norm_eps": 1e-5}
    assert ModelConfig().identity() == before
    explicit = ModelConfig(position="rope", norm="rmsnorm", norm_placement="pre", mlp="swiglu", mtp_heads=0,
                           sliding_window=None, qk_norm_scope="head", rope_scaling=None)
    assert explicit.identity() == before
    assert ModelConfig(norm="layernorm").identity() == before | {"norm": "layernorm"}
    assert ModelConfig(mtp_heads=1).identity()["mtp_heads"] == 1
    assert "mtp_weight" not in OptimConfig().identity() and OptimConfig(mtp_weight=0.1).identity()["mtp_weight"] == 0.1
