"""The lse's gradient through one block: in the kernel's own backward where it can take it
(:class:`~ringdilated.core.contract.kernel.LseGradientKernel`), else from a second backward call.

When the caller differentiates through the lse, every block owes the gradient of
``sum(dout * out) + sum(dlse * lse)``. :func:`backward_with_lse` is the one place the driver (the
single-process run's blocks, a sharded run's crossing pieces) and the kernel wrappers get it::

    backward_with_lse(kernel, dout, dlse, q, k, v, out, lse, options)
        kernel.backward_with_lse(...)                   one call, where the kernel has it
        else backward_plus_lse_gradient(kernel, ...)    kernel.backward, then lse_gradient:
                                                        a second kernel.backward (any kernel)
"""

from __future__ import annotations

import attrs
import torch

from ringdilated.core.contract.kernel import BlockOptions, Kernel

__all__ = ["backward_plus_lse_gradient", "backward_with_lse", "lse_gradient"]

Gradients = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def lse_gradient(
    kernel: Kernel,
    options: BlockOptions,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dq, dk)`` of ``sum(dlse * lse)`` through one block, from the kernel's own backward.

    ``d lse_i / d s_ij = P_ij``. A kernel backward computes ``dS = P * (dout . v_j - D_i)`` with
    ``D_i = rowsum(dout * out)``; passing ``v_j = e_0``, ``dout_i = dlse_i e_0`` and ``out = 0``
    makes that ``P_ij * dlse_i``, so any kernel that meets the contract gives it exactly. The lse
    does not depend on dropout, so the call runs without it. ``dlse`` is ``(N, H, Lq)``.

    ``dlse`` enters the kernel as a ``dout`` in ``q``'s dtype. For float16, whose range ends at
    65504 (a loss scaler's 65536 times an lse term of 1 overflows it), ``dlse`` is first scaled
    by a power of two that brings its largest magnitude into ``[1, 2)``, and the results are
    scaled back in float32: exact, and decided on the device. The results are float32 then, else
    the kernel's.
    """
    if not (q.shape[-1] and v.shape[-1]):  # no head dim to carry dlse: nothing flows
        return torch.zeros_like(q), torch.zeros_like(k)
    e0 = torch.zeros_like(v, memory_format=torch.contiguous_format)
    e0.select(-1, 0).fill_(1)
    grad = torch.zeros_like(q, memory_format=torch.contiguous_format)
    scale = _power_of_two_scale(dlse) if q.dtype == torch.float16 else None
    grad.select(-1, 0).copy_(dlse if scale is None else dlse * scale)
    dq, dk, _ = kernel.backward(
        grad, q, k, e0, torch.zeros_like(grad), lse, attrs.evolve(options, dropout_p=0.0)
    )
    if scale is None:
        return dq, dk
    return dq.float().div_(scale), dk.float().div_(scale)


def _power_of_two_scale(x: torch.Tensor) -> torch.Tensor:
    """A float32 0-d tensor ``2^-e`` with ``2^e <= amax(|x|) < 2^(e+1)`` (``1`` when ``x`` is
    empty, all zero or not finite), on ``x``'s device: no host read."""
    if not x.numel():
        return torch.ones((), dtype=torch.float32, device=x.device)
    largest = x.detach().abs().amax().float()
    usable = torch.isfinite(largest) & (largest > 0)
    exponent = torch.floor(torch.log2(torch.where(usable, largest, torch.ones_like(largest))))
    return torch.exp2(-exponent)


def backward_plus_lse_gradient(
    kernel: Kernel,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: BlockOptions,
) -> Gradients:
    """``(dq, dk, dv)`` of ``sum(dout * out) + sum(dlse * lse)`` from two calls of any kernel's
    ``backward`` (the second is :func:`lse_gradient`), in the inputs' dtypes as the contract's
    results are: ``dq`` and ``dk`` are the two calls' sums in ``lse``'s dtype (float32, float64
    for float64 inputs), rounded once to ``q``'s and ``k``'s; ``dv`` (the lse does not depend on
    ``v``) is the first call's."""
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, options)
    dq_l, dk_l = lse_gradient(kernel, options, dlse, q, k, v, lse)
    # One new tensor each (copy=True: a kernel's own result is never written into).
    dq_sum, dk_sum = (g.to(lse.dtype, copy=True) for g in (dq, dk))
    return dq_sum.add_(dq_l).to(q.dtype), dk_sum.add_(dk_l).to(k.dtype), dv


def backward_with_lse(
    kernel: Kernel,
    dout: torch.Tensor,
    dlse: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    options: BlockOptions,
) -> Gradients:
    """``(dq, dk, dv)`` of ``sum(dout * out) + sum(dlse * lse)`` through one block: the kernel's
    own :meth:`~ringdilated.core.contract.kernel.LseGradientKernel.backward_with_lse` (one call;
    results in the inputs' dtypes) where it has one, else :func:`backward_plus_lse_gradient`
    (two calls). ``dlse``: ``(N, Hq, Lq)``, laid out like ``lse``."""
    native = getattr(kernel, "backward_with_lse", None)  # LseGradientKernel, without its cost
    if native is not None:
        return native(dout, dlse, q, k, v, out, lse, options)  # type: ignore[no-any-return]
    return backward_plus_lse_gradient(kernel, dout, dlse, q, k, v, out, lse, options)
