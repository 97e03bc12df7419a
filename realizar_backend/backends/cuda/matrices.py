"""The GPU's quant table and how a matrix on the device is described: plain data, no CuPy, so the
dispatcher (dispatch.py) and its rules run and are tested anywhere."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType as Q

from ...errors import UnsupportedModelError
from ...formats.quants import row_bytes


@dataclass(frozen=True)
class QInfo:
    suffix: str          # kernel name suffix: gemv_<suffix>
    block: int           # weights per block
    block_bytes: int
    blocks: bool = False  # stored in 32-weight units: the quantized types (mmvf.cu's GEMVs take them)


# The GPU's quant table: the types of the GGUF files people run (K-quants, I-quants, MXFP4, the
# 32-weight types, the float types). A tensor of any other type is refused at load (weights.py).
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
    Q.Q2_K: QInfo("q2_k", 256, 84, True),
    Q.Q3_K: QInfo("q3_k", 256, 110, True),
    Q.IQ4_NL: QInfo("iq4_nl", 32, 18, True),
    Q.IQ4_XS: QInfo("iq4_xs", 256, 136, True),
    Q.MXFP4: QInfo("mxfp4", 32, 17, True),
    Q.IQ2_XXS: QInfo("iq2_xxs", 256, 66, True),
    Q.IQ2_XS: QInfo("iq2_xs", 256, 74, True),
    Q.IQ2_S: QInfo("iq2_s", 256, 82, True),
    Q.IQ3_XXS: QInfo("iq3_xxs", 256, 98, True),
    Q.IQ3_S: QInfo("iq3_s", 256, 110, True),
}


def check_matrix(path, name: str, qtype, shape: tuple[int, ...], nbytes: int) -> QInfo:
    """The GPU's entry for a model's matrix or stack of experts' matrices [experts, rows, cols]
    (weights.py, before anything is uploaded): raises UnsupportedModelError naming the tensor and
    its type when the GPU has no kernel for the type, the tensor is not a matrix (or stack) of whole
    blocks, or its bytes disagree with its shape."""
    info = QTYPES.get(qtype)
    type_name = getattr(qtype, "name", str(qtype))
    if info is None:
        raise UnsupportedModelError(path, f"tensor {name}: type {type_name} has no GPU kernel (the GPU runs "
                                          f"{', '.join(q.name for q in QTYPES)}; the CPU backend runs every type)")
    if len(shape) not in (2, 3) or shape[-1] % info.block:
        raise UnsupportedModelError(path, f"tensor {name}: shape {shape} is not a matrix (or a stack of experts' "
                                          f"matrices) of whole {type_name} blocks")
    if nbytes != int(np.prod(shape[:-1])) * row_bytes(qtype, shape[-1]):
        raise UnsupportedModelError(path, f"tensor {name}: {nbytes} bytes for shape {shape}")
    return info


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
