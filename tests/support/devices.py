"""The opt-in shared memory a block may hold (cudaDevAttrMaxSharedMemoryPerBlockOptin) on the compute
capabilities the CUDA backend plans for, as inputs to its pure planning rules (dispatch.smem_limits,
flash.fits): sm_90 (H100, H200), sm_80 (A100), sm_86 and sm_89 (A10, RTX 30 / 40, L4, L40)."""

SMEM_OPTIN = {"sm_90": 232_448, "sm_80": 166_912, "sm_86": 101_376, "sm_89": 101_376}
