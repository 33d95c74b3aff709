"""What every recipe's ``main`` does under torchrun: join the process group, one device per rank."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist


def init_distributed() -> torch.device:
    """Join the default group (NCCL with one GPU per rank, made current before the first
    collective; gloo on CPU) and return this rank's device."""
    timeout = datetime.timedelta(seconds=120)
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def report(name: str, losses: list[float]) -> None:
    """Rank 0 prints the loss curve."""
    if dist.get_rank() == 0:
        curve = "  ".join(f"{loss:.4f}" for loss in losses)
        print(f"{name}: world {dist.get_world_size()}, losses {curve}")
