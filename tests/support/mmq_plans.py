"""Prints, as JSON, mmq.py's launch plans (mmq.plan) and scratch sizes (mmq.need_scratch, each shape's) of a few
models' projections at 1 to M_MAX rows on each device of support.devices, under the token-tile limit
its blocks allow for each kind of records (dispatch.smem_limits: SmemLimits.mmq_bn_max) and under
none (plan's default): the inputs of tests/kernels/test_mmq_plan.py's checks where CuPy is absent.
Run as a script in a process of its own: it puts a bare `cupy` module in sys.modules, which mmq.py
imports but its planning never calls (as launch_record.py does), so no other test may share its
process."""

from __future__ import annotations

import json
import sys
import types

M_MAX = 256
SMS = 132
# (K, output rows of each segment, ffn): Qwen2.5-1.5B's Q/K/V, down projection, gate / up and LM head;
# Llama-3-8B's Q/K/V, gate / up and down projection
SHAPES = [(1536, (1536, 256, 256), False), (8960, (1536,), False), (1536, (8960,), True), (1536, (151936,), False),
          (4096, (4096, 1024, 1024), False), (4096, (14336,), True), (14336, (4096,), False)]


def main() -> None:
    if "cupy" not in sys.modules:
        try:
            import cupy  # noqa: F401
        except ImportError:
            sys.modules["cupy"] = types.ModuleType("cupy")
    from realizar_backend.backends.cuda import mmq
    from realizar_backend.backends.cuda.dispatch import smem_limits
    from support.devices import SMEM_OPTIN

    def plans(bn_max: int) -> list:
        return [[M, s, *(getattr(p, f) for f in ("bn", "tiles", "token_tiles", "splits", "cps", "partial_floats",
                                                 "counters"))]
                for M in range(1, M_MAX + 1) for s, (K, rows, ffn) in enumerate(SHAPES)
                for p in (mmq.plan(M, K, rows, ffn, SMS, bn_max=bn_max),)]

    def scratch(bn_max: int) -> list:        # each shape's alone: a model of that shape only
        return [mmq.need_scratch(M_MAX, [shape], SMS, (bn_max,)) for shape in SHAPES]

    out = {"shapes": SHAPES, "today": plans(mmq.MMQ_BN[-1]), "scratch_today": scratch(mmq.MMQ_BN[-1]), "devices": {}}
    for arch, optin in SMEM_OPTIN.items():
        lim = smem_limits(optin)
        out["devices"][arch] = {
            "optin": optin,
            **{("a8" if a8 else "fp16"): {"bn_max": lim.mmq_bn_max(a8), "plans": plans(lim.mmq_bn_max(a8)),
                                          "scratch": scratch(lim.mmq_bn_max(a8))}
               for a8 in (False, True)}}
    out["smem"] = {bn: [mmq.mmq_smem_bytes(bn), mmq.mmq_smem_bytes(bn, True)] for bn in mmq.MMQ_BN}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
