"""Aggregation gives the same bits on every CPU kernel torch may pick.

A child interpreter forced onto the portable kernel (``ATEN_CPU_CAPABILITY=default``)
aggregates the same deltas as this process, which uses the best kernel the CPU has.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from typing import Any

_DIGEST_CODE = textwrap.dedent(
    """
    import hashlib, numpy, torch
    from coordinator.aggregation.weighted import aggregate
    class P:
        def __init__(self, name, offset, values):
            self.name, self.offset, self.count, self.values = name, offset, values.numel(), values
    def d(seed):
        # numpy, not torch.randn: torch's normal sampler itself differs between kernels.
        rng = numpy.random.default_rng(seed)
        return torch.from_numpy(rng.standard_normal(10_007, dtype=numpy.float32))
    def digest():
        weights = [("aa", 1e6), ("bb", 3e6), ("cc", 7e5)]
        src = {r: (w, lambda s=s: [P("w", 0, d(s))]) for s, (r, w) in enumerate(weights)}
        out = aggregate({"w": (10_007,)}, src)["w"]
        return hashlib.sha256(out.numpy().tobytes()).hexdigest()
    """
)


def test_portable_cpu_kernel_gives_the_same_bits() -> None:
    # A coordinator restarted on a CPU without AVX2 must re-aggregate to the same bits:
    # no fused multiply-add is allowed in the aggregation arithmetic.
    namespace: dict[str, Any] = {}
    exec(_DIGEST_CODE, namespace)
    here = namespace["digest"]()
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"}
    env["ATEN_CPU_CAPABILITY"] = "default"
    portable = subprocess.run(
        [sys.executable, "-c", _DIGEST_CODE + "\nprint(digest())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert len(here) == 64
    assert portable == here
