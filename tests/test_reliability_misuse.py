"""Common mistakes that must not pass silently or read unclearly (issue 21, items 8 and 9): a
launched rank that never called ``init_process_group``, a padding mask in the other convention,
documents or padding on the meta device, and an empty shard on one rank."""

from __future__ import annotations

import pathlib
import sys
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

import ringdilated
from ringdilated import DistributedNotInitializedWarning, SequenceLayout
from ringdilated.core.call import grid
from tests.distributed_harness import Workers

TASKS = "tests.misuse_tasks"
FAULTS = "tests.fault_tasks"


def _qkv(length: int = 16) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(2, length, 2, 8, generator=g) for _ in range(3))  # type: ignore[return-value]


# -- item 8a: a launched rank without init_process_group ------------------------------------


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A process as torchrun starts rank 0 of 2, torch.distributed not initialised, that has
    not warned yet."""
    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr(grid, "_warned_alone", False, raising=False)
    return monkeypatch


def test_world_before_init_process_group_warns_once_naming_it(
    launched: pytest.MonkeyPatch,
) -> None:
    q, k, v = _qkv()
    assert dist.group.WORLD is None  # what the mistake passes
    with pytest.warns(DistributedNotInitializedWarning) as caught:
        ringdilated.dilated_attention(
            q, k, v, [8], [1], process_group=dist.group.WORLD, layout=SequenceLayout()
        )
    assert len(caught) == 1
    assert caught[0].filename == __file__, caught[0].filename  # the user's line, not ours
    message = str(caught[0].message)
    assert "WORLD_SIZE=2" in message and "init_process_group()" in message, message
    assert "dist.group.WORLD is None" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: no second warning
        ringdilated.dilated_attention(q, k, v, [4], [1], layout=SequenceLayout())


def test_a_module_call_warns_too(launched: pytest.MonkeyPatch) -> None:
    """A module set to ``process_group`` later (by hand: not what the constructor takes) still
    warns at its call, through ``nn.Module.__call__``."""
    q, k, v = _qkv(12)
    monkeypatch = launched
    monkeypatch.delenv("WORLD_SIZE")  # built outside a launch: no warning then
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attn = ringdilated.DilatedAttention([4], [1], process_group=dist.group.WORLD)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(DistributedNotInitializedWarning, match="init_process_group") as caught:
        attn(q, k, v, layout=SequenceLayout())
    assert caught[0].filename == __file__, caught[0].filename  # through nn.Module.__call__


MODULES: dict[str, Callable[[], torch.nn.Module]] = {
    "DilatedAttention": lambda: ringdilated.DilatedAttention(
        [8], [1], process_group=dist.group.WORLD
    ),
    "MultiheadDilatedAttention": lambda: ringdilated.MultiheadDilatedAttention(
        16, 2, segment_lengths=[8], dilation_rates=[1], process_group=dist.group.WORLD
    ),
    "DilatedTransformerBlock": lambda: ringdilated.DilatedTransformerBlock(
        16, 2, segment_lengths=[8], dilation_rates=[1], process_group=dist.group.WORLD
    ),
}


@pytest.mark.parametrize("name", list(MODULES))
def test_a_module_built_before_init_process_group_warns_when_built(
    launched: pytest.MonkeyPatch, name: str
) -> None:
    """A review found the module case missed: built with ``dist.group.WORLD`` before
    ``init_process_group`` the module holds ``None`` for good, and once the group is
    initialised (before its first forward) the call's check saw an initialised group and said
    nothing while every rank attended over its own shard alone. The constructor warns, at the
    user's line, once per process; the forward after ``init_process_group`` adds nothing."""
    with pytest.warns(DistributedNotInitializedWarning) as caught:
        module = MODULES[name]()
    assert len(caught) == 1
    assert caught[0].filename == __file__, caught[0].filename  # the user's line, not ours
    message = str(caught[0].message)
    assert "WORLD_SIZE=2" in message and "init_process_group()" in message, message
    assert "this module runs every call as one process" in message
    launched.setattr(dist, "is_initialized", lambda: True)  # init_process_group ran since
    x = torch.randn(2, 16, 16)
    inputs = {"DilatedAttention": _qkv(), "MultiheadDilatedAttention": (x, x, x)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process
        module(*inputs.get(name, (x,)))


def test_a_module_built_outside_a_launch_does_not_warn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(grid, "_warned_alone", False, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ringdilated.MultiheadDilatedAttention(16, 2, segment_lengths=[8], dilation_rates=[1])
    assert grid._warned_alone is False


@pytest.mark.parametrize("value", [None, "1", "", "two"])
def test_no_warning_without_a_launch_of_several_ranks(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    monkeypatch.setattr(grid, "_warned_alone", False, raising=False)
    if value is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", value)
    q, k, v = _qkv()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ringdilated.dilated_attention(q, k, v, [8], [1], layout=SequenceLayout())
    assert grid._warned_alone is False


def test_no_warning_once_torch_distributed_is_initialised(workers2: Workers) -> None:
    # A one-process call beside an initialised group is the caller's choice.
    assert workers2.results(f"{TASKS}:one_process_call_beside_a_group", {}) == [[], []]


# -- item 8b: the padding mask's convention -------------------------------------------------


def test_a_transformers_attention_mask_is_refused_naming_the_convention() -> None:
    q, k, v = _qkv()
    attention_mask = torch.ones(2, 16, dtype=torch.int64)  # transformers': 1 = token
    with pytest.raises(TypeError, match=r"True = padding.*attention_mask == 0.*torch\.int64"):
        ringdilated.dilated_attention(q, k, v, [8], [1], key_padding_mask=attention_mask)


@pytest.mark.parametrize("where", ["call", "layout"])
def test_a_row_of_two_runs_names_the_convention(where: str) -> None:
    q, k, v = _qkv()
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[1, 5:9] = True  # valid 0..4 and 9..15: two runs (an inverted mask padded at both ends)
    calls: dict[str, Callable[[], object]] = {
        "call": lambda: ringdilated.dilated_attention(q, k, v, [8], [1], key_padding_mask=mask),
        "layout": lambda: SequenceLayout(key_padding_mask=mask),
    }
    with pytest.raises(ValueError, match=r"row 1 .*\(left or right padding; True = padding"):
        calls[where]()


def test_a_padded_first_token_with_later_ones_kept_is_valid() -> None:
    # Left padding of one token: valid in either reading, so no rule may reject it.
    q, k, v = _qkv()
    mask = torch.zeros(2, 16, dtype=torch.bool)
    mask[:, 0] = True
    out = ringdilated.dilated_attention(q, k, v, [8], [1], key_padding_mask=mask)
    assert torch.all(out[:, 0] == 0) and torch.all(out[:, 1:].abs().sum(-1) > 0)


# -- item 9a: documents and padding on the meta device ---------------------------------------

META_CASES = [
    ("cu_seqlens", torch.tensor([0, 5, 16], device="meta")),
    ("key_padding_mask", torch.zeros(2, 16, dtype=torch.bool, device="meta")),
]


@pytest.mark.parametrize(("name", "value"), META_CASES, ids=[n for n, _ in META_CASES])
@pytest.mark.parametrize("where", ["call", "module", "layout"])
def test_meta_documents_or_padding_are_refused_naming_the_argument(
    name: str, value: torch.Tensor, where: str
) -> None:
    q, k, v = _qkv()
    expected = rf"{name} must hold data the host can read .*device meta"
    calls: dict[str, Callable[[], object]] = {
        "call": lambda: ringdilated.dilated_attention(q, k, v, [8], [1], **{name: value}),
        "module": lambda: ringdilated.DilatedAttention([8], [1])(q, k, v, **{name: value}),
        "layout": lambda: SequenceLayout(**{name: value}),
    }
    with pytest.raises(ValueError, match=expected):
        calls[where]()


@pytest.mark.parametrize("where", ["cache", "module"])
def test_a_meta_padding_mask_for_rotary_positions_is_refused_naming_it(where: str) -> None:
    """A review found ``DilatedKVCache.rotary_positions`` (what a module with ``rotary=`` and a
    cache calls first) gave torch's "Cannot copy out of meta tensor" for a meta mask."""
    mask = torch.zeros(2, 16, dtype=torch.bool, device="meta")
    expected = r"key_padding_mask must hold data the host can read .*device meta"
    if where == "cache":
        cache = ringdilated.DilatedKVCache([8], [1], num_heads=2)
        with pytest.raises(ValueError, match=expected):
            cache.rotary_positions(16, torch.device("cpu"), key_padding_mask=mask)
        return
    from ringdilated.rotary import rotary_embedding

    mha = ringdilated.MultiheadDilatedAttention(
        16, 2, segment_lengths=[8], dilation_rates=[1], causal=True, rotary=rotary_embedding
    )
    x = torch.randn(2, 16, 16, dtype=mha.q_proj.weight.dtype)
    with pytest.raises(ValueError, match=expected):
        mha(x, x, x, key_padding_mask=mask, cache=mha.make_cache())


# -- item 9b: an empty shard, worded alike on every rank -------------------------------------


def test_an_empty_shard_reads_the_same_on_every_rank(workers2: Workers) -> None:
    results = workers2.results(f"{FAULTS}:call_with_fault", {"fault": "empty shard", "rank": 1})
    assert [r["raised"] for r in results] == ["ValueError", "ValueError"], results
    expected = (
        "every rank's shard must hold at least one position, got shard lengths (8, 0) "
        "(rank 1 holds 0)"
    )
    assert [r["message"] for r in results] == [expected, expected]


@pytest.mark.parametrize("shard_length", [None, 8])
def test_an_empty_shard_on_a_layout_names_its_rank_on_every_rank(
    workers2: Workers, shard_length: int | None
) -> None:
    payload = {"rank": 1, "shard_length": shard_length}
    results = workers2.results(f"{TASKS}:empty_shard_on_layout", payload)
    assert [r["raised"] for r in results] == ["ValueError", "ValueError"], results
    for result in results:
        assert "every rank's shard must hold at least one position" in result["message"], results
        assert "rank 1" in result["message"], results
    if shard_length is None:  # the ranks exchanged their lengths: one message
        assert results[0]["message"] == results[1]["message"]
        assert results[0]["message"].endswith("shard lengths (8, 0) (rank 1 holds 0)")
    else:  # rank 1 found it; rank 0 quotes it
        assert results[1]["message"] == (
            "every rank's shard must hold at least one position, got an empty shard on rank 1: "
            "q of shape (1, 0, 2, 8)"
        )
        assert results[0]["message"] == (
            f"rank 1 rejected its input, so every rank stops: ValueError: {results[1]['message']}"
        )


def test_several_empty_shards_are_all_named() -> None:
    from ringdilated.core.call.validation import check_shard_lengths

    with pytest.raises(ValueError, match=r"shard lengths \(8, 0, 8, 0\) \(ranks 1, 3 hold none\)"):
        check_shard_lengths((8, 0, 8, 0))
    check_shard_lengths((8, 1))


def test_a_warning_through_a_wrapper_library_names_the_user_s_line(
    launched: pytest.MonkeyPatch, tmp_path: pathlib.Path
) -> None:
    """A re-review: only transformers' frames were skipped, so a warning raised under an
    accelerate hook (or a peft wrapper) named the wrapper's file. An imported package of that
    name (here a stand-in ``accelerate`` whose hook calls into ringdilated) is skipped too."""
    import importlib.util

    package = tmp_path / "accelerate"
    package.mkdir()
    (package / "__init__.py").write_text("def call(function):\n    return function()\n")
    spec = importlib.util.spec_from_file_location("accelerate", package / "__init__.py")
    assert spec is not None and spec.loader is not None
    stand_in = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stand_in)
    launched.setitem(sys.modules, "accelerate", stand_in)
    with pytest.warns(DistributedNotInitializedWarning) as caught:
        stand_in.call(grid.warn_if_launched_alone)
    assert caught[0].filename == __file__, caught[0].filename
