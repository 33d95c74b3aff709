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

from ringdilated.cli import flags

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        type=flags.device_name,
        default=None,
        help="cpu, cuda, cuda:1 (default: cuda if any)",
    )
    parser.add_argument(
        "--dtype",
        type=flags.dtype_or_auto,
        default="auto",
        help="float32/fp32, bfloat16/bf16, float16/fp16, float64/fp64 or auto (the policy)",
    )
    parser.add_argument("--head-dim", type=flags.positive_int, default=64)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument(
        "--world-size", type=flags.positive_int, default=2, help="ranks for the communicator"
    )


def _dtype(name: str, device: torch.device) -> torch.dtype:
    from ringdilated.core.dtypes import recommended_dtype

    return recommended_dtype(device) if name == "auto" else flags.to_dtype(name)


def run(args: argparse.Namespace) -> int:
    import ringdilated
    from ringdilated.core import Environment, Request
    from ringdilated.plugins import PluginError, load_registry
    from ringdilated.registry import default_resolver

    if args.device is not None:
        flags.require_device(args.device)
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
