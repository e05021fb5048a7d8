"""The training objective: next-token cross-entropy, PaLM's z-loss, and multi-token prediction's terms.

`linear_cross_entropy` is what a training step differentiates: the output projection and the
cross-entropy in one autograd function, run over chunks of rows. For each chunk it computes the
logits, their log-softmax, and at once the gradient of the mean loss with respect to the
chunk's logits, (softmax - one-hot) / N, which it multiplies into the gradients of the hidden
states and of the projection; backward only scales those by the incoming gradient. The
[tokens, vocabulary] logits and their log-softmax therefore never exist whole: a chunk of about
CHUNK_ELEMENTS logits is live at a time (it stays in cache between the matmul that makes it and
the two that consume it), and what is kept for backward is the gradient of the hidden states and
of the projection weight (Liger's fused linear cross-entropy; measured 0.79x the time of a
matmul followed by `F.cross_entropy` at nanoGPT's benchmark shape on CPU).

`objective` is the same loss from given logits: a pipeline's last stage, whose loss function
torch's schedule calls on the stage's output, uses it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_ELEMENTS = 2**21  # logits computed at once (8 MiB in fp32): rows per chunk = this // vocabulary


def chunk_rows(vocab_size: int) -> int:
    """Rows of a `linear_cross_entropy` chunk for a vocabulary of `vocab_size`."""
    return max(1, CHUNK_ELEMENTS // vocab_size)


class _LinearCrossEntropy(torch.autograd.Function):
    """(mean cross-entropy + z_loss * mean log(Z)^2, mean cross-entropy) of `hidden @ weight.T`
    against `targets`, gradients computed in forward (see the module docstring). Inputs share one
    dtype; log-softmax and the logits' gradient are fp32, the projection's gradient is summed over
    chunks in fp32."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
        n, rows = hidden.shape[0], chunk_rows(weight.shape[0])
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.empty_like(weight, dtype=torch.float32)
        ce = torch.zeros((), dtype=torch.float32, device=hidden.device)
        z = torch.zeros((), dtype=torch.float32, device=hidden.device)
        index = torch.arange(min(rows, n), device=hidden.device)
        for start in range(0, n, rows):
            h, t = hidden[start:start + rows], targets[start:start + rows]
            r = index[: h.shape[0]]
            logits = h @ weight.T
            log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
            if z_loss > 0:
                lse = logits[:, 0].float() - log_probs[:, 0]
                z += lse.square().sum()
            del logits  # before the next allocations: a chunk's logits and log-softmax are its peak
            ce -= log_probs[r, t].sum()
            probs = log_probs.exp_()
            if z_loss > 0:
                probs.mul_((1 + 2 * z_loss * lse)[:, None])
            probs[r, t] -= 1
            # the mean's 1 / n scales the two products' outputs (the first chunk's overwrites
            # grad_weight: beta 0), not the chunk: one pass over its logits fewer
            torch.mm(probs.to(weight.dtype), weight, out=grad_hidden[start:start + rows]).div_(n)
            grad_weight.addmm_(probs.T, h.float(), beta=1 if start else 0, alpha=1 / n)
            del log_probs, probs  # the next chunk's logits take their place, not their side
        ctx.grads = (grad_hidden, grad_weight.to(weight.dtype))
        ce /= n
        total = ce + z_loss * z / n if z_loss > 0 else ce.clone()
        ctx.mark_non_differentiable(ce)
        return total, ce

    @staticmethod
    def backward(ctx, grad_total: torch.Tensor, _grad_ce: torch.Tensor) -> tuple:
        grad_hidden, grad_weight = ctx.grads
        del ctx.grads
        return grad_hidden.mul_(grad_total), grad_weight.mul_(grad_total), None, None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         z_loss: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, what to differentiate) of the logits `hidden @ weight.T` ([..., d] and
    [V, d]) against `targets` [...], without materialising the logits. Under autocast the hidden
    states and the weight are cast to its dtype first, as a matmul would be."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    with torch.autocast(device, enabled=False):
        total, ce = _LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, targets.flatten(), z_loss)
    return ce, total


def objective(logits: torch.Tensor, targets: torch.Tensor, z_loss: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, what to differentiate) from logits: the reported loss is the cross-entropy
    alone; the z-loss term (PaLM) only shapes the gradients, pulling the softmax normaliser towards 1."""
    logits = logits.flatten(0, 1).float()
    loss = F.cross_entropy(logits, targets.flatten())
    if z_loss > 0:
        return loss, loss + z_loss * torch.logsumexp(logits, dim=-1).square().mean()
    return loss, loss
