"""RMSNorm with a hand-written backward for eager fp32 steps.

torch 2.13 has a fused RMSNorm forward on CPU but derives its backward op by op: about a dozen
passes over the activations, each a parallel region of its own, which a 2-thread CPU step pays
for in wake-ups as much as in work (issue 34). `RMSNorm` computes the same forward, bit for bit,
and a backward of six passes: one product, one column sum, one matrix-vector product, one scale,
one fused multiply-add and an in-place scale. It keeps exactly what torch's own RMSNorm keeps for
backward (the input, the normalised input and 1/rms), so `plan_memory`'s activation count holds
unchanged.

Only plain fp32 tensors on an eager step take this path (a block's input under tensor parallelism
is one: the all-reduce's result). bf16 inputs (FSDP2's mixed precision), DTensors (tensor
parallelism's QK-norms, which `make_norm` therefore gives torch's backward everywhere) and compiled
graphs, where inductor fuses the norm itself, go through `nn.RMSNorm` as before.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed._functional_collectives import AsyncCollectiveTensor

# a block's input under tensor parallelism is the all-reduce's pending result: its values are plain
# replicated activations, so it takes the same path as one process's
_PLAIN_INPUTS = (torch.Tensor, AsyncCollectiveTensor)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # type: ignore[override]
        inv_rms = torch.rsqrt(x.pow(2).mean(-1, keepdim=True).add_(eps))
        normalised = x * inv_rms
        ctx.save_for_backward(x, normalised, inv_rms, weight)
        return normalised * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        _, normalised, inv_rms, weight = ctx.saved_tensors
        grad_normalised_product = grad * normalised
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_normalised_product.reshape(-1, weight.shape[0]).sum(0)
        grad_input = None
        if ctx.needs_input_grad[0]:
            # d/dx of x * r * w, r = rms(x)^-1: r (g w - x̂ mean(g w x̂)), with x̂ = x r
            mean_projection = (grad_normalised_product @ weight).unsqueeze(-1).div_(weight.shape[0])
            grad_input = torch.addcmul(grad * weight, normalised, mean_projection, value=-1).mul_(inv_rms)
        return grad_input, grad_weight, None


class RMSNorm(nn.RMSNorm):
    """`nn.RMSNorm` (same parameters, state dict and forward values) whose eager fp32 backward
    takes six passes where torch's takes about twelve (module docstring)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (weight is None or self.eps is None or len(self.normalized_shape) != 1 or torch.compiler.is_compiling()
                or type(x) not in _PLAIN_INPUTS or type(weight) not in (nn.Parameter, torch.Tensor)
                or x.dtype != torch.float32 or weight.dtype != torch.float32):
            return super().forward(x)
        return _RMSNormFunction.apply(x, weight, self.eps)
