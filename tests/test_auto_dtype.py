"""``dtype="auto"`` decided where a module is moved (:mod:`ringdilated.auto_dtype`).

CUDA devices are FakeTensor ``cuda`` tensors (a CPU-only torch moves a module's parameters onto
them with ``.to("cuda:0")`` inside ``FakeTensorMode``; ``.cuda()`` runs the same
``nn.Module._apply`` but asks for a real device), with the compute capability set by
``RINGDILATED_COMPUTE_CAPABILITY``, which :func:`ringdilated.recommended_dtype` reads.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.two_tensor import TwoTensor

import ringdilated.auto_dtype
from ringdilated import DilatedTransformerBlock, MultiheadDilatedAttention
from ringdilated.auto_dtype import AutoDtype, resolve_dtype
from ringdilated.testing import oracle

PATTERN = {"segment_lengths": [8], "dilation_rates": [1]}
POLICY = [("9.0", torch.bfloat16), ("8.0", torch.bfloat16), ("7.5", torch.float16)]
POLICY += [("7.0", torch.float16), ("6.1", torch.float32)]


def attention(**kwargs: object) -> MultiheadDilatedAttention:
    return MultiheadDilatedAttention(16, 2, **PATTERN, **kwargs)  # type: ignore[arg-type]


def block(**kwargs: object) -> DilatedTransformerBlock:
    return DilatedTransformerBlock(16, 2, ffn_dim=24, **PATTERN, **kwargs)  # type: ignore[arg-type]


MODULES = [attention, block]


def floating(module: nn.Module) -> set[tuple[torch.dtype, torch.device]]:
    """Every floating parameter's and buffer's ``(dtype, device)``."""
    tensors = (*module.parameters(), *module.buffers())
    return {(t.dtype, t.device) for t in tensors if t.is_floating_point()}


@pytest.fixture
def fake_cuda() -> Iterator[FakeTensorMode]:
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        yield mode


@pytest.fixture
def consulted(monkeypatch: pytest.MonkeyPatch) -> list[torch.device]:
    """The devices the policy is asked about by :mod:`ringdilated.auto_dtype`, in order."""
    asked: list[torch.device] = []
    real = ringdilated.auto_dtype.recommended_dtype

    def counting(device: torch.device | str | None = None, env: object = None) -> torch.dtype:
        asked.append(torch.device(device or "cpu"))
        return real(device)

    monkeypatch.setattr(ringdilated.auto_dtype, "recommended_dtype", counting)
    return asked


CUDA0 = torch.device("cuda", 0)


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize(("capability", "expected"), POLICY)
def test_a_module_moved_to_a_gpu_takes_that_gpus_dtype(
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[..., AutoDtype],
    capability: str,
    expected: torch.dtype,
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", capability)
    module = make()
    assert floating(module) == {(torch.float32, torch.device("cpu"))}
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to("cuda:0")
        assert floating(module) == {(expected, CUDA0)}
        # Inputs in another dtype are still rejected, naming both.
        other = torch.float32 if expected != torch.float32 else torch.bfloat16
        x = torch.empty(1, 8, 16, dtype=other, device="cuda:0")
        message = f"is {other} but the module's parameters are {expected}"
        with pytest.raises(TypeError, match=message):
            module(x) if isinstance(module, DilatedTransformerBlock) else module(x, x, x)


@pytest.mark.parametrize(("capability", "expected"), POLICY[1:])
def test_to_empty_from_meta_takes_the_gpus_dtype(
    monkeypatch: pytest.MonkeyPatch, capability: str, expected: torch.dtype
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", capability)
    with torch.device("meta"):
        module = block()
    assert floating(module) == {(torch.float32, torch.device("meta"))}
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to_empty(device="cuda:0")
    assert floating(module) == {(expected, CUDA0)}


@pytest.mark.parametrize("make", MODULES)
def test_on_cpu_auto_is_float32_and_a_later_gpu_move_still_decides(
    monkeypatch: pytest.MonkeyPatch, make: Callable[..., AutoDtype]
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = make()
    module.to("cpu").cpu().to("meta").to_empty(device="cpu")  # CPU and meta: still open
    torch.manual_seed(0)
    module.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    x = torch.randn(1, 8, 16)
    out = module(x) if isinstance(module, DilatedTransformerBlock) else module(x, x, x)[0]
    assert out.dtype == torch.float32 and floating(module) == {(torch.float32, torch.device("cpu"))}
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to("cuda:0")
    assert floating(module) == {(torch.bfloat16, CUDA0)}


CONVERSIONS: dict[str, tuple[Callable[[nn.Module], object], torch.dtype]] = {
    ".to(float64)": (lambda m: m.to(torch.float64), torch.float64),
    ".half()": (lambda m: m.half(), torch.float16),
    ".float()": (lambda m: m.float(), torch.float32),
    ".to(dtype=float32)": (lambda m: m.to(dtype=torch.float32), torch.float32),
    ".type(float32)": (lambda m: m.type(torch.float32), torch.float32),
    "a holder's .float()": (lambda m: nn.Sequential(m).float(), torch.float32),
}


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize("conversion", CONVERSIONS, ids=list(CONVERSIONS))
def test_a_dtype_set_before_the_move_is_kept(
    monkeypatch: pytest.MonkeyPatch,
    consulted: list[torch.device],
    make: Callable[..., AutoDtype],
    conversion: str,
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = make()
    convert, expected = CONVERSIONS[conversion]
    convert(module)
    asked = len(consulted)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to("cuda:0")
    assert floating(module) == {(expected, CUDA0)}
    assert len(consulted) == asked, "the policy was not even asked"


@pytest.mark.parametrize("make", MODULES)
@pytest.mark.parametrize(
    "move",
    [
        lambda m: m.to("cuda:0", torch.float32),
        lambda m: m.to(torch.empty(0, device="cuda:0")),
        lambda m: nn.Sequential(m).to("cuda:0", torch.float32),
    ],
    ids=[".to(cuda, float32)", ".to(a float32 cuda tensor)", "a holder's .to(cuda, float32)"],
)
def test_a_dtype_set_with_the_move_is_kept(
    monkeypatch: pytest.MonkeyPatch,
    make: Callable[..., AutoDtype],
    move: Callable[[nn.Module], object],
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = make()
    with FakeTensorMode(allow_non_fake_inputs=True):
        move(module)
    assert floating(module) == {(torch.float32, CUDA0)}


@pytest.mark.parametrize("dtype", [torch.float32, None])
def test_an_explicit_dtype_at_construction_is_kept(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype | None
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = attention(dtype=dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to("cuda:0")
    assert floating(module) == {(torch.get_default_dtype(), CUDA0)}


def test_a_holders_move_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "7.5")
    inner, plain = attention(), nn.Linear(16, 16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        nn.ModuleList([inner, plain]).to("cuda:0")
    assert floating(inner) == {(torch.float16, CUDA0)}
    assert floating(plain) == {(torch.float32, CUDA0)}, "only dtype='auto' modules are cast"


@pytest.fixture
def cpu_as_gpu(monkeypatch: pytest.MonkeyPatch) -> Callable[[], list[torch.device]]:
    """Makes CPU stand in for a GPU, from the call on (modules built before are built as
    usual, float32 and open): a CPU-only torch has no real GPU to move to, and FakeTensor
    parameters cannot be moved twice (``nn.Module._apply`` swaps them, which their weak
    references forbid). CPU is then not an open device, and the policy gives float64 the first
    time it is asked, float16 after. The call returns the devices the policy is asked about."""
    asked: list[torch.device] = []

    def policy(device: torch.device) -> torch.dtype:
        asked.append(device)
        return torch.float64 if len(asked) == 1 else torch.float16

    def stand_in() -> list[torch.device]:
        monkeypatch.setattr(ringdilated.auto_dtype, "OPEN_DEVICE_TYPES", frozenset({"meta"}))
        monkeypatch.setattr(ringdilated.auto_dtype, "recommended_dtype", policy)
        return asked

    return stand_in


@pytest.mark.parametrize("make", MODULES)
def test_the_first_gpu_move_asks_the_policy_once(
    monkeypatch: pytest.MonkeyPatch, consulted: list[torch.device], make: Callable[..., AutoDtype]
) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = make()
    at_construction = len(consulted)
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to("cuda:0")
    assert consulted[at_construction:] == [CUDA0]


@pytest.mark.parametrize("make", MODULES)
def test_the_dtype_is_decided_once(
    cpu_as_gpu: Callable[[], list[torch.device]], make: Callable[..., AutoDtype]
) -> None:
    module = make()
    asked = cpu_as_gpu()
    module.to("cpu")
    assert floating(module) == {(torch.float64, torch.device("cpu"))}
    module.to("meta").to_empty(device="cpu").to("cpu")
    assert floating(module) == {(torch.float64, torch.device("cpu"))}, "kept, as nn.Module does"
    assert asked == [torch.device("cpu")], "the policy is asked once"


def test_an_optimizer_built_before_the_decision_updates_the_parameters(
    cpu_as_gpu: Callable[[], list[torch.device]],
) -> None:
    """The decision's cast keeps every parameter object (CPU stands in for a GPU: the move is
    ``.to("cpu")``, through ``nn.Module._apply`` as ``.to("cuda")`` is)."""
    torch.manual_seed(0)
    module = attention()
    optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
    held = list(module.parameters())
    assert floating(module) == {(torch.float32, torch.device("cpu"))}
    cpu_as_gpu()
    module.to("cpu")
    assert [p is q for p, q in zip(module.parameters(), held, strict=True)] == [True] * len(held)
    assert floating(module) == {(torch.float64, torch.device("cpu"))}
    before = [p.detach().clone() for p in held]
    x = torch.randn(1, 8, 16, dtype=torch.float64)
    module(x, x, x)[0].square().sum().backward()
    grads = [p.grad.clone() for p in held]  # type: ignore[union-attr]
    optimizer.step()
    for p, old, g in zip(held, before, grads, strict=True):
        assert torch.equal(p.detach(), old - 0.5 * g)
    assert any(bool(g.abs().sum() > 0) for g in grads)


def test_gradients_are_cast_with_their_parameters(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = attention()
    x = torch.randn(1, 8, 16)
    module(x, x, x)[0].sum().backward()
    with FakeTensorMode(allow_non_fake_inputs=True):
        module.to("cuda:0")
    grads = {(p.grad.dtype, p.grad.device) for p in module.parameters() if p.grad is not None}
    assert grads == {(torch.bfloat16, CUDA0)}


def test_parameters_that_wrap_tensors_are_refused_before_anything_moves(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """FSDP2 and tensor parallelism hold ``DTensor`` parameters (a traceable wrapper subclass,
    as torch's test ``TwoTensor`` is)."""
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = attention()
    w = module.q_proj.weight.detach()
    module.q_proj.weight = nn.Parameter(TwoTensor(w, w.clone()))
    with FakeTensorMode(allow_non_fake_inputs=True), pytest.raises(TypeError) as raised:
        module.to("cuda:0")
    message = str(raised.value)
    assert "q_proj.weight is a TwoTensor" in message and "dtype=torch.float32" in message
    assert floating(module) == {(torch.float32, torch.device("cpu"))}, "nothing moved"


@pytest.mark.parametrize("make", MODULES)
def test_parameters_placed_without_apply_are_refused_at_the_first_call(
    monkeypatch: pytest.MonkeyPatch, make: Callable[..., AutoDtype]
) -> None:
    """``load_state_dict(assign=True)`` puts a checkpoint's tensors in place of the parameters,
    without ``nn.Module._apply`` (as FSDP2's ``fully_shard`` moves CPU parameters with
    ``tensor.data = tensor.to(device)``, torch 2.13 ``_fsdp_init._move_states_to_device``)."""
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "8.0")
    module = make()
    with FakeTensorMode(allow_non_fake_inputs=True):
        on_gpu = {k: torch.empty_like(v, device="cuda:0") for k, v in module.state_dict().items()}
        module.load_state_dict(on_gpu, assign=True)
        assert floating(module) == {(torch.float32, CUDA0)}
        x = torch.empty(1, 8, 16, device="cuda:0")
        with pytest.raises(RuntimeError) as raised:
            module(x) if isinstance(module, DilatedTransformerBlock) else module(x, x, x)
    message = str(raised.value)
    assert "dtype='auto'" in message and "torch.float32 on cuda:0" in message
    assert ".to('cuda:0')" in message and "dtype=" in message


