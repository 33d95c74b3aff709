"""Tasks for tests/test_hf_sequence_parallel.py, run on every rank of a gloo pool, and the tiny
Llama they shard (the tests build its one-process references in the test process).

A case is a dict: ``input_ids`` (rows of ints), optional ``labels``, ``attention_mask``,
``cu_seqlens``; the model's ``pattern`` (segment lengths, dilation rates), ``mode`` and
``layers`` (default 2); the ``communicator``; ``grid`` (a 2 x 2 mesh, for ``"hybrid"``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

VOCAB = 64


def tiny_llama(case: dict[str, Any], implementation: str) -> Any:
    """A float64 Llama of ``case["layers"]`` layers (default 2) with grouped-query heads (4
    query, 2 key/value), seeded: the same weights in every process."""
    import transformers

    import ringdilated.hf  # noqa: F401  (registers "ringdilated")

    segments, rates = case.get("pattern", ([64], [1]))
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
        num_hidden_layers=case.get("layers", 2), num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256,
        ringdilated_segment_lengths=list(segments), ringdilated_dilation_rates=list(rates),
        ringdilated_mode=case.get("mode", "head_groups"),
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    model.set_attn_implementation(implementation)
    return model.train()


def batch_tensors(case: dict[str, Any]) -> dict[str, torch.Tensor]:
    """``shard_batch``'s tensor arguments for ``case`` (the whole batch)."""
    out = {"input_ids": torch.tensor(case["input_ids"])}
    for name in ("labels", "attention_mask", "cu_seqlens"):
        if case.get(name) is not None:
            out[name] = torch.tensor(case[name])
    return out


def _process_layout(case: dict[str, Any]) -> object:
    if case.get("grid"):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("ring", "ulysses"))
        return (mesh, ("ring", "ulysses"))
    return dist.group.WORLD


def communicators(layout: Any) -> list[str]:
    """The registered names of the communicators the calls planned on ``layout`` run with (the
    plans' own choices, one per group of padded rows; none on one process)."""
    names: set[str] = set()
    for plan in layout.plans._plans.values():
        choices = [chosen for _, _, chosen in plan.row_plans] or [plan.communicator]
        names.update(chosen.spec.name for chosen in choices if chosen is not None)
    return sorted(names)


def _local_mask(case: dict[str, Any], shard: Any) -> dict[str, Any]:
    """``{"attention_mask": this shard's columns of the batch's}`` when the case passes it."""
    if not (case.get("pass_attention_mask") and "attention_mask" in case):
        return {}
    mask = torch.tensor(case["attention_mask"])
    return {"attention_mask": mask[:, shard.start : shard.start + shard.input_ids.shape[1]]}


def sharded_step(case: dict[str, Any]) -> dict[str, Any]:
    """shard -> forward under sequence_parallel -> sharded loss -> backward on this rank: its
    logits, its own parameter gradients (not reduced), the loss, where its shard lies and the
    communicators its calls ran with. ``case["checkpointing"]``: ``True`` checkpoints the
    layers (recomputed in backward, outside the with block); ``"model"`` the whole forward,
    mask creation included, which the backward refuses: then ``{"error": ...}``."""
    import ringdilated
    import ringdilated.hf

    group = _process_layout(case)
    model = tiny_llama(case, "ringdilated")
    if case.get("checkpointing") is True:
        model.activation_checkpointing_enable({"use_reentrant": False})
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=group)
    kwargs = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    kwargs.update(_local_mask(case, shard))  # read and checked, not needed
    with ringdilated.hf.sequence_parallel(
        shard.layout, communicator=case.get("communicator", "auto")
    ):
        if case.get("checkpointing") == "model":
            from torch.utils.checkpoint import checkpoint

            logits = checkpoint(lambda: model(**kwargs).logits, use_reentrant=False)
        else:
            logits = model(**kwargs).logits
    loss = ringdilated.sharded_cross_entropy(logits, shard.labels, group)
    try:
        loss.backward()
    except RuntimeError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "logits": logits.detach(),
        "loss": loss.detach(),
        "grads": {n: p.grad for n, p in model.named_parameters() if p.grad is not None},
        "start": shard.start,
        "length": shard.length,
        "communicators": communicators(shard.layout),
    }


