"""Torch and device facts, loaded plugins, and the resolver's choice for a sample call.

For the sample configuration (``--device``, ``--dtype``, ``--head-dim``, ``--causal``,
``--world-size``) it prints the kernel and communicator the resolver would pick and the reason
every other one was rejected. Plugins that failed are listed, not raised; in strict mode
(``RINGDILATED_STRICT_PLUGINS=1``) a failing plugin is printed and the exit status is 1.
"""

from __future__ import annotations

import argparse
import platform
from typing import TYPE_CHECKING

import torch

from ringdilated.cli import flags

if TYPE_CHECKING:
    from ringdilated.core.select.resolver import Resolver

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
    ints = flags.int_list()
    parser.add_argument(
        "--length", type=flags.positive_int, default=65536, help="global sequence length"
    )
    parser.add_argument("--segments", type=ints, default=[2048, 4096, 8192])
    parser.add_argument("--rates", type=ints, default=[1, 2, 4])
    parser.add_argument("--heads", type=flags.positive_int, default=8)
    parser.add_argument("--kv-heads", type=flags.positive_int, default=None)
    parser.add_argument("--batch", type=flags.positive_int, default=1)


def run(args: argparse.Namespace) -> int:
    import ringdilated
    from ringdilated.core import Environment, Request
    from ringdilated.core.call.sequence_layout import agree_every_call_default
    from ringdilated.plugins import PluginError, load_registry
    from ringdilated.registry import default_resolver

    if args.device is not None:
        flags.require_device(args.device)
    env = Environment.from_environ()
    agree_every_call_default()  # read strictly here too: a bad value raises, naming it
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    recommended = ringdilated.recommended_dtype(device, env)
    dtype = recommended if args.dtype == "auto" else flags.to_dtype(args.dtype)
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
    print(f"recommended dtype on {device}: {recommended}")
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
        window=args.causal,
        backward=True,
    )
    resolver = default_resolver()
    print("\nsample call:")
    try:
        print(resolver.resolve(request).explain())
    except ringdilated.ResolutionError as exc:
        print(f"no kernel fits: {exc}")
    print(_communicators(resolver, args, dtype, device))
    return 0


def _communicators(
    resolver: Resolver, args: argparse.Namespace, dtype: torch.dtype, device: torch.device
) -> str:
    """The communicator choice for a sample sharded call, with what each would move."""
    from ringdilated.core import DilationPattern
    from ringdilated.core.plan.shards import shard_plan
    from ringdilated.core.select.cost import PieceSize, link_for

    world = args.world_size
    if world == 1:
        return resolver.explain_communicator(world, args.causal, "auto")
    kv_heads = args.kv_heads or args.heads
    flags.check_pattern(args.segments, args.rates, args.heads)
    if args.heads % kv_heads:
        raise ValueError(f"--kv-heads {kv_heads} must divide --heads {args.heads}")
    if args.length < world:
        raise ValueError(
            f"--length {args.length} must hold at least one position per rank of --world-size "
            f"{world}"
        )
    pattern = DilationPattern(args.segments, args.rates)
    share, extra = divmod(args.length, world)
    lengths = tuple(share + (r < extra) for r in range(world))
    plans = tuple(
        shard_plan(pattern, args.length, args.heads, kv_heads, r, world, None, lengths)
        for r in range(world)
    )
    size = PieceSize(args.batch, args.head_dim, dtype.itemsize, link_for(device.type))
    what = (
        f"\nsample sharded call: L={args.length} over {world} ranks, segments {args.segments}, "
        f"rates {args.rates}, {args.heads} heads ({kv_heads} key/value), batch {args.batch}, "
        f"{dtype}{', causal' if args.causal else ''}:"
    )
    return what + "\n" + resolver.explain_communicator(world, args.causal, "auto", plans, size)
