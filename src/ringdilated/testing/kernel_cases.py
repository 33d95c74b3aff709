"""The problems the kernel conformance kit draws, and the float64 references it judges them by.

A :class:`KernelCase` is one kernel-level problem: ``q (n, heads, q_len, D)`` against
``k, v (n, kv_heads, k_len, D)`` with a scale and a key window (the block's
:class:`~ringdilated.core.plan.window.KeyWindow`). Real kernels break where shape-only tests
never look, so :func:`kernel_cases` draws, within what a backend declares:

- key windows as the driver hands them to blocks: right bounds on, above and below the
  diagonal (causal blocks, their row chunks, other ranks' pieces), and, for a kernel declaring
  ``sliding_window``, left bounds too: bands of any width about any diagonal (a sliding window's
  blocks, shifted into row chunks and into another rank's piece), so that rows at the start
  (``right < 0``), at the end (``left`` below their reach) or all of them see no key;

- lengths around and past the usual tile sizes: most draws are 1 to 24 long, others 25 to 128,
  on a tile boundary (31-33, 63-65, 127-129, 191-193, 255-257), or 129 to 300; about one length
  in five is above 128;
- every head dim the backend declares, up to 256 (most draws small, about one in five large);
- the strided inputs the driver really passes (``layout="strided"``): dilated selections of a
  ``(n, L, H, D)`` buffer, so the sequence stride is ``rate * H * D`` and heads are a slice of a
  larger head dimension; and contiguous ``(n, heads, L, D)`` inputs (``layout="contiguous"``);
- batches of 1 to 5 problems;
- with ``softcap=True``, a logit cap (docs/spec.md, section 5): one case in three has ``q``
  amplified 30 times against a cap of 0.5 to 4, so that most scores lie far past the cap, where
  ``tanh`` saturates and its derivative nearly vanishes.

:class:`CaseSpace` bounds all of this; the default is the kit's, and a narrower one shows what a
dimension catches (a wrong kernel that passes without it and fails with it).
"""

from __future__ import annotations

import warnings

import attrs
import torch
from hypothesis import strategies as st

from ringdilated.core.contract.kernel import BlockOptions
from ringdilated.core.plan.window import FULL, KeyWindow
from ringdilated.core.select.capabilities import Environment, KernelSpec, Request
from ringdilated.testing._oracle import masked_attention, scaled_scores

__all__ = [
    "DEFAULT_SPACE",
    "LAYOUTS",
    "CaseSpace",
    "KernelCase",
    "contract_backward",
    "dense",
    "kernel_cases",
]

LAYOUTS = ("contiguous", "strided")


@attrs.frozen
class CaseSpace:
    """Bounds of the drawn problems.

    ``max_len``: longest ``q_len``/``k_len``; lengths above ``short_len`` come from the tile-size
    mix in the module docstring (none when ``max_len <= short_len``). ``max_head_dim``: the
    largest head dim drawn (the backend's own limit applies too); head dims above
    ``small_head_dim`` are drawn about one time in ``large_every``.
    ``layouts``: which input layouts to draw. ``max_batch``: the largest ``n``. ``max_work``
    bounds ``n * heads * q_len * k_len * head_dim`` of one problem (the float64 references cost
    that much), so long blocks and large head dims come with fewer heads and problems: every
    dimension is reached, not all of them at once.
    """

    max_len: int = 300
    short_len: int = 24
    max_head_dim: int = 256
    small_head_dim: int = 64
    large_every: int = 5
    layouts: tuple[str, ...] = LAYOUTS
    max_batch: int = 5
    max_work: int = 1 << 25

    def __attrs_post_init__(self) -> None:
        unknown = set(self.layouts) - set(LAYOUTS)
        if unknown or not self.layouts:
            raise ValueError(f"layouts must be a non-empty subset of {LAYOUTS}, got {self.layouts}")


DEFAULT_SPACE = CaseSpace()


_UNSET = object()


