"""Torch and device facts, loaded plugins, and the resolver's choice for a sample call.

For the sample configuration (``--device``, ``--dtype``, ``--head-dim``, ``--causal``,
``--world-size``) it prints the kernel and communicator the resolver would pick and the reason
every other one was rejected. Plugins that failed are listed, not raised; in strict mode
(``RINGDILATED_STRICT_PLUGINS=1``) a failing plugin is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import platform

import torch

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if any)")
    parser.add_argument(
        "--dtype", default="auto", help="float32, bfloat16, float16, float64 or auto (the policy)"
    )
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--world-size", type=int, default=2, help="ranks for the communicator")


def _dtype(name: str, device: torch.device) -> torch.dtype:
    from ringdilated.core.dtypes import recommended_dtype

    if name == "auto":
        return recommended_dtype(device)
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"--dtype must be a floating dtype name or 'auto', got {name!r}")
    return dtype


def run(args: argparse.Namespace) -> int:
    import ringdilated
    from ringdilated.core import Environment, Request
    from ringdilated.functional import default_resolver
    from ringdilated.plugins import PluginError, load_registry

    env = Environment.from_environ()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = _dtype(args.dtype, device)
    print(
        f"ringdilated {ringdilated.__version__}, torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )
    print(f"cpu: {platform.machine()}, {torch.get_num_threads()} threads")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            print(f"cuda:{i}: {torch.cuda.get_device_name(i)}, compute capability {major}.{minor}")
    else:
        print("cuda: not available")
    if env.compute_capability is not None:
        print(
            f"(compute capability overridden by RINGDILATED_COMPUTE_CAPABILITY: "
            f"{env.compute_capability[0]}.{env.compute_capability[1]})"
        )
    print(f"recommended dtype on {device}: {ringdilated.recommended_dtype(device, env)}")
    print("\nplugins:")
    try:
        print(load_registry().describe())
    except PluginError as exc:  # strict mode: a failing plugin stops the registry
        print(f"the plugin registry could not be built: {exc}")
        return 1
    request = Request(
        env.device_type(device),
        dtype,
        args.head_dim,
        env.capability(device),
        causal=args.causal,
        backward=True,
    )
    resolver = default_resolver()
    print("\nsample call:")
    try:
        print(resolver.resolve(request).explain())
    except ringdilated.ResolutionError as exc:
        print(f"no kernel fits: {exc}")
    print(resolver.explain_communicator(args.world_size, args.causal, "auto"))
    return 0
