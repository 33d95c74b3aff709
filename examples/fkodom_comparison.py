"""Compare fkodom's dilated-attention-pytorch 0.2.0 with ringdilated's ``head_groups`` mode.

The figures in docs/migration.md ("The output normalisation of fkodom's 0.2.0") come from this
script. fkodom's package is not a dependency of ringdilated; unpack it (and einops) somewhere
throwaway and pass that directory:

    pip download dilated-attention-pytorch==0.2.0 einops==0.6.1 --no-deps -d /tmp/fk
    cd /tmp/fk && for w in *.whl; do python -m zipfile -e "$w" unpacked; done
    python examples/fkodom_comparison.py /tmp/fk/unpacked

The package imports ``xformers.ops``, and the xformers it requires (below 0.0.22) does not install
with current torch. So this script puts a stand-in for ``xformers.ops`` first on the path, which
implements ``memory_efficient_attention`` as xformers documents it (layout ``(batch, seq, heads,
dim)``, scale ``1/sqrt(dim)``, ``LowerTriangularMask`` = causal: query ``i`` sees keys
``j <= i``) with ``scaled_dot_product_attention``. fkodom's own code runs unchanged.
"""

from __future__ import annotations

import sys
import tempfile
import textwrap
from pathlib import Path

import torch

import ringdilated

STAND_IN = """
import torch.nn.functional as F

AttentionOp = object


class LowerTriangularMask:
    pass


def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, op=None):
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    causal = isinstance(attn_bias, LowerTriangularMask)
    out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal, scale=scale)
    return out.transpose(1, 2)
"""


def _import_fkodom(unpacked: str) -> type:
    stub = Path(tempfile.mkdtemp()) / "xformers"
    stub.mkdir()
    (stub / "__init__.py").write_text("")
    (stub / "ops.py").write_text(textwrap.dedent(STAND_IN))
    sys.path[:0] = [str(stub.parent), unpacked]
    from dilated_attention_pytorch.dilated_attention import DilatedAttention

    return DilatedAttention  # type: ignore[no-any-return]


def main(unpacked: str) -> None:
    fkodom = _import_fkodom(unpacked)
    g = torch.Generator().manual_seed(0)
    segments, rates = [2048, 4096, 8192], [1, 2, 4]
    q, k, v = (torch.randn(1, 8192, 6, 64, generator=g, dtype=torch.float64) for _ in range(3))
    groups = len(segments)
    for causal in (False, True):
        theirs = fkodom(segments, rates)(q, k, v, is_causal=causal)
        out = ringdilated.dilated_attention(q, k, v, segments, rates, causal=causal)
        recipe = out / out.sum(dim=1, keepdim=True) / groups
        print(
            f"causal={causal}: max|fkodom - out/G| = {(theirs - out / groups).abs().max():.2f}, "
            f"max|fkodom - recipe| = {(theirs - recipe).abs().max():.1e}, "
            f"max|fkodom| = {theirs.abs().max():.2f}"
        )
    scaled = fkodom(segments, rates, softmax_scale=0.01)(q, k, v)
    unchanged = torch.equal(scaled, fkodom(segments, rates)(q, k, v))
    print(f"softmax_scale=0.01 changes nothing: {unchanged}")

    q, k, v = (torch.randn(1, 64, 8, 8, generator=g, dtype=torch.float64) for _ in range(3))
    theirs = fkodom([16, 32, 64], [1, 2, 4])(q, k, v)
    out = ringdilated.dilated_attention(q, k, v, [16, 32, 64], [1, 2, 4])
    miss = (theirs - out / out.sum(dim=1, keepdim=True) / 3).abs().amax(dim=(0, 1, 3))
    print("H=8, G=3: per-head max|fkodom| ", [f"{x:.2f}" for x in theirs.abs().amax((0, 1, 3))])
    print("H=8, G=3: per-head max|fkodom - recipe| ", [f"{x:.0e}" for x in miss])

    q, k, v = (torch.randn(1, 64, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    attention = fkodom([16, 64], [1, 2])
    later = v.clone()
    later[:, -1] += 1.0
    moved = attention(q, k, v, is_causal=True) - attention(q, k, later, is_causal=True)
    earlier = float(moved[:, :-1].abs().max())
    print(f"is_causal=True: changing the last value moves earlier positions by up to {earlier:.2f}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: python {sys.argv[0]} UNPACKED_DIR  (see the module docstring)")
    main(sys.argv[1])
