"""The GPU's quant table and how a matrix on the device is described: plain data, no CuPy, so the
dispatcher (dispatch.py) and its rules run and are tested anywhere."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as Q


@dataclass(frozen=True)
class QInfo:
    suffix: str          # kernel name suffix: gemv_<suffix>
    block: int           # weights per block
    block_bytes: int
    blocks: bool = False  # stored in 32-weight units: the quantized types (mmvf.cu's GEMVs take them)


# The GPU's quant table: every type in the four real models plus the neighbours the design names.
QTYPES: dict[Q, QInfo] = {
    Q.F32: QInfo("f32", 1, 4),
    Q.F16: QInfo("f16", 1, 2),
    Q.BF16: QInfo("bf16", 1, 2),
    Q.Q4_0: QInfo("q4_0", 32, 18, True),
    Q.Q4_1: QInfo("q4_1", 32, 20, True),
    Q.Q5_0: QInfo("q5_0", 32, 22, True),
    Q.Q5_1: QInfo("q5_1", 32, 24, True),
    Q.Q8_0: QInfo("q8_0", 32, 34, True),
    Q.Q4_K: QInfo("q4_k", 256, 144, True),
    Q.Q5_K: QInfo("q5_k", 256, 176, True),
    Q.Q6_K: QInfo("q6_k", 256, 210, True),
}


@dataclass
class WeightRef:
    """A matrix on the GPU in its device layout (formats/gpu_layout.py): rows x cols, `row_bytes` per row.
    A stack of experts' matrices (a 3-D GGUF tensor [experts, rows, cols]) is one WeightRef with
    `experts` > 0: its experts * rows rows lie back to back, expert e's matrix from
    ptr + e * expert_bytes."""
    name: str
    qtype: object
    ptr: int
    rows: int
    cols: int
    row_bytes: int
    experts: int = 0

    @property
    def expert_bytes(self) -> int:
        """Bytes from one expert's matrix to the next (a stack of experts)."""
        return self.rows * self.row_bytes
