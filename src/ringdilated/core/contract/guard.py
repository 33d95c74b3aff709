"""The driver's check on every kernel call: results shaped as the contract says, inputs untouched.

A kernel is trusted to compute, not to be well behaved: a plugin that returns ``out[..., :1]``
would be broadcast into a silently wrong result, and one that writes into its inputs would change
the caller's own ``q`` and ``v`` (the driver passes views of them). :class:`CheckedKernel` wraps
the chosen kernel and, after every call, compares each result's shape and dtype with the
contract (the dtype exactly: ``out`` and the gradients in their input's dtype, ``lse`` in
float32, float64 for float64 inputs), each result's device with its input's, and each input's
version counter with its value before the call (both free next to the
attention itself), raising :class:`KernelContractError` naming the kernel. It catches nothing:
an exception the kernel raises passes through unchanged.

It always offers :meth:`CheckedKernel.backward_with_lse` (the optional method of
:class:`~ringdilated.core.contract.kernel.LseGradientKernel`): checked like ``backward`` (``dlse``
untouched too) where the kernel has the method, else two checked ``backward`` calls
(:func:`~ringdilated.core.contract.lse.backward_plus_lse_gradient`).
"""

from __future__ import annotations

import torch

from ringdilated.core.contract.accumulator import accumulation_dtype
from ringdilated.core.contract.kernel import BlockOptions, Kernel, LseGradientKernel
from ringdilated.core.contract.lse import backward_plus_lse_gradient
from ringdilated.core.support.errors import KernelContractError

__all__ = ["CheckedKernel", "KernelContractError"]


def _versions(tensors: tuple[torch.Tensor, ...]) -> tuple[int, ...]:
    try:
        return tuple([t._version for t in tensors])
    except RuntimeError:  # inference tensors keep no version counter: not checked (-1)
        return tuple(-1 if t.is_inference() else t._version for t in tensors)


class CheckedKernel:
    """``kernel`` (registered as ``name``) with its results and inputs checked on every call."""

    def __init__(self, kernel: Kernel, name: str) -> None:
        self.kernel, self.name = kernel, name
        # The kernel itself when it takes dlse (decided once: a protocol check costs microseconds).
        self._with_lse = kernel if isinstance(kernel, LseGradientKernel) else None

    def _fail(self, message: str) -> KernelContractError:
        return KernelContractError(self.name, message)

    def _untouched(
        self, before: tuple[int, ...], names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]
    ) -> None:
        after = _versions(tensors)
        if after != before:
            changed = [n for n, b, a in zip(names, before, after, strict=True) if a != b]
            raise self._fail(
                f"it modified its input(s) {', '.join(changed)} in place (inputs are views of "
                "the caller's tensors and must never be written)"
            )

    def _result(
        self, what: str, x: object, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor
    ) -> None:
        if not isinstance(x, torch.Tensor):
            raise self._fail(f"{what} is {type(x).__name__}, not a torch.Tensor")
        if x.shape != shape or x.dtype != dtype:
            raise self._fail(
                f"{what} is {tuple(x.shape)} {str(x.dtype).removeprefix('torch.')}, expected "
                f"{tuple(shape)} {str(dtype).removeprefix('torch.')}"
            )
        if x.device != like.device:
            raise self._fail(f"{what} is on {x.device}, expected {like.device} (its input's)")

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, options: BlockOptions
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = (q, k, v)
        before = _versions(inputs)
        result = self.kernel.forward(q, k, v, options)
        self._untouched(before, ("q", "k", "v"), inputs)
        if type(result) is not tuple or len(result) != 2:
            raise self._fail(f"forward returned {type(result).__name__}, not (out, lse)")
        out, lse = result
        rows = q.shape[:-1]
        # The checks inline; the messages, which name what differs, only on a failure.
        if not (
            type(out) is torch.Tensor
            and type(lse) is torch.Tensor
            and out.shape[:-1] == rows
            and out.shape[-1] == v.shape[-1]
            and lse.shape == rows
            and out.dtype == q.dtype
            and lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
            and out.device == lse.device == q.device
        ):
            self._result("forward's out", out, (*rows, v.shape[-1]), q.dtype, q)
            self._result("forward's lse", lse, rows, accumulation_dtype(q.dtype), q)
        return out, lse

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        inputs = (dout, q, k, v, out, lse)
        before = _versions(inputs)
        result = self.kernel.backward(dout, q, k, v, out, lse, options)
        self._untouched(before, ("dout", "q", "k", "v", "out", "lse"), inputs)
        return self._gradients("backward", result, q, k, v)

    def backward_with_lse(
        self,
        dout: torch.Tensor,
        dlse: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        options: BlockOptions,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The kernel's own ``backward_with_lse``, checked as ``backward`` is; for a kernel
        without one, :meth:`backward` twice (the second call for the lse's gradient)."""
        if self._with_lse is None:
            return backward_plus_lse_gradient(self, dout, dlse, q, k, v, out, lse, options)
        inputs = (dout, dlse, q, k, v, out, lse)
        before = _versions(inputs)
        result = self._with_lse.backward_with_lse(dout, dlse, q, k, v, out, lse, options)
        self._untouched(before, ("dout", "dlse", "q", "k", "v", "out", "lse"), inputs)
        return self._gradients("backward_with_lse", result, q, k, v)

    def _gradients(
        self,
        method: str,
        result: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``result``, checked to be ``(dq, dk, dv)`` shaped, typed and placed like ``q, k, v``."""
        if type(result) is not tuple or len(result) != 3:
            raise self._fail(f"{method} returned {type(result).__name__}, not (dq, dk, dv)")
        for name, grad, like in zip(("dq", "dk", "dv"), result, (q, k, v), strict=True):
            self._result(f"{method}'s {name}", grad, like.shape, like.dtype, like)
        return result
