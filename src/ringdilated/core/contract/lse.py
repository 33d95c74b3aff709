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

from ringdilated.core.contract.kernel import BlockOptions, Kernel, LseGradientKernel

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
    """
    e0 = torch.zeros_like(v, memory_format=torch.contiguous_format)
    e0.select(-1, 0).fill_(1)
    grad = torch.zeros_like(q, memory_format=torch.contiguous_format)
    grad.select(-1, 0).copy_(dlse)
    dq, dk, _ = kernel.backward(
        grad, q, k, e0, torch.zeros_like(grad), lse, attrs.evolve(options, dropout_p=0.0)
    )
    return dq, dk


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
    ``backward`` (the second is :func:`lse_gradient`). ``dq`` and ``dk`` are the two calls' sums
    in ``lse``'s dtype (float32, float64 for float64 inputs), so they are rounded once, where the
    caller stores them; ``dv`` (the lse does not depend on ``v``) is the first call's."""
    dq, dk, dv = kernel.backward(dout, q, k, v, out, lse, options)
    dq_l, dk_l = lse_gradient(kernel, options, dlse, q, k, v, lse)
    # One new tensor each (copy=True: a kernel's own result is never written into).
    dq_sum, dk_sum = (g.to(lse.dtype, copy=True) for g in (dq, dk))
    return dq_sum.add_(dq_l), dk_sum.add_(dk_l), dv


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
    if isinstance(kernel, LseGradientKernel):
        return kernel.backward_with_lse(dout, dlse, q, k, v, out, lse, options)
    return backward_plus_lse_gradient(kernel, dout, dlse, q, k, v, out, lse, options)