@attrs.frozen(init=False)
class KernelCase:
    """One kernel-level problem: ``q (n, heads, q_len, D)``, ``k, v (n, kv_heads, k_len, D)``,
    each in ``layout`` (:meth:`lay_out`), key ``j`` visible to query ``i`` under ``window``;
    ``q`` drawn ``amplitude`` times larger than ``k`` and ``v`` (scores past a ``softcap``);
    ``softcap`` the logit cap (``None``: none).

    ``causal_offset`` (0.1: ``window.right``, an int or ``None``, in ``window``'s place or by
    name, also in ``attrs.evolve``, where it replaces the window by ``KeyWindow(None,
    causal_offset)``) is accepted and read for one release with a ``DeprecationWarning``."""

    n: int
    heads: int
    kv_heads: int
    q_len: int
    k_len: int
    head_dim: int
    dtype: torch.dtype
    scale: float
    window: KeyWindow
    seed: int
    device: str = "cpu"
    layout: str = "contiguous"
    rate: int = 1
    offset: int = 0
    softcap: float | None = None
    amplitude: float = 1.0

    def __init__(
        self,
        n: int,
        heads: int,
        kv_heads: int,
        q_len: int,
        k_len: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float,
        window: KeyWindow | int | None = FULL,
        seed: int = 0,
        device: str = "cpu",
        layout: str = "contiguous",
        rate: int = 1,
        offset: int = 0,
        softcap: float | None = None,
        amplitude: float = 1.0,
        *,
        causal_offset: object = _UNSET,
    ) -> None:
        if causal_offset is not _UNSET or not isinstance(window, KeyWindow):
            _deprecated_offset()
            right = window if causal_offset is _UNSET else causal_offset
            window = KeyWindow(None, right)
        self.__attrs_init__(
            n, heads, kv_heads, q_len, k_len, head_dim, dtype, scale, window, seed, device,
            layout, rate, offset, softcap, amplitude,
        )  # fmt: skip

    @property
    def causal_offset(self) -> int | None:
        """Deprecated: ``window.right``."""
        _deprecated_offset()
        return self.window.right

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(self.seed)
        kv_shape = (self.n, self.kv_heads, self.k_len, self.head_dim)
        shapes = ((self.n, self.heads, self.q_len, self.head_dim), kv_shape, kv_shape)
        q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)
        q = q * self.amplitude
        return tuple(self.lay_out(x.to(self.device, self.dtype)) for x in (q, k, v))  # type: ignore[return-value]

    def lay_out(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (``(n, heads, L, D)``, or an lse ``(n, heads, L)``) in this case's layout: as is,
        or a copy in a strided view of a NaN-filled buffer (every ``rate``-th position from
        ``offset``, heads ``1 .. heads``), exactly as :mod:`ringdilated.core.run.local` selects
        from its ``(B, L, H, D)`` tensors and ``(B, H, L)`` lse for a kernel (a kernel that reads
        outside the view gets NaN, never plausible numbers)."""
        if self.layout == "contiguous":
            return x
        n, heads, length = x.shape[:3]
        span = self.offset + (length - 1) * self.rate + 1
        if x.dim() == 3:
            buffer = torch.full((n, heads + 1, span), float("nan"), dtype=x.dtype, device=x.device)
            view = buffer[:, 1:, self.offset :: self.rate]
        else:
            shape = (n, span, heads + 1, x.shape[3])
            buffer = torch.full(shape, float("nan"), dtype=x.dtype, device=x.device)
            view = buffer[:, self.offset :: self.rate, 1:].transpose(1, 2)
        return view.copy_(x)

    def options(self) -> BlockOptions:
        return BlockOptions(self.scale, self.window, softcap=self.softcap)


def _deprecated_offset() -> None:
    warnings.warn(
        "KernelCase.causal_offset is deprecated: use window=KeyWindow(None, offset) and "
        "window.right (ringdilated.core.KeyWindow)",
        DeprecationWarning,
        stacklevel=3,
    )


#: Lengths on either side of the 32-, 64- and 128-row tiles fused kernels use.
TILE_BOUNDARIES = (31, 32, 33, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257)


def _length(d: st.DrawFn, space: CaseSpace) -> int:
    short = min(space.short_len, space.max_len)
    if space.max_len <= short:
        return d(st.integers(1, short))
    kind = d(st.integers(1, 10))
    boundaries = [n for n in TILE_BOUNDARIES if short < n <= space.max_len]
    if kind <= 2 and boundaries:
        return d(st.sampled_from(boundaries))
    if kind == 3:
        return d(st.integers(short + 1, min(128, space.max_len)))
    if kind <= 5 and space.max_len > 128:
        return d(st.integers(129, space.max_len))
    return d(st.integers(1, short))


def _head_dim(d: st.DrawFn, multiple: int, limit: int, space: CaseSpace) -> int:
    top = max(1, min(limit, space.max_head_dim) // multiple)
    small = max(1, min(top, space.small_head_dim // multiple))
    if top > small and d(st.integers(1, space.large_every)) == 1:
        return multiple * d(st.integers(small + 1, top))
    return multiple * d(st.integers(1, small))


def kernel_cases(
    spec: KernelSpec,
    device: str = "cpu",
    env: Environment | None = None,
    *,
    causal: bool | None = None,
    backward: bool = True,
    space: CaseSpace = DEFAULT_SPACE,
    dropout: bool = False,
    softcap: bool = False,
) -> st.SearchStrategy[KernelCase]:
    """Problems ``spec`` declares it supports on ``device`` (its reasons are empty for them).

    ``causal``: ``True`` draws only windows with a bound (a right bound always; with
    ``sliding_window`` declared, a left bound too, half the time), ``False`` none, ``None``
    either (as declared). ``backward``: draw only problems whose request needs (and the backend
    declares) gradients; ``dropout``: the same for dropout; ``softcap``: the same for a logit
    cap (see the module docstring: one case in three saturates it).
    """
    env = env or Environment.from_environ()
    capability = env.capability(torch.device(device))
    targets = [t for t in spec.capabilities.targets if t.device_type == device]
    if not targets:
        raise ValueError(f"kernel {spec.name!r} declares no target on {device!r}")

    @st.composite
    def draw(d: st.DrawFn) -> KernelCase:
        dtype = d(st.sampled_from(sorted({dt for t in targets for dt in t.dtypes}, key=str)))
        multiple = max(t.head_dim_multiple for t in targets)
        limit = min((t.max_head_dim for t in targets if t.max_head_dim), default=256)
        head_dim = _head_dim(d, multiple, limit, space)
        q_len, k_len = _length(d, space), _length(d, space)
        room = max(1, space.max_work // (q_len * k_len * head_dim))  # for n * heads
        kv_heads = d(st.integers(1, max(1, min(3, room))))
        groups = min(3, room // kv_heads) if spec.capabilities.gqa else 1
        heads = kv_heads * d(st.integers(1, max(1, groups)))
        max_n = max(1, min(space.max_batch, room // heads))
        window = _window(d, spec, causal, q_len, k_len)
        layout = d(st.sampled_from(space.layouts))
        strided = layout == "strided"
        cap, amplitude = None, 1.0
        if softcap:
            saturated = d(st.integers(0, 2)) == 0
            amplitude = 30.0 if saturated else 1.0
            cap = d(st.floats(0.5, 4.0) if saturated else st.floats(0.5, 50.0))
        case = KernelCase(
            n=d(st.integers(1, max_n)),
            heads=heads,
            kv_heads=kv_heads,
            q_len=q_len,
            k_len=k_len,
            head_dim=head_dim,
            dtype=dtype,
            scale=d(st.floats(0.05, 1.0)),
            window=window,
            seed=d(st.integers(0, 2**31 - 1)),
            device=device,
            layout=layout,
            rate=d(st.integers(1, 3)) if strided else 1,
            offset=d(st.integers(0, 2)) if strided else 0,
            softcap=cap,
            amplitude=amplitude,
        )
        request = Request(
            device_type=device,
            dtype=dtype,
            head_dim=head_dim,
            compute_capability=capability,
            window=window,
            gqa=heads != kv_heads,
            backward=backward,
            dropout=dropout,
            softcap=cap,
        )
        d(st.just(None).filter(lambda _: not spec.reasons(request, env)))
        return case

    return draw()


def _window(
    d: st.DrawFn, spec: KernelSpec, causal: bool | None, q_len: int, k_len: int
) -> KeyWindow:
    """The block window drawn for ``spec`` (see :func:`kernel_cases`' ``causal``): a right
    bound from just above every key to just below every query (rows at the start see no key),
    drawn as 0.1 drew its causal offset (so a kernel without sliding windows gets 0.1's cases);
    where ``sliding_window`` is declared, then a left bound half the time, drawn as the band's
    width ``left + right`` (from ``-1``, no key seen by any row, past every key), so bands lie
    about every diagonal and rows at the end may see no key; with no right bound, a left bound
    alone from just past the keys' end to just past every row."""
    caps = spec.capabilities
    offsets: st.SearchStrategy[int | None] = st.integers(-q_len - 1, k_len + 1)
    if causal is None:
        offsets = st.none() | offsets if caps.causal else st.none()
    elif not causal or not caps.causal:
        offsets = st.none()
    right = d(offsets)
    if causal is False or not caps.sliding_window:
        return KeyWindow(None, right)
    left = None
    if d(st.booleans()) or (causal and right is None):  # a bound, always, for ``causal``
        if right is None:
            left = d(st.integers(-k_len - 1, q_len + 1))
        else:
            left = d(st.integers(-1, q_len + k_len)) - right
    return KeyWindow(left, right)


def _visible(
    q_len: int, k_len: int, window: KeyWindow | int | None, device: torch.device
) -> torch.Tensor:
    """``(q_len, k_len)`` bool: key ``j`` visible to query ``i`` under ``window`` (an int or
    ``None``: 0.1's right bound)."""
    if not isinstance(window, KeyWindow):
        window = KeyWindow(None, window)
    rows = torch.arange(q_len, device=device).unsqueeze(1)
    cols = torch.arange(k_len, device=device).unsqueeze(0)
    visible = torch.ones(q_len, k_len, dtype=torch.bool, device=device)
    if window.left is not None:
        visible &= cols >= rows - window.left
    if window.right is not None:
        visible &= cols <= rows + window.right
    return visible


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: KeyWindow | int | None,
    dtype: torch.dtype = torch.float64,
    drop: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel-layout dense attention in ``dtype`` under the contract's key window (autograd):
    :func:`ringdilated.testing.masked_attention` with key ``j`` visible to query ``i`` when
    ``i - left <= j <= i + right`` (``window``; an int or ``None``: 0.1's causal offset, the
    right bound alone), each probability scaled by ``drop`` (a dropout mask ``keep / (1 -
    p)``, broadcastable to the scores) when given, every score capped by ``softcap`` when
    given. Exact for non-finite inputs, as the oracle is.
    """
    visible = _visible(q.shape[2], k.shape[2], window, q.device)
    return masked_attention(q, k, v, visible, scale, dtype, drop=drop, softcap=softcap)


def contract_backward(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float,
    window: KeyWindow | int | None,
    dtype: torch.dtype = torch.float64,
    drop: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel contract's backward in plain dense ops in ``dtype``, given ``out`` and ``lse``.

    ``P = exp(scale * q k^T - lse)``, ``D = rowsum(dout * out)``, ``dS = P * (dout v^T - D)``;
    with a dropout mask ``drop`` (``keep / (1 - p)``), ``dout v^T`` is scaled by it and ``dv``
    takes ``P * drop``. With ``softcap`` ``c``, the score is ``c * tanh(s / c)`` of
    ``s = scale * q k^T`` and ``dS`` is multiplied by its derivative ``1 - tanh(s / c)^2``.
    In float64 this is what an exact kernel returns: its distance from the true gradient is
    what the contract's own rounding of ``out`` (to the input dtype) and ``lse`` (to float32)
    costs any kernel. In the input dtype it is the plain dense computation of the same
    gradient, with the cancellation in ``dout v^T - D`` that fused kernels share.
    """
    group = q.shape[1] // k.shape[1]
    kd, vd = (x.to(dtype).repeat_interleave(group, 1) for x in (k, v))
    s = scaled_scores(q, k, scale, dtype)
    slope = None
    if softcap is not None:
        tanh = torch.tanh(s / softcap)
        s, slope = tanh * softcap, 1.0 - tanh * tanh
    visible = _visible(s.shape[-2], s.shape[-1], window, q.device)
    lse_d = lse.to(dtype)
    finite = torch.where(torch.isneginf(lse_d), torch.zeros_like(lse_d), lse_d)
    p = torch.exp(s - finite.unsqueeze(-1)).masked_fill(~visible, 0.0)
    do = dout.to(dtype)
    delta = (do * out.to(dtype)).sum(-1, keepdim=True)
    dp = do @ vd.transpose(-1, -2)
    dropped = p
    if drop is not None:
        dp, dropped = dp * drop.to(dtype), p * drop.to(dtype)
    ds = p * (dp - delta) * scale
    if slope is not None:
        ds = ds * slope
    n, kv_heads, k_len, dim = k.shape

    def fold(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(n, kv_heads, group, k_len, dim).sum(2)

    return ds @ kd, fold(ds.transpose(-1, -2) @ q.to(dtype)), fold(dropped.transpose(-1, -2) @ do)
