"""Kiln's RMSNorm is torch's: the same forward bit for bit, the same gradients (against float64),
the same tensors kept for backward, and torch's own path wherever the hand-written one does not apply."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from kiln.tasks.train.config import ModelConfig
from kiln.tasks.train.model import build_model
from kiln.tasks.train.rms_norm import RMSNorm, _RMSNormFunction


def pair(dim: int, eps: float, seed: int, dtype: torch.dtype = torch.float32) -> tuple[nn.RMSNorm, RMSNorm]:
    torch.manual_seed(seed)
    ours, theirs = RMSNorm(dim, eps=eps, dtype=dtype), nn.RMSNorm(dim, eps=eps, dtype=dtype)
    with torch.no_grad():
        theirs.weight.normal_(1.0, 0.5)
        ours.weight.copy_(theirs.weight)
    return theirs, ours


def forward_backward(norm: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    x = x.detach().clone().requires_grad_()
    norm.zero_grad(set_to_none=True)
    out = norm(x)
    out.backward(grad)
    return out.detach(), x.grad, norm.weight.grad


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), dim=st.sampled_from([1, 3, 8, 64, 257]), scale=st.sampled_from([1e-3, 1.0, 1e3]),
       eps=st.sampled_from([1e-6, 1e-5, 0.1]), seed=st.integers(0, 2**16))
def test_forward_is_torchs_bit_for_bit_and_gradients_match_float64(rows, dim, scale, eps, seed) -> None:
    theirs, ours = pair(dim, eps, seed)
    x = torch.randn(2, rows, dim) * scale
    grad = torch.randn(2, rows, dim)
    out, dx, dw = forward_backward(ours, x, grad)
    torch_out, torch_dx, torch_dw = forward_backward(theirs, x, grad)
    assert torch.equal(out, torch_out)
    exact = nn.RMSNorm(dim, eps=eps, dtype=torch.float64)
    with torch.no_grad():
        exact.weight.copy_(theirs.weight)
    _, exact_dx, exact_dw = forward_backward(exact, x.double(), grad.double())
    # dx is a difference of terms of size |grad w| / rms, which cancel where dim is small: float32
    # rounds at the terms' scale, not the difference's
    rms = (x.double().pow(2).mean(-1) + eps).sqrt().min()
    dx_scale = (grad.double() * theirs.weight.double()).abs().max() / rms
    for got, torch_got, want, scale in ((dx, torch_dx, exact_dx, dx_scale), (dw, torch_dw, exact_dw, exact_dw.abs().max())):
        # as close to the float64 gradient as torch's own float32 one, up to its ordering of the sums
        bound = 2 * (torch_got.double() - want).abs().max() + 1e-6 * scale + 1e-30
        assert (got.double() - want).abs().max() <= bound


def saved_bytes(norm: nn.Module, x: torch.Tensor) -> int:
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() != x.untyped_storage().data_ptr():  # the input lives on anyway
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        norm(x)
    return sum(storages.values())


def test_keeps_what_torchs_rmsnorm_keeps_for_backward() -> None:
    """plan_memory prices torch's saved tensors: the normalised input (4d per row), 1/rms and the gain."""
    theirs, ours = pair(64, 1e-5, 0)
    x = torch.randn(4, 16, 64, requires_grad=True)
    assert saved_bytes(ours, x) == saved_bytes(theirs, x) == 4 * 16 * 64 * 4 + 4 * 16 * 4 + 64 * 4


def test_takes_torchs_path_where_its_own_does_not_apply(monkeypatch) -> None:
    calls = []
    original = _RMSNormFunction.apply
    monkeypatch.setattr(_RMSNormFunction, "apply", lambda *a: calls.append(a) or original(*a))
    _, ours = pair(8, 1e-5, 0)
    x = torch.randn(3, 8)
    ours(x)
    assert len(calls) == 1
    torch_bf16, bf16 = pair(8, 1e-5, 0, dtype=torch.bfloat16)
    assert torch.equal(bf16(x.bfloat16()), torch_bf16(x.bfloat16()))
    no_eps = RMSNorm(8)  # eps None: torch's machine epsilon of the input's dtype
    no_eps(x)
    assert len(calls) == 1


@pytest.mark.slow  # compiling: seconds with inductor's cache warm, ~20 s cold
def test_compiled_model_keeps_torchs_norm_and_matches_eager() -> None:
    cfg = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16)
    model = build_model(cfg, 64, seed=0)
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for run in (model, torch.compile(model)):
        model.zero_grad(set_to_none=True)
        try:
            _, loss = run(tokens, targets=tokens)
        except Exception as e:  # noqa: BLE001 - inductor needs a working C++ toolchain
            if "compiler" in str(e).lower() or "InductorError" in type(e).__name__:
                pytest.skip(f"torch.compile cannot build kernels here: {e}")
            raise
        loss.backward()
        grads.append((loss.detach(), [p.grad for p in model.parameters()]))
    torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_block_norms_are_kilns_and_qk_norms_torchs(qk_norm: bool) -> None:
    model = build_model(ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=16, qk_norm=qk_norm), 64)
    block = model.blocks[0]
    assert type(block.attn_norm) is RMSNorm and type(block.mlp_norm) is RMSNorm and type(model.norm) is RMSNorm
    if qk_norm:
        assert type(block.attn.q_norm) is nn.RMSNorm and type(block.attn.k_norm) is nn.RMSNorm
