"""NCCL needs each rank's own GPU current before its first collective: checked once per plan.

torch 2.13 (``torch/distributed/distributed_c10d.py``) says so where it matters here:
``batch_isend_irecv`` (which ``ringpass`` sends with), "when this API is used with the NCCL PG
backend, users must set the current GPU device with ``torch.cuda.set_device``, otherwise it will
lead to unexpected hang issues"; the object collectives on NCCL take
``torch.cuda.current_device()`` as their device; ``barrier()`` uses the current device, with a
warning, unless the group is bound to one. Binding a device (``init_process_group(device_id=...)``
sets the group's ``bound_device_id``, which ``new_group`` inherits) does not make it current.

So on a layout whose groups move CUDA tensors with NCCL, a call whose CUDA tensors are not on
``torch.cuda.current_device()`` raises
:class:`~ringdilated.core.support.errors.CudaDeviceNotSetError` in its validation
(:func:`~ringdilated.core.call.prepare.prepare_call`, on every rank, once per plan), which the
ranks' agreement (on the CPU, never on NCCL:
:func:`~ringdilated.core.call.agreement.control_layout`) turns into an error on every rank before
any data moves. Host-only: the group's backend name and the current device's index; no
collective, no device synchronisation.

What one rank cannot tell is not checked: ranks that all hold their tensors on GPU 0 with GPU 0
current (``set_device`` never called, tensors made with ``.cuda()``) pass here; only the ranks'
device indices on one node together show that they share a GPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ringdilated.core.call.grid import Grid
from ringdilated.core.support.errors import CudaDeviceNotSetError

__all__ = ["check_current_device", "moves_cuda_with_nccl"]


def moves_cuda_with_nccl(group: dist.ProcessGroup) -> bool:
    """Whether ``group`` moves CUDA tensors with NCCL: its backend is ``"nccl"``, or a
    per-device backend that maps ``cuda`` to it (``"cuda:nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    name = _backend(group)
    if ":" not in name:
        return name == "nccl"
    return "cuda:nccl" in name.split(",")


def _backend(group: dist.ProcessGroup) -> str:
    return str(dist.get_backend(group)).lower().replace(" ", "")


def check_current_device(layout: dist.ProcessGroup | Grid, device: torch.device) -> None:
    """Raise :class:`~ringdilated.core.support.errors.CudaDeviceNotSetError` when ``device`` (the
    call's tensors') is a CUDA device other than ``torch.cuda.current_device()`` and a group of
    ``layout`` moves CUDA tensors with NCCL (:func:`moves_cuda_with_nccl`)."""
    if device.type != "cuda":
        return
    groups = (layout.outer, layout.inner) if isinstance(layout, Grid) else (layout,)
    nccl = [g for g in groups if moves_cuda_with_nccl(g)]
    if not nccl:
        return
    current = torch.cuda.current_device()
    if device.index is None or device.index == current:
        return
    bound = getattr(nccl[0], "bound_device_id", None)
    binding = (
        f" (init_process_group(device_id={bound}) bound the group to {bound}, which does not "
        "make it current)"
        if bound is not None
        else ""
    )
    raise CudaDeviceNotSetError(
        str(device),
        current,
        f"this rank's tensors are on {device} but the current CUDA device is cuda:{current}, "
        f"and the process group moves CUDA tensors with NCCL (backend {_backend(nccl[0])!r}), "
        "which needs each rank's own GPU current before its first collective (torch documents "
        f"that batch_isend_irecv can hang without torch.cuda.set_device){binding}. Call "
        "torch.cuda.set_device(local_rank) before init_process_group (under torchrun, "
        "local_rank = int(os.environ['LOCAL_RANK'])) and keep this rank's tensors on that "
        "device",
    )
