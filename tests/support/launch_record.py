"""Runs the CUDA launchers (backends/cuda ops.py, mmq.py, experts.py) on the CPU against recording
stand-ins for their RawKernels and prints each launch as JSON: kernel name, grid, block, the
arguments' NumPy types and values, dynamic shared memory. Run as a script in a process of its own
(tests/kernels/test_launch_signatures.py): it puts a bare `cupy` module in sys.modules, which the
launchers import but these launches never call, so no other test may share its process."""

from __future__ import annotations

import json
import sys
import types
from types import SimpleNamespace as NS


class Rec:
    """A RawKernel that records its launches (the attributes _max_grid's fallback reads)."""

    num_regs, shared_size_bytes, kernel = 64, 0, None

    def __init__(self, name: str, log: list, smem_limit: int = 48 * 1024):
        self.name, self.log, self.smem_limit = name, log, smem_limit

    def __call__(self, grid, block, args, shared_mem: int = 0):
        self.log.append({"kernel": self.name, "grid": [int(g) for g in grid], "block": [int(b) for b in block],
                         "args": [[a.dtype.str, a.item()] for a in args], "smem": int(shared_mem),
                         "smem_limit": self.smem_limit})


def _ptr(n: int, size: int = 1, shape: tuple = (1,)) -> NS:
    """A device array stand-in: its pointer, and the size / shape the launchers check."""
    return NS(data=NS(ptr=0x10000 * n), size=size, shape=shape)


