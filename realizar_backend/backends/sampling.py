"""The sampling algorithm both backends implement, and its NumPy twin: the contract between the
engine (which decides the parameters) and a backend (which draws the tokens).

Order of operations, the same as vLLM's: the constraints (an allowed-token mask from a grammar,
a logit bias), then penalties, then temperature, then top-k, top-p and min-p filters, then a
seeded draw. Temperature 0 is greedy. Logprobs are reported from the raw (unconstrained,
unpenalised, unscaled) distribution.

The algorithm is defined so that the CUDA kernels (kernels/sampling.cu) can reproduce it bit for
bit without sorting the vocabulary: every float operation is a single IEEE-rounded float32
operation (no fused multiply-add, no library exp), and probability masses are 40-bit fixed-point
integers, whose sums do not depend on the order of summation. Per row:

0. constraints (float32): a token the row's mask does not allow gets -inf, then the logit bias
   is added (x + b, one float32 addition). A row without either skips this step entirely.
1. penalties (float32): a token seen in the prompt or output has x / r (x > 0) or x * r (repetition
   penalty r), then x - (f * count + p * [count > 0]) over output counts (frequency f, presence p).
2. temperature 0: the first index of the maximum. Otherwise z = x * float32(1 / temperature)
   (NaN -> -inf, +inf -> FLT_MAX, -0 -> +0), m = max z, d = z - m, and each token weighs
   W = floor(exp_f32(d) * 2**40) (`fx_weights`: a fixed polynomial exp; 0 below d = -30).
3. tokens are ordered by z descending, ties by index ascending (z compared through its
   order-preserving integer key). In that order: top-k keeps the first k and every tie of the
   k-th; top-p keeps the shortest prefix whose mass reaches ceil(Z_k * round(p * 2**32) / 2**32),
   Z_k being the mass top-k kept; min-p keeps d >= float32(log(min_p)). The kept set F is the
   shortest of these prefixes, of mass Z_F.
4. the draw: R = the first two words of Philox4x32-10 (key = seed, counter = the token's index in
   its sequence), target = floor(R * Z_F / 2**64), and the token is the first in that order whose
   cumulative mass exceeds the target. A sequence's draws never depend on the rest of the batch.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np

from .base import SampleResult, SampleRow

MASK64 = (1 << 64) - 1


def _f32(bits: int) -> np.float32:
    return np.array([bits], np.uint32).view(np.float32)[0]


# float32 constants by bit pattern; kernels/sampling.cu spells the same patterns
LOG2E = _f32(0x3FB8AA3B)
LN2_HI = _f32(0x3F318000)
LN2_LO = _f32(0xB95E8083)
EXP_POLY = tuple(_f32(b) for b in (0x3AB60B61, 0x3C088889, 0x3D2AAAAB, 0x3E2AAAAB, 0x3F000000,
                                   0x3F800000, 0x3F800000))   # 1/6! .. 1/0!, Horner order
FLT_MAX = _f32(0x7F7FFFFF)
FIX_BITS = 40                      # fixed-point bits of a token's weight (the max weighs 2**40)
W_MIN_D = np.float32(-30.0)        # below this d the weight is 0 (exp(-27.7) * 2**40 < 1 already)


def fx_weights(d: np.ndarray) -> np.ndarray:
    """W = floor(exp(d) * 2**40) for d <= 0, as uint64, with exp in plain float32 operations:
    d = n ln2 + r (Cody-Waite), a degree-6 polynomial for exp(r), then an exact scaling by 2**n."""
    d = np.asarray(d, np.float32)
    ok = d >= W_MIN_D
    dd = np.where(ok, d, np.float32(0.0))
    n = np.rint(dd * LOG2E)
    r = (dd - n * LN2_HI) - n * LN2_LO
    p = np.full_like(r, EXP_POLY[0])
    for c in EXP_POLY[1:]:
        p = p * r + c
    e = np.ldexp(p, n.astype(np.int32))
    w = (e * np.float32(2.0 ** FIX_BITS)).astype(np.uint64)
    return np.where(ok, w, np.uint64(0))


def f32_keys(z: np.ndarray) -> np.ndarray:
    """Order-preserving uint32 keys of float32 values (larger float, larger key)."""
    u = np.asarray(z, np.float32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000))


def philox4x32_10(ctr: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, int, int, int]:
    """Philox4x32-10 (Salmon et al., SC'11): one 128-bit block for a counter and a 64-bit key."""
    c0, c1, c2, c3 = (int(v) & 0xFFFFFFFF for v in ctr)
    k0, k1 = (int(v) & 0xFFFFFFFF for v in key)
    for _ in range(10):
        p0, p1 = 0xD2511F53 * c0, 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & 0xFFFFFFFF, (p0 >> 32) ^ c3 ^ k1, p0 & 0xFFFFFFFF
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0, c1, c2, c3


def draw_u64(seed: int, step: int) -> int:
    """The 64 random bits of draw `step` of a sequence seeded with `seed`."""
    seed &= MASK64
    step &= MASK64
    w = philox4x32_10((step & 0xFFFFFFFF, step >> 32, 0, 0), (seed & 0xFFFFFFFF, seed >> 32))
    return w[0] | (w[1] << 32)


@dataclass(frozen=True)
class RowConstants:
    """A SampleRow as the kernels receive it: float32 constants rounded once, on the host."""
    greedy: bool
    penalties: bool
    inv_temp: np.float32
    top_k: int                     # 0: off
    top_p_fx: int                  # round(top_p * 2**32); 2**32 or more: off
    min_p_log: np.float32 | None   # float32(log(min_p)); None: off
    rep: np.float32
    freq: np.float32
    pres: np.float32
    seed: int
    step: int


def _inv_temp(t: float) -> np.float32:
    """float32(1 / t); 0 for greedy. A tiny temperature gives +inf, as the kernel's float32 does
    (step 2 of the contract maps what follows), not an overflow warning."""
    if t <= 0:
        return np.float32(0.0)
    with np.errstate(over="ignore"):
        return np.float32(1.0 / t)


def row_constants(row: SampleRow, vocab: int) -> RowConstants:
    k = int(row.top_k)
    return RowConstants(
        greedy=row.greedy, penalties=row.penalties,
        inv_temp=_inv_temp(row.temperature),
        top_k=k if 0 < k < vocab else 0,
        top_p_fx=min(int(round(float(row.top_p) * 2.0 ** 32)), 1 << 32),
        min_p_log=np.float32(math.log(row.min_p)) if row.min_p > 0 else None,
        rep=np.float32(row.repetition_penalty), freq=np.float32(row.frequency_penalty),
        pres=np.float32(row.presence_penalty), seed=int(row.seed) & MASK64, step=int(row.step) & MASK64)


# the parameter block kernels/sampling.cu reads: SAMPLE_PW int32 words per row
PARAM_WORDS = 16
F_GREEDY, F_PEN, F_LP, F_TOPP, F_MINP, F_MASK, F_BIAS = 1, 2, 4, 8, 16, 32, 64
MAX_LOGIT_BIAS = 1024              # biased tokens per row (the device's per-row bias area)
BIAS_ROW_WORDS = 1 + 2 * MAX_LOGIT_BIAS


def mask_words(vocab: int) -> int:
    return -(-vocab // 32)


def allowed_tokens(mask: np.ndarray, vocab: int) -> np.ndarray:
    """bool [vocab] from an allowed-token bitmask (int32 words, bit i % 32 of word i // 32)."""
    bits = np.unpackbits(np.ascontiguousarray(mask, dtype="<i4").view(np.uint8), bitorder="little")
    out = np.zeros(vocab, bool)
    n = min(vocab, bits.size)
    out[:n] = bits[:n].astype(bool)
    return out


def _has_bias(row: SampleRow) -> bool:
    return row.logit_bias is not None and len(row.logit_bias) > 0


def _f32_bits(x: float) -> int:
    """The bits of float32(x) (round to nearest, as np.float32 does; inf past the range)."""
    try:
        return _U32.unpack(_F32.pack(x))[0]
    except OverflowError:
        with np.errstate(over="ignore"):
            return int(np.float32(x).view(np.uint32))


_F32, _U32 = struct.Struct("<f"), struct.Struct("<I")
_ONE_BITS = _f32_bits(1.0)


def kernel_params(rows, vocab: int, slots, tokens_in) -> np.ndarray:
    """int32 [len(rows), PARAM_WORDS]: slot, flags, top_k, top_p (2**32 fixed point),
    1/temperature, repetition, frequency, presence, log(min_p) (float32 bits), seed and step
    (two words each, low first), the token fed to this step (counted when the row has
    penalties; -1: none), and for constrained rows where their mask and bias lie in the step's
    packed buffers (word 14: the mask's row in `pack_masks`; word 15: the bias's offset in
    `pack_bias`). The values are row_constants'; built from plain ints (a step's launch waits
    for this on the host, at every batch size)."""
    words = []
    n_mask = bias_off = 0
    for i, row in enumerate(rows):
        greedy, pen = row.greedy, row.penalties
        k = int(row.top_k)
        top_p_fx = min(int(round(float(row.top_p) * 2.0 ** 32)), 1 << 32)
        minp = row.min_p > 0
        flags = ((F_GREEDY if greedy else 0) | (F_PEN if pen else 0) | (F_LP if row.logprobs else 0)
                 | (F_TOPP if top_p_fx < (1 << 32) else 0) | (F_MINP if minp else 0))
        mask_row = bias_at = 0
        if row.mask is not None:
            flags |= F_MASK
            mask_row, n_mask = n_mask, n_mask + 1
        if _has_bias(row):
            flags |= F_BIAS
            bias_at = bias_off
            bias_off += 1 + 2 * len(row.logit_bias)
        seed, step = int(row.seed) & MASK64, int(row.step) & MASK64
        rep, freq, pres = row.repetition_penalty, row.frequency_penalty, row.presence_penalty
        words.append((
            int(slots[i]) & 0xFFFFFFFF, flags, k if 0 < k < vocab else 0, top_p_fx & 0xFFFFFFFF,
            _f32_bits(1.0 / row.temperature) if row.temperature > 0 else 0,
            _ONE_BITS if rep == 1.0 else _f32_bits(rep), _f32_bits(freq) if freq else 0,
            _f32_bits(pres) if pres else 0, _f32_bits(math.log(row.min_p)) if minp else 0,
            seed & 0xFFFFFFFF, seed >> 32, step & 0xFFFFFFFF, step >> 32,
            (int(tokens_in[i]) if pen and tokens_in is not None else -1) & 0xFFFFFFFF,
            mask_row, bias_at & 0xFFFFFFFF))
    return np.array(words, np.uint32).reshape(len(rows), PARAM_WORDS).view(np.int32)


def pack_masks(rows, out: np.ndarray) -> int:
    """The masks of the constrained rows, in row order, into out [>= their number, words]
    (the rows `kernel_params` names); returns how many. A short mask is padded with zero
    words (its tokens past the end are not allowed)."""
    k = 0
    for row in rows:
        if row.mask is not None:
            m = np.asarray(row.mask, np.int32).reshape(-1)
            n = min(m.size, out.shape[1])
            out[k, :n] = m[:n]
            out[k, n:] = 0
            k += 1
    return k


def pack_bias(rows, out: np.ndarray) -> int:
    """The logit biases of the rows that have one, in row order, into the flat int32 buffer
    `out`: per row [n, ids[n], float32 bits of values[n]] at the offset `kernel_params` gives;
    returns the words used."""
    off = 0
    for row in rows:
        if _has_bias(row):
            b = row.logit_bias
            n = len(b)
            if n > MAX_LOGIT_BIAS:
                raise ValueError(f"{n} biased tokens; at most {MAX_LOGIT_BIAS} per row")
            out[off] = n
            out[off + 1:off + 1 + n] = b.ids
            out[off + 1 + n:off + 1 + 2 * n] = np.asarray(b.values, np.float32).view(np.int32)
            off += 1 + 2 * n
    return off


def constrain(x: np.ndarray, row: SampleRow) -> np.ndarray:
    """Step 0: masked-out tokens to -inf, then the logit bias added (float32)."""
    if not row.constrained:
        return x
    x = np.array(x, np.float32)
    if row.mask is not None:
        x[~allowed_tokens(row.mask, x.shape[-1])] = -np.inf
    if _has_bias(row):
        ids = np.asarray(row.logit_bias.ids, np.int64)
        x[ids] = x[ids] + np.asarray(row.logit_bias.values, np.float32)
    return x


def penalize(x: np.ndarray, counts: np.ndarray, rc: RowConstants) -> np.ndarray:
    """counts: int32 [vocab], bit 0 = in the prompt, the rest = times generated (count << 1)."""
    x = np.asarray(x, np.float32)
    seen = counts != 0
    x = np.where(seen, np.where(x > 0, x / rc.rep, x * rc.rep), x)
    out = counts >> 1
    pen = rc.freq * out.astype(np.float32) + np.where(out > 0, rc.pres, np.float32(0.0))
    return (x - pen).astype(np.float32)


def scaled_logits(x: np.ndarray, inv_temp: np.float32) -> np.ndarray:
    z = np.asarray(x, np.float32) * inv_temp
    z = np.where(np.isnan(z), np.float32(-np.inf), z)
    z = np.where(z == np.inf, FLT_MAX, z)
    return (z + np.float32(0.0)).astype(np.float32)


@dataclass
class Draw:
    """The inside of one sampled row: the candidates (tokens of nonzero weight) in draw order,
    their cumulative weights, how many survive the filters, and the draw's target."""
    token: int
    order: np.ndarray      # int64 token ids, z descending, ties by index
    cum: np.ndarray        # uint64 cumulative weights in that order
    n_kept: int            # the first n_kept are the kept set F
    target: int            # the token is the first of F whose cumulative weight exceeds it

    def boundary_distance(self) -> float:
        """Distance from the target to the nearest CDF step inside F, relative to F's mass:
        how close this draw was to picking a neighbour."""
        cum = self.cum[: self.n_kept].astype(np.float64)
        return float(np.min(np.abs(cum - self.target)) / cum[-1])


def draw_detail(logits: np.ndarray, row: SampleRow, counts: np.ndarray | None = None) -> Draw | None:
    """The twin's computation for one row of raw logits [vocab]; None for a greedy row or one
    with no finite logit (both answered without a draw by `sample_logits`)."""
    V = logits.shape[-1]
    rc = row_constants(row, V)
    x = constrain(np.asarray(logits, np.float32), row)
    if rc.penalties:
        if counts is None:
            raise ValueError("a row with penalties needs its token counts")
        x = penalize(x, counts, rc)
    if rc.greedy:
        return None
    z = scaled_logits(x, rc.inv_temp)
    m = z.max()
    if m == -np.inf:
        return None
    d = (z - m).astype(np.float32)
    w = fx_weights(d)
    keys = f32_keys(z)
    # only tokens of nonzero weight can be drawn or move a cut; top-k still ranks all of them
    act = np.flatnonzero(w)
    order = np.sort(((np.uint64(0xFFFFFFFF) - keys[act].astype(np.uint64)) << np.uint64(32))
                    | act.astype(np.uint64))
    idx = (order & np.uint64(0xFFFFFFFF)).astype(np.int64)
    cum = np.cumsum(w[idx], dtype=np.uint64)
    n_f = len(idx)
    z_k = int(cum[-1])
    if rc.top_k:
        kth = np.partition(keys, V - rc.top_k)[V - rc.top_k]
        n_f = int(np.count_nonzero(keys[idx] >= kth))
        z_k = int(cum[n_f - 1])
    if rc.top_p_fx < (1 << 32):
        target = (z_k * rc.top_p_fx + (1 << 32) - 1) >> 32
        n_f = min(n_f, int(np.searchsorted(cum, np.uint64(target), side="left")) + 1)
    if rc.min_p_log is not None:
        n_f = min(n_f, int(np.count_nonzero(d[idx] >= rc.min_p_log)))
    z_f = int(cum[n_f - 1])
    target = (draw_u64(rc.seed, rc.step) * z_f) >> 64
    tok = int(idx[int(np.searchsorted(cum[:n_f], np.uint64(target), side="right"))])
    return Draw(tok, idx, cum, n_f, target)


def sample_logits(logits: np.ndarray, row: SampleRow, counts: np.ndarray | None = None) -> int:
    """The token for one row of raw logits [vocab] (counts: the slot's token counts, needed when
    the row has penalties)."""
    dr = draw_detail(logits, row, counts)
    if dr is not None:
        return dr.token
    if row.greedy:
        x = constrain(np.asarray(logits, np.float32), row)
        if row.penalties:
            x = penalize(x, counts, row_constants(row, logits.shape[-1]))
        # argmax stops at the first NaN: only a row with one needs the copy that hides them
        # (a full-vocabulary copy per token is most of a first token's host time)
        i = int(np.argmax(x))
        if not np.isnan(x[i]):
            return i
        return int(np.argmax(np.where(np.isnan(x), np.float32(-np.inf), x)))
    return 0


def raw_logprobs(logits: np.ndarray, token: int) -> tuple[float, int, float]:
    """(logprob of token, argmax, logprob of the argmax) under the raw logits."""
    lp = log_softmax(logits)
    top = int(np.argmax(logits))
    return float(lp[token]), top, float(lp[top])


def sample_rows(logits: np.ndarray, rows, counts: list[np.ndarray | None] | None = None):
    """Rows of raw logits [n, vocab] -> SampleResult, as Backend.result returns it."""
    n = len(rows)
    toks = np.zeros(n, np.int32)
    lps = np.full(n, np.nan, np.float32)
    top_ids = np.zeros(n, np.int32)
    top_lps = np.full(n, np.nan, np.float32)
    kept: dict[int, np.ndarray] = {}
    for i, row in enumerate(rows):
        toks[i] = sample_logits(logits[i], row, None if counts is None else counts[i])
        if row.logprobs:
            lps[i], top_ids[i], top_lps[i] = raw_logprobs(logits[i], int(toks[i]))
        else:
            top_ids[i] = int(np.argmax(logits[i]))
        if row.want_logits:
            kept[i] = np.array(logits[i], np.float32)
    return SampleResult(toks, lps, top_ids, top_lps, kept)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64) - np.max(logits)
    return z - np.log(np.sum(np.exp(z)))