def counted_steps(case: dict[str, Any]) -> dict[int, list[dict[str, Any]]]:
    """For models of 2 and 4 layers (after one of 1), on a new layout each: what two steps on
    that layout (a forward under the block without transformers' cache, whose empty tensors
    cost two copies per layer, and the backward of its logits' sum, no loss collectives) cost the
    host (:class:`~ringdilated.testing.hot_path.HotPathCounter`): reads, copies, control
    collectives, exchanges and the events, per step."""
    import ringdilated
    import ringdilated.hf
    from ringdilated.testing.hot_path import HotPathCounter

    out: dict[int, list[dict[str, Any]]] = {}
    # A model of one layer first, uncounted: the process-wide caches (the exchange's index
    # tensors per piece and device) are filled once per process, not per layout.
    for layers in (1, 2, 4):
        model = tiny_llama({**case, "layers": layers}, "ringdilated")
        shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
        kwargs: dict[str, Any] = {
            "input_ids": shard.input_ids, "position_ids": shard.position_ids, "use_cache": False,
        }  # fmt: skip
        kwargs.update(_local_mask(case, shard))
        if case.get("pass_cu_seq_lens"):
            bounds = torch.tensor(case["cu_seqlens"], dtype=torch.int32)
            kwargs.update(cu_seq_lens_q=bounds, cu_seq_lens_k=bounds)
        steps = []
        for _ in range(2):
            with HotPathCounter() as counts:
                with ringdilated.hf.sequence_parallel(shard.layout, communicator="ringpass"):
                    logits = model(**kwargs).logits
                logits.sum().backward()
            steps.append(
                {
                    "reads": counts.host_reads,
                    "copies": counts.host_copies,
                    "control": counts.control_collectives,
                    "exchanges": counts.exchanges,
                    "events": [e for e in counts.events if e[0] != "exchange"],
                }
            )
        out[layers] = steps
    del out[1]
    return out


def first_layer_dout(case: dict[str, Any]) -> torch.Tensor:
    """A seeded gradient for the first layer's attention output of the whole batch,
    ``(B, L, 4 heads, 8)``."""
    rows, length = batch_tensors(case)["input_ids"].shape
    generator = torch.Generator().manual_seed(11)
    return torch.randn(rows, length, 4, 8, generator=generator, dtype=torch.float64)


def first_layer_call(case: dict[str, Any]) -> dict[str, Any]:
    """The first layer's attention call of a forward under the block on this rank: the
    ``query``, ``key``, ``value`` transformers passed (``(B, H, L, D)``, this shard's), the
    adapter's output ``(B, L, H, D)``, the scaling, and the gradients of ``query``, ``key``,
    ``value`` through that call alone for :func:`first_layer_dout`'s columns of this shard."""
    from transformers import AttentionInterface

    import ringdilated
    import ringdilated.hf

    seen: dict[str, Any] = {}

    def capture(module: Any, query: Any, key: Any, value: Any, mask: Any, **kw: Any) -> Any:
        out, weights = ringdilated.hf.attention_forward(module, query, key, value, mask, **kw)
        if module.layer_idx == 0:
            seen.update(q=query, k=key, v=value, out=out, scaling=kw.get("scaling"))
        return out, weights

    model = tiny_llama(case, "ringdilated")
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
    AttentionInterface.register("ringdilated", capture)
    try:
        with ringdilated.hf.sequence_parallel(shard.layout):
            model(input_ids=shard.input_ids, position_ids=shard.position_ids)
    finally:
        ringdilated.hf.register()
    columns = slice(shard.start, shard.start + shard.input_ids.shape[1])
    dout = first_layer_dout(case)[:, columns]
    inputs = (seen["q"], seen["k"], seen["v"])
    grads = torch.autograd.grad(seen["out"], inputs, dout)
    return {
        "inputs": [x.detach() for x in inputs],
        "out": seen["out"].detach(),
        "grads": list(grads),
        "scaling": seen["scaling"],
        "start": shard.start,
    }