def main() -> None:
    sys.modules["cupy"] = types.ModuleType("cupy")
    from gguf import GGMLQuantizationType as Q

    from realizar_backend.backends.cuda import experts, flash, mmq, ops
    from realizar_backend.backends.cuda.matrices import WeightRef
    from realizar_backend.backends.cuda.modules import MMQ_BN, mmq_smem_bytes
    from realizar_backend.backends.cuda.support import DN_DELTA_K
    from realizar_backend.formats.gpu_layout import device_row_bytes

    log: list = []
    # the Kernels mappings of modules.py, each name the function modules.py loads for that key
    k = NS(sm_count=132,
           mmv8={**{n: Rec(f"{n}_nb1", log)
                    for n in ("mmv8", "ffn8", "moe8_gate_up", "moe8_gemv", "moe8_down_combine")},
                 "q8": Rec("mmv8_q8", log)},
           mmv8_xq=lambda nbytes: 0x7000000,          # Kernels.mmv8_xq: the device's scratch rows
           moe={"bucket_count": Rec("moe_bucket_count", log), "bucket_fill": Rec("moe_bucket_fill", log),
                "combine": Rec("moe_combine", log)},
           mmq={"prep": Rec("mmq_prep", log), **{bn: Rec(f"mmq_bn{bn}", log, mmq_smem_bytes(bn)) for bn in MMQ_BN},
                **{("moe", bn): Rec(f"mmq_moe_bn{bn}", log, mmq_smem_bytes(bn)) for bn in MMQ_BN}},
           mmq8={"prep": Rec("mmq8_prep", log),
                 **{bn: Rec(f"mmq8_bn{bn}", log, mmq_smem_bytes(bn, True)) for bn in MMQ_BN},
                 **{("moe", bn): Rec(f"mmq8_moe_bn{bn}", log, mmq_smem_bytes(bn, True)) for bn in MMQ_BN}},
           gemv={q: Rec(f"gemv_{n}", log) for q, n in ((Q.F32, "f32"), (Q.F16, "f16"), (Q.BF16, "bf16"))},
           ffn_gate_up={q: Rec(f"ffn_gate_up_{n}", log) for q, n in ((Q.F32, "f32"), (Q.F16, "f16"), (Q.BF16, "bf16"))},
           attn_decode=Rec("attn_decode", log),
           deltanet={"conv": Rec("dn_conv", log),
                     **{n: Rec(n, log) for n in ["dn_delta"] + [f"dn_{kind}_k{d}" for kind in ("delta", "chunk")
                                                                for d in DN_DELTA_K]}})

    def w(name, qt, rows, cols, ptr, experts=0):
        return WeightRef(name, qt, 0x100000 * ptr, rows, cols, device_row_bytes(qt, cols), experts)

    # gemv.cu: few long rows (mixture-of-experts routers, a shared expert's one-row gate), several
    # activation rows, a large dense matrix, an odd shape (the units path); the fused gate/up
    for qt, rows, cols, nb in ((Q.F32, 128, 2048, 1), (Q.F32, 32, 2880, 1), (Q.F32, 1, 2048, 1), (Q.F16, 1, 2048, 3),
                               (Q.BF16, 128, 2048, 11), (Q.F16, 151936, 1536, 1), (Q.BF16, 33, 37, 11)):
        ops.gemv(k, w("r", qt, rows, cols, 13), 0x4000, cols, 0x8000, rows, nb, bias=0x9000 if nb == 1 else 0,
                 accumulate=nb == 11)
    for qt, rows, cols, nb in ((Q.F16, 131, 896, 9), (Q.F32, 8, 4096, 1), (Q.BF16, 8960, 1536, 1)):
        ops.ffn_gate_up(k, w("g", qt, rows, cols, 14), w("u", qt, rows, cols, 15), 0x4000, cols, 0x8000, rows, nb, 0)
    # mmv8.cu: one and three segments, the folded norm and argmax; ffn8
    K = 4096
    segs = [(w("q", Q.Q4_K, 4096, K, 1), 0, 0x2000, 4096)]
    ops.mmvf(k, segs, K, 0x4000, K, 1, norm=(0x5000, 1e-6), amax=0x6000, q8=True)
    segs3 = [(w("q", Q.Q4_K, 37, K, 1), 0x1000, 0x2000, 40), (w("k", Q.Q6_K, 5, K, 2), 0, 0x3000, 8),
             (w("v", Q.Q8_0, 5, K, 3), 0, 0x3800, 8)]
    ops.mmvf(k, segs3, K, 0x4000, K + 4, 1, accumulate=True, q8=True)
    ops.ffn_f(k, w("g", Q.Q4_K, 11008, K, 4), w("u", Q.Q4_K, 11008, K, 5), 0x4000, K, 0x7000, 11008, 1, 0,
              norm=(0x5000, 1e-6), q8=True)
    # the grouped experts: bucketing, prep, the gate/up and down tiles (widths 8, 16, 32, 64), on fp16
    # and on 8-bit records
    E, F, H, top = 64, 768, 2048, 8
    gate, up = w("g", Q.Q4_K, F, H, 6, E), w("u", Q.Q4_K, F, H, 7, E)
    down = w("d", Q.Q6_K, H, F, 8, E)
    for a8 in (False, True):
        for T in (3, 100, 200, 300):
            bn, TB = experts.moe_grouped_plan(T, top, E)
            slots = bn * TB
            recs = (NS(M=T, K=H, rec=_ptr(5), inv=_ptr(6), filled=(0, 0), a8=a8),
                    NS(M=slots, K=F, rec=_ptr(7), inv=_ptr(8), filled=(0, 0), a8=a8))
            buf = NS(cnt=_ptr(1), lst=_ptr(2, slots), tiles=_ptr(3, 3 * TB, (TB, 3)), a=_ptr(4),
                     records=lambda _a8, r=recs: r)
            experts.expert_groups(k, gate, up, down, 0x9000, top, T, 0xa000, H, 0xb000, 2 * F, 0, buf,
                                  (0x1100, 0x1200, 0x1300), a8)
    # the one-row pairs on mmv8.cu (gate and up fused, then the down projection of each pair's row):
    # its rows into y, and (as the model runs it) with the combine into the residual in its launch, at
    # Qwen3-30B-A3B's shapes and gpt-oss's (32 experts of [2880, 2880], top 4)
    experts.expert_pairs8(k, gate, up, down, 0x9000, top, 1, 0xa000, H, 0xb000, 0xc000, 2 * F, 0,
                          (0x1100, 0x1200, 0x1300))
    experts.expert_pairs8(k, gate, up, down, 0x9000, top, 1, 0xa000, H, 0xb000, 0xc000, 2 * F, 0,
                          (0x1100, 0x1200, 0x1300), (0xd000, H + 4, 0xd800))
    G = 2880
    og, ou, od = (w(n, Q.MXFP4, G, G, 13 + i, 32) for i, n in enumerate("gud"))
    experts.expert_pairs8(k, og, ou, od, 0x9000, 4, 1, 0xa000, G, 0xb000, 0xc000, 2 * G, 2,
                          (0x1100, 0x1200, 0x1300), (0xd000, G, 0xd800))
    # 32 pairs of 4096-value rows: more than a block's shared memory holds (dispatch.moe8_combine_ok),
    # so the down projection's rows, then moe_combine
    big = w("d", Q.Q4_K, 1024, 4096, 16, 64)
    experts.expert_pairs8(k, w("g", Q.Q4_K, 4096, 1024, 17, 64), w("u", Q.Q4_K, 4096, 1024, 18, 64), big, 0x9000, 32,
                          1, 0xa000, 1024, 0xb000, 0xc000, 8192, 0, combine=(0xd000, 1024, 0xd800))
    # a device whose blocks hold 99 KB (sm_86, sm_89: dispatch.smem_limits), its launches tagged with it:
    # mmv8 and ffn8 without the Q4_K ring; a one-row input of 23,552 values, staged at 100 KB, read from
    # global memory there (no staging); too much refused by name before any launch
    from realizar_backend.backends.cuda.dispatch import smem_limits
    optin = 101_376
    k99 = NS(**vars(k), smem=smem_limits(optin))
    first = len(log)
    ops.mmvf(k99, segs, K, 0x4000, K, 1, norm=(0x5000, 1e-6), amax=0x6000, q8=True)
    ops.ffn_f(k99, w("g", Q.Q4_K, 11008, K, 4), w("u", Q.Q4_K, 11008, K, 5), 0x4000, K, 0x7000, 11008, 1, 0,
              norm=(0x5000, 1e-6), q8=True)
    KL = 23552
    assert ops.mmvf_stage_ok(KL, 1) and not ops.mmvf_stage_ok(KL, 1, k99.smem.mmvf_rows)
    assert ops._stage_args(None, KL, 1, k99.smem.mmvf_rows)[3] == 0
    for L in log[first:]:
        L["smem_optin"] = optin
    for call, name in ((lambda: ops.moe8_down_combine(k99, big, 0x9000, 20, 1, 0xa000, 4096, 0xd000, 1024, 0xd800),
                        "moe8_down_combine_nb1"),
                       (lambda: ops.mmvf(k99, [(w("x", Q.Q4_K, 64, 81920, 20), 0, 0x2000, 64)], 81920, 0x4000, 81920,
                                         1, q8=True), "mmv8_nb1")):
        try:
            call()
        except ValueError as e:
            assert name in str(e) and str(k99.smem.mmv8_rows) in str(e), e
        else:
            raise AssertionError(f"{name}: a launch past the device's shared memory was not refused")
    assert len(log) == first + 4, log[first:]
    # mmq.cu's tiles of dense projections (Q/K/V segments; the fused gate and up), on sm_90's plan
    # (every width of both variants) and on the 99 KB device, each scratch sized by need_scratch
    # under the limit of the device and records it serves (mmq.bn_limits): there a 64-row step of fp16
    # records takes two 32-token tiles, of 8-bit records one of 64; the grouped experts' fp16 tiles at
    # most 32 high; a 64-token fp16 tile asked for outright refused by name (mmq._block_fits)
    K = 1536
    qkv = [(w("q", Q.Q4_K, 1536, K, 21), 0x1000, 0x2000, 1536), (w("k", Q.Q4_K, 256, K, 22), 0x1100, 0x3000, 256),
           (w("v", Q.Q4_K, 256, K, 23), 0x1200, 0x3800, 256)]
    fg, fu = w("g", Q.Q4_K, 8960, K, 24), w("u", Q.Q4_K, 8960, K, 25)
    shapes = [(K, (1536, 256, 256), False), (K, (8960,), True)]
    for kx in (k, k99):
        first = len(log)
        for a8 in (False, True):
            part, cnt = mmq.need_scratch(64, shapes, kx.sm_count, mmq.bn_limits(kx, (a8,)))
            sc = NS(part=_ptr(9, part), cnt=_ptr(10, cnt))
            for M in (5, 13, 29, 64):
                p = NS(M=64, K=K, rec=_ptr(5), inv=_ptr(6), filled=(M, K), a8=a8)
                mmq.mmq(kx, qkv, K, p, M, sc, small=False)
            mmq.mmq_ffn(kx, fg, fu, p, 64, 0, 0x7000, 8960, sc, small=False)
        if kx is k99:
            E, T = 64, 300
            for a8 in (False, True):
                bn, TB = experts.moe_grouped_plan(T, top, E, mmq.bn_limits(k99, (a8,))[0])
                recs = (NS(M=T, K=H, rec=_ptr(5), inv=_ptr(6), filled=(0, 0), a8=a8),
                        NS(M=bn * TB, K=F, rec=_ptr(7), inv=_ptr(8), filled=(0, 0), a8=a8))
                buf = NS(cnt=_ptr(1), lst=_ptr(2, bn * TB), tiles=_ptr(3, 3 * TB, (TB, 3)), a=_ptr(4),
                         records=lambda _a8, r=recs: r)
                experts.expert_groups(k99, gate, up, down, 0x9000, top, T, 0xa000, H, 0xb000, 2 * F, 0, buf,
                                      (0x1100, 0x1200, 0x1300), a8)
            for L in log[first:]:
                L["smem_optin"] = optin
    p = NS(M=64, K=K, rec=_ptr(5), inv=_ptr(6), filled=(64, K), a8=False)
    wide = mmq.plan(64, K, (1536, 256, 256), False, k99.sm_count)
    first = len(log)
    try:
        mmq._launch_mmq(k99, wide, [], K, p, 64, 0, 0, False, NS(part=_ptr(9, 1 << 30), cnt=_ptr(10, 1 << 20)), 0,
                        False)
    except ValueError as e:
        assert "mmq_bn64" in str(e) and str(optin) in str(e), e
    else:
        raise AssertionError("mmq_bn64: a tile past the device's shared memory was not refused")
    assert wide.bn == 64 and len(log) == first, log[first:]
    # the Gated DeltaNet: conv, the delta rule for each kernel
    rows = ops.StepRows(0xc000, 0xd000, 7, 9)
    ops.dn_conv(k, 0xe000, 8192, 0xf000, 3, 0x11000, rows, 8192, 0x12000, 8192)
    for dk, dv in ((128, 128), (64, 96), (32, 32), (96, 256)):
        ops.dn_delta(k, 0x12000, 8192, 0x13000, 0x14000, 32, 0x15000, 4096, 0x16000, 0x17000, 0x18000, 0x19000,
                     rows, 16, dk, 32, dv, 1e-6, 0x1a000, 4096)
    # the chunked rule's pair (dn_chunk_k<dk>, then dn_delta_k<dk>) at the instances' k_dims
    for dk, dv in ((128, 128), (64, 96), (32, 64)):
        ops.dn_delta(k, 0x12000, 8192, 0x13000, 0x14000, 32, 0x15000, 4096, 0x16000, 0x17000, 0x18000, 0x19000,
                     rows, 16, dk, 32, dv, 1e-6, 0x1a000, 4096, chunk_min=64)
    # decode attention with RoPE and the KV write folded in, without and with the per-head q/k norms:
    # attention.cu's attn_decode, flash_decode.cu's one-pass plan (a FlashKernels' get and spins)
    kv = ops.PagedKV(0x30000, 0x31000, 0x32000, 64, 4)
    rope = (0x33000, 0x34000, 128, True, 0x35000)
    # (FlashKernels.get raises a kernel's dynamic shared memory to its plan's: up to sm_80's 163 KB)
    fk = NS(get=lambda plan: Rec(plan.kernel, log, 163 * 1024), spins=lambda plan: False)
    plan = flash.plan_decode(4, 32, 4, 128)
    for norms in (None, (0x36000, 0x37000, 1e-6)):
        ops.attention(k, 0x38000, 0x39000, kv, 0x3a000, 0x3b000, 32, 4, 128, 128 ** -0.5, 0, 4, rope=rope,
                      head_norms=norms)
        flash.decode(fk, plan, 0x38000, 0x39000, kv.k, kv.v, kv.tables, kv.max_blocks, kv.bs_log2, 0x3a000, 0x3b000,
                     4, 32, 4, 128, 128 ** -0.5, 0, rope=rope, head_norms=norms)
    # prefill.cu (split16.py): the weights split or in fp16, activation rows in each layout, the epilogues
    from realizar_backend.backends.cuda import split16
    kx = {n: Rec(n, log) for n in split16.KERNELS}
    mats = (w("q", Q.Q4_K, 40, 1536, 9), w("k", Q.Q6_K, 8, 1536, 10), w("v", Q.Q8_0, 8, 1536, 11),
            w("x", Q.Q4_K, 8, 1536, 12))
    for lo in (True, False):
        split16.split_weights(kx, mats, 0x20000, lo)
    for layout in split16.ROW_WIDTH:
        split16.split_rows(kx, 0x21000, 1536, 0x22000, 5, 1536, 1e-6, 0x23000, 0x24000, layout)
        split16.act_split(kx, 0x25000, 8960, 0x24000, 1, 5, 0x23000, 0x26000, layout)
        split16.unscale_scatter(kx, 0x27000, 2048, 0x24000, 5, [(0x28000, 1536, 1536, 0x29000), (0x2a000, 256, 256, 0)],
                                layout)
        split16.unscale_add(kx, 0x2b000, 1536, 0x27000, 2048, 0x24000, 0x2c000, 5, 1536, 1e-6, layout)
    json.dump(log, sys.stdout)


if __name__ == "__main__":
    main()