def test_a_cpu_module_given_a_gpu_input_is_told_to_move() -> None:
    module = attention()
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(1, 8, 16, device="cuda:0")
        with pytest.raises(RuntimeError, match=r"torch.float32 on cpu\).*\.to\('cuda:0'\)"):
            module(x, x, x)


def test_the_default_device_at_construction_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RINGDILATED_COMPUTE_CAPABILITY", "7.5")
    with torch.device("cuda:0"):
        assert resolve_dtype("auto", None) == torch.float16
    with torch.device("meta"):
        assert resolve_dtype("auto", None) == torch.float32
    assert resolve_dtype("auto", None) == torch.float32


def test_a_decided_cpu_module_computes_what_the_oracle_does() -> None:
    """The decision leaves the module's function alone: float64 after ``.double()``."""
    torch.manual_seed(0)
    module = attention(layer_norm=False, bias=False).double()
    x = torch.randn(2, 8, 16, dtype=torch.float64)
    q = (x @ module.q_proj.weight.T).view(2, 8, 2, 8)
    k = (x @ module.k_proj.weight.T).view(2, 8, 2, 8)
    v = (x @ module.v_proj.weight.T).view(2, 8, 2, 8)
    expected = oracle(q, k, v, [8], [1]).reshape(2, 8, 16) @ module.out_proj.weight.T
    assert torch.allclose(module(x, x, x)[0], expected, atol=1e-12)