def fsdp_step(case: dict[str, Any]) -> dict[str, Any]:
    """A dp x cp mesh over 4 ranks, FSDP2 over all of them, the sequence sharded on cp:
    replica ``dp`` takes row ``dp`` of the batch, the loss is the token-weighted mean over the
    whole batch (``averaged_over`` = the 4 ranks FSDP2 averages over). ``case["mesh"]``:
    ``"torch"`` (``init_device_mesh``, dimensions ``("dp", "cp")``) or ``"accelerate"``
    (``accelerate.ParallelismConfig(dp_shard_size=2, cp_size=2).build_device_mesh("cpu")``:
    FSDP2 over its flattened ``"dp_shard_cp"``, the loss over ``"dp_cp"``). Returns the loss,
    the full (unsharded) gradients, which FSDP2 has averaged, and the communicators that ran."""
    from torch.distributed.fsdp import fully_shard

    import ringdilated
    import ringdilated.hf

    if case["mesh"] == "accelerate":
        from accelerate.parallelism_config import ParallelismConfig

        mesh = ParallelismConfig(dp_shard_size=2, cp_size=2).build_device_mesh("cpu")
        dp = mesh.get_local_rank("dp_shard")
        fsdp_mesh, loss_group = mesh["dp_shard_cp"], mesh["dp_cp"]
    else:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        dp = mesh.get_local_rank("dp")
        fsdp_mesh, loss_group = init_device_mesh("cpu", (4,)), dist.group.WORLD
    model = tiny_llama(case, "ringdilated")
    for layer in model.model.layers:
        fully_shard(layer, mesh=fsdp_mesh)
    fully_shard(model, mesh=fsdp_mesh)
    rows = {k: v[dp : dp + 1] for k, v in batch_tensors(case).items() if k != "cu_seqlens"}
    shard = ringdilated.shard_batch(**rows, process_group=(mesh, "cp"))
    with ringdilated.hf.sequence_parallel(shard.layout, communicator=case["communicator"]):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids).logits
    loss = ringdilated.sharded_cross_entropy(
        logits, shard.labels, loss_group, averaged_over=dist.get_world_size()
    )
    loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": loss.detach(), "grads": grads, "communicators": communicators(shard.layout)}


def bad_shard(case: dict[str, Any]) -> str:
    """Rank ``case["bad_rank"]`` passes what ``case["mistake"]`` names; every rank's outcome."""
    import ringdilated
    import ringdilated.hf

    rank = dist.get_rank()
    model = tiny_llama(case, "ringdilated")
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
    kwargs: dict[str, Any] = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    if rank == case["bad_rank"]:
        _make_mistake(case["mistake"], kwargs)
    try:
        with ringdilated.hf.sequence_parallel(shard.layout):
            model(**kwargs)
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _make_mistake(mistake: str, kwargs: dict[str, Any]) -> None:
    """Change a rank's model arguments as ``mistake`` names."""
    ids, positions = kwargs["input_ids"], kwargs["position_ids"]
    if mistake == "no position_ids":
        del kwargs["position_ids"]
    elif mistake == "a mask with a hole":
        kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs["attention_mask"][0, 1] = 0
    elif mistake == "row 1 counts from 0":
        kwargs["position_ids"] = positions.expand(ids.shape[0], -1).clone()
        kwargs["position_ids"][1] = torch.arange(ids.shape[1])
    else:
        raise AssertionError(mistake)


def reused_layout_mistake(case: dict[str, Any]) -> dict[str, str]:
    """One layout for four forwards: a training step on every rank; then under ``no_grad`` (a
    call the layout has not planned) rank ``case["bad_rank"]`` makes ``case["mistake"]``; then
    a good ``no_grad`` forward on every rank (planned now); then that rank alone makes the
    mistake again, counted. Every rank's outcome of the second forward, and the failing rank's
    of the fourth with its control collectives."""
    import ringdilated
    import ringdilated.hf
    from ringdilated.testing.hot_path import HotPathCounter

    rank = dist.get_rank()
    model = tiny_llama(case, "ringdilated")
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
    good = {"input_ids": shard.input_ids, "position_ids": shard.position_ids}
    bad = dict(good)
    _make_mistake(case["mistake"], bad)
    outcome: dict[str, str] = {}

    def forward(kwargs: dict[str, Any]) -> str:
        try:
            with ringdilated.hf.sequence_parallel(shard.layout):
                model(**kwargs)
        except ValueError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    with ringdilated.hf.sequence_parallel(shard.layout):
        model(**good).logits.sum().backward()
    with torch.no_grad():
        outcome["new call"] = forward(bad if rank == case["bad_rank"] else good)
        assert forward(good) == "no error"
        if rank == case["bad_rank"]:
            with HotPathCounter() as counts:
                outcome["planned call"] = forward(bad)
            outcome["control"] = str(counts.control_collectives)
    return outcome


def labels_passed(case: dict[str, Any]) -> str:
    """Every rank passes ``labels=`` (its shard's) to the model under the block: the outcome."""
    import ringdilated
    import ringdilated.hf

    model = tiny_llama(case, "ringdilated")
    shard = ringdilated.shard_batch(**batch_tensors(case), process_group=dist.group.WORLD)
    try:
        with ringdilated.hf.sequence_parallel(shard.layout):
            model(
                input_ids=shard.input_ids, position_ids=shard.position_ids, labels=shard.input_ids
            )
    except ValueError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"
