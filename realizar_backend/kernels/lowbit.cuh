// Block decoders of the types below 4 bits and the codebook types: Q2_K, Q3_K, IQ4_NL, IQ4_XS,
// MXFP4, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S (layouts: ggml's ggml-common.h; the reference is
// gguf-py's dequantize). Included at the end of common.cuh, whose helpers they use.
//
// Every such unit (32 weights) decodes to one form, LUnit, that each consumer turns into its own:
// byte k of v[i] holds the stored value b of column 4i + k (v[i + 4]: column 16 + 4i + k), an
// unsigned byte, and the weight is a_h (b - OFF) + m_h (h = 0 for columns 0..15, 1 for 16..31),
// OFF = lowbit_off(QT): 128 for the signed types (b = q + 128, q the signed integer the format
// scales: a codebook magnitude with its sign, a non-linear 4-bit level, an E2M1 value doubled), 4 for
// Q3_K (q in -4..3), 0 for Q2_K (the only one with a min). q and b are exact in fp16, and a_h q is
// the product gguf's dequantize forms (so decoded weights equal its output bit for bit).
// load_unit (dequantize, embed, split16), load_funit (mmvf.cu) and mmq.cu's tile stores start from
// it; mmqs.cu reads two 4-column words per unit and thread (lt_load / lt_decode).
#pragma once
#include "iq_grids.cuh"

struct LUnit {
    u32 v[8];
    float a0, a1, m0, m1;
};

__host__ __device__ constexpr int lowbit_off(int qt) { return qt == QT_Q2_K ? 0 : qt == QT_Q3_K ? 4 : 128; }

// A unit's bytes as loaded (what each type keeps differs): the load and the decode are apart so
// that mmq.cu keeps the loads in flight in registers while it computes (a load stores what it read
// and nothing computed from it; the decode also gets the unit's index).
struct LRaw {
    uint4 a;
    u32 b, c, d;
};

// ------------------------------------------------------------------ helpers
// MXFP4's scale: 2^(e - 127) halved (its E2M1 values are kept doubled, as ggml's kvalues_mxfp4);
// exponents 0 and 1 are the subnormals 2^-128 and 2^-127 (ggml_e8m0_to_fp32_half)
__device__ __forceinline__ float e8m0_half(u32 e) { return __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23); }

// the 8 sign bits of a group of an I-quant: the 7 stored and their parity (ggml's ksigns_iq2xs)
__device__ __forceinline__ u32 iq_signs(u32 s7) { return s7 | ((u32)(__popc(s7) & 1) << 7); }

// four magnitudes (bytes of g, each 1..127) with sign bits s (bit k: byte k negative) as q + 128
__device__ __forceinline__ u32 iq_signed(u32 g, u32 s) {
    const u32 one = ((s & 15u) * 0x00204081u) & 0x01010101u;   // bit k of s -> bit 0 of byte k
    return ((g ^ (one * 0xFFu)) + one) ^ 0x80808080u;          // -g = ~g + 1 per byte: no carry (g >= 1)
}

// table lookup of four 4-bit codes (bits 0..3 of each byte of n) in a 16-entry byte table, entry e
// at byte e & 3 of t[e >> 2]: two byte permutes over the halves of the table, a third picks per byte
// (selector nibbles keep bit 3 clear: prmt would read it as sign replication)
__device__ __forceinline__ u32 lut16(u32 n, u32 t0, u32 t1, u32 t2, u32 t3) {
    const u32 s = n | (n >> 4);
    const u32 sel = (s & 0xFFu) | ((s >> 8) & 0xFF00u);        // code k at bits 4k
    const u32 lo = __byte_perm(t0, t1, sel & 0x7777u), hi = __byte_perm(t2, t3, sel & 0x7777u);
    return __byte_perm(lo, hi, 0x3210u | ((sel & 0x8888u) >> 1));
}

// IQ4_NL / IQ4_XS levels + 128 (ggml's kvalues_iq4nl: -127 -104 -83 -65 -49 -35 -22 -10 1 13 25 38 53 69 89 113)
__device__ __forceinline__ u32 iq4_levels(u32 n) { return lut16(n, 0x3F2D1801u, 0x766A5D4Fu, 0xA6998D81u, 0xF1D9C5B5u); }
// MXFP4's E2M1 values doubled + 128 (ggml's kvalues_mxfp4: 0 1 2 3 4 6 8 12 0 -1 -2 -3 -4 -6 -8 -12)
__device__ __forceinline__ u32 mxfp4_levels(u32 n) { return lut16(n, 0x83828180u, 0x8C888684u, 0x7D7E7F80u, 0x74787A7Cu); }

// 16 bytes of 4-bit codes (byte c: column c in the low nibble, 16 + c in the high one) through a table
template <int QT>
__device__ __forceinline__ void nibble_unit(const u32 (&q)[4], u32 (&v)[8]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 lo = q[i] & 0x0F0F0F0Fu, hi = (q[i] >> 4) & 0x0F0F0F0Fu;
        v[i] = QT == QT_MXFP4 ? mxfp4_levels(lo) : iq4_levels(lo);
        v[i + 4] = QT == QT_MXFP4 ? mxfp4_levels(hi) : iq4_levels(hi);
    }
}

// ------------------------------------------------------------------ whole units: load, decode
// lb_load<QT>(row, u, nu, r): unit u of a row of nu units into r; lb_decode<QT>(r, u, w): r as an LUnit.
// (Q2_K and Q3_K read 32 and 64 bytes a unit, of which a unit uses 2 and 3 bits a byte: they have
// q2k_unit and q3k_unit instead, load and decode in one; mmq.cu and mmqs.cu read Q3_K their own ways.)
template <int QT> __device__ __forceinline__ void lb_load(const u8* __restrict__ row, int u, int nu, LRaw& r);
template <int QT> __device__ __forceinline__ void lb_decode(const LRaw& r, int u, LUnit& w);

// IQ4_NL: {f16 d; u8 qs[16]} (18 bytes, 2-byte aligned), w = d level(code)
template <> __device__ __forceinline__ void lb_load<QT_IQ4_NL>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + u * 18;
    u32 q[4];
    ldw_a2<4>(b + 2, q);
    r.a = make_uint4(q[0], q[1], q[2], q[3]);
    r.b = ld16(b);
}

template <> __device__ __forceinline__ void lb_decode<QT_IQ4_NL>(const LRaw& r, int u, LUnit& w) {
    const u32 q[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
    nibble_unit<QT_IQ4_NL>(q, w.v);
    w.a0 = w.a1 = h2f((u16)r.b);
    w.m0 = w.m1 = 0.0f;
}

// IQ4_XS: {f16 d; u16 scales_h; u8 scales_l[4]; u8 qs[128]} (136 bytes, 8-byte aligned); unit j's
// 6-bit scale ls = scales_l nibble j | 2 bits j of scales_h << 4, w = d (ls - 32) level(code)
template <> __device__ __forceinline__ void lb_load<QT_IQ4_XS>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + (u >> 3) * 136;
    const int j = u & 7;
    const uint2* q = (const uint2*)(b + 8 + 16 * j);
    const uint2 x0 = __ldg(q), x1 = __ldg(q + 1), hd = __ldg((const uint2*)b);
    r.a = make_uint4(x0.x, x0.y, x1.x, x1.y);
    r.b = hd.x;                             // d, scales_h
    r.c = hd.y;                             // scales_l: unit j's nibble at bits 4j
}

__device__ __forceinline__ float iq4xs_scale(const LRaw& r, int j) {
    const int ls = (int)(((r.c >> (4 * j)) & 15u) | (((r.b >> (16 + 2 * j)) & 3u) << 4)) - 32;
    return h2f((u16)(r.b & 0xFFFF)) * (float)ls;
}

template <> __device__ __forceinline__ void lb_decode<QT_IQ4_XS>(const LRaw& r, int u, LUnit& w) {
    const u32 q[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
    nibble_unit<QT_IQ4_XS>(q, w.v);
    w.a0 = w.a1 = iq4xs_scale(r, u & 7);
    w.m0 = w.m1 = 0.0f;
}

// MXFP4 in its device layout (formats/gpu_layout.py, repack.cu): the row's units' 16 code bytes
// (GGUF's qs), then their E8M0 exponents, one byte each; w = e8m0_half(e) level(code)
template <> __device__ __forceinline__ void lb_load<QT_MXFP4>(const u8* __restrict__ row, int u, int nu, LRaw& r) {
    r.a = __ldg((const uint4*)(row + 16 * u));
    r.b = __ldg(row + 16 * nu + u);
}

template <> __device__ __forceinline__ void lb_decode<QT_MXFP4>(const LRaw& r, int u, LUnit& w) {
    const u32 q[4] = {r.a.x, r.a.y, r.a.z, r.a.w};
    nibble_unit<QT_MXFP4>(q, w.v);
    w.a0 = w.a1 = e8m0_half(r.b);
    w.m0 = w.m1 = 0.0f;
}

// IQ2_XXS: {f16 d; u16 qs[32]} (66 bytes); unit j: 8 bytes at 2 + 8j, word 0 the four groups' grid
// indices (8 values each), word 1 their 7-bit sign codes (bits 7l..7l+6) and the scale s (bits 28..31);
// w = d (0.5 + s) / 4 (sign) grid
template <> __device__ __forceinline__ void lb_load<QT_IQ2_XXS>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + (u >> 3) * 66;
    u32 q[2];
    ldw_a2<2>(b + 2 + 8 * (u & 7), q);
    r.a.x = q[0];
    r.a.y = q[1];
    r.b = ld16(b);
}

__device__ __forceinline__ float iq2_scale(u32 d, u32 s) { return h2f((u16)d) * (0.5f + (float)s) * 0.25f; }

template <> __device__ __forceinline__ void lb_decode<QT_IQ2_XXS>(const LRaw& r, int u, LUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 g = (r.a.x >> (8 * l)) & 255u, s = iq_signs((r.a.y >> (7 * l)) & 127u);
        w.v[2 * l] = iq_signed(iq2xxs_grid((int)g, 0), s);
        w.v[2 * l + 1] = iq_signed(iq2xxs_grid((int)g, 1), s >> 4);
    }
    w.a0 = w.a1 = iq2_scale(r.b, r.a.y >> 28);
    w.m0 = w.m1 = 0.0f;
}

// IQ2_XS: {f16 d; u16 qs[32]; u8 scales[8]} (74 bytes); unit j: qs 4j..4j+3, each a 9-bit grid index
// and a 7-bit sign code; scales[j]'s low nibble scales columns 0..15, the high one 16..31
template <> __device__ __forceinline__ void lb_load<QT_IQ2_XS>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + (u >> 3) * 74;
    const int j = u & 7;
    u32 q[2];
    ldw_a2<2>(b + 2 + 8 * j, q);
    r.a.x = q[0];
    r.a.y = q[1];
    r.a.z = b[66 + j];
    r.b = ld16(b);
}

template <> __device__ __forceinline__ void lb_decode<QT_IQ2_XS>(const LRaw& r, int u, LUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 q = ((l < 2 ? r.a.x : r.a.y) >> (16 * (l & 1))) & 0xFFFFu;
        const u32 g = q & 511u, s = iq_signs(q >> 9);
        w.v[2 * l] = iq_signed(iq2xs_grid((int)g, 0), s);
        w.v[2 * l + 1] = iq_signed(iq2xs_grid((int)g, 1), s >> 4);
    }
    w.a0 = iq2_scale(r.b, r.a.z & 15u);
    w.a1 = iq2_scale(r.b, r.a.z >> 4);
    w.m0 = w.m1 = 0.0f;
}

// IQ2_S: {f16 d; u8 qs[32]; u8 signs[32]; u8 qh[8]; u8 scales[8]} (82 bytes); unit j, group l: grid
// index qs[4j + l] | bits 2l, 2l + 1 of qh[j] << 8, sign bits signs[4j + l]; scales as IQ2_XS
template <> __device__ __forceinline__ void lb_load<QT_IQ2_S>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + (u >> 3) * 82;
    const int j = u & 7;
    r.a.x = (u32)ld32_a2(b + 2 + 4 * j);
    r.a.y = (u32)ld32_a2(b + 34 + 4 * j);
    r.a.z = b[66 + j];
    r.a.w = b[74 + j];
    r.b = ld16(b);
}

template <> __device__ __forceinline__ void lb_decode<QT_IQ2_S>(const LRaw& r, int u, LUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 g = ((r.a.x >> (8 * l)) & 255u) | (((r.a.z >> (2 * l)) & 3u) << 8), s = (r.a.y >> (8 * l)) & 255u;
        w.v[2 * l] = iq_signed(iq2s_grid((int)g, 0), s);
        w.v[2 * l + 1] = iq_signed(iq2s_grid((int)g, 1), s >> 4);
    }
    w.a0 = iq2_scale(r.b, r.a.w & 15u);
    w.a1 = iq2_scale(r.b, r.a.w >> 4);
    w.m0 = w.m1 = 0.0f;
}

// IQ3_XXS: {f16 d; u8 qs[64]; u32 scales_and_signs[8]} (98 bytes); unit j: qs 8j..8j+7, grid indices
// of its 8 runs of 4 values; word j: the 4 groups' (8 values each) 7-bit sign codes, the scale s in
// bits 28..31; w = d (0.5 + s) / 2 (sign) grid
template <> __device__ __forceinline__ void lb_load<QT_IQ3_XXS>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + (u >> 3) * 98;
    const int j = u & 7;
    u32 q[2];
    ldw_a2<2>(b + 2 + 8 * j, q);
    r.a.x = q[0];
    r.a.y = q[1];
    r.a.z = (u32)ld32_a2(b + 66 + 4 * j);
    r.b = ld16(b);
}

template <> __device__ __forceinline__ void lb_decode<QT_IQ3_XXS>(const LRaw& r, int u, LUnit& w) {
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const u32 s = iq_signs((r.a.z >> (7 * l)) & 127u), q = l < 2 ? r.a.x : r.a.y;
        w.v[2 * l] = iq_signed(iq3xxs_grid((int)((q >> (16 * (l & 1))) & 255u)), s);
        w.v[2 * l + 1] = iq_signed(iq3xxs_grid((int)((q >> (16 * (l & 1) + 8)) & 255u)), s >> 4);
    }
    w.a0 = w.a1 = h2f((u16)r.b) * (0.5f + (float)(r.a.z >> 28)) * 0.5f;
    w.m0 = w.m1 = 0.0f;
}

// IQ3_S: {f16 d; u8 qs[64]; u8 qh[8]; u8 signs[32]; u8 scales[4]} (110 bytes); unit j, run e of 4
// values: grid index qs[8j + e] | bit e of qh[j] << 8, sign bits 4e..4e+3 of signs[4j..4j+3]; the
// scale nibble j of scales, w = d (1 + 2 s) (sign) grid
template <> __device__ __forceinline__ void lb_load<QT_IQ3_S>(const u8* __restrict__ row, int u, int, LRaw& r) {
    const u8* b = row + (u >> 3) * 110;
    const int j = u & 7;
    u32 q[2];
    ldw_a2<2>(b + 2 + 8 * j, q);
    r.a.x = q[0];
    r.a.y = q[1];
    r.a.z = (u32)ld32_a2(b + 74 + 4 * j);
    r.a.w = b[66 + j];
    r.b = ld16(b);
    r.c = b[106 + (j >> 1)];                // nibble j & 1: the scale
}

__device__ __forceinline__ float iq3s_scale(const LRaw& r, int j) {
    return h2f((u16)r.b) * (float)(1u + 2u * ((r.c >> (4 * (j & 1))) & 15u));
}

__device__ __forceinline__ u32 iq3s_run(const LRaw& r, int e) {
    const u32 q = e < 4 ? r.a.x : r.a.y;
    const u32 g = ((q >> (8 * (e & 3))) & 255u) | (((r.a.w >> e) & 1u) << 8);
    return iq_signed(iq3s_grid((int)g), r.a.z >> (4 * e));
}

template <> __device__ __forceinline__ void lb_decode<QT_IQ3_S>(const LRaw& r, int u, LUnit& w) {
#pragma unroll
    for (int e = 0; e < 8; ++e) w.v[e] = iq3s_run(r, e);
    w.a0 = w.a1 = iq3s_scale(r, u & 7);
    w.m0 = w.m1 = 0.0f;
}

// ------------------------------------------------------------------ the 2- and 3-bit K-quants
// Q2_K: {u8 scales[16]; u8 qs[64]; f16 d, dmin} (84 bytes, 4-byte aligned); unit j = 4h + s: the
// 2-bit values at bits 2s of qs[32h + l] (column l); scales[2j] (columns 0..15), scales[2j + 1]
// (16..31): the low nibble scales d, the high one the min dmin: w = d sc q - dmin m
__device__ __forceinline__ void q2k_unit(const u8* __restrict__ row, int u, LUnit& w) {
    const u8* b = row + (u >> 3) * 84;
    const int j = u & 7;
    const u32* q = (const u32*)(b + 16 + 32 * (j >> 2));
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = (__ldg(q + i) >> (2 * (j & 3))) & 0x03030303u;
    const u32 dm = __ldg((const u32*)(b + 80)), sc = ld16(b + 2 * j);
    const float d = h2f((u16)(dm & 0xFFFF)), dmin = h2f((u16)(dm >> 16));
    w.a0 = d * (float)(sc & 15u);
    w.m0 = -(dmin * (float)((sc >> 4) & 15u));
    w.a1 = d * (float)((sc >> 8) & 15u);
    w.m1 = -(dmin * (float)(sc >> 12));
}

// Q3_K: {u8 hmask[32]; u8 qs[64]; u8 scales[12]; f16 d} (110 bytes, 2-byte aligned); unit j = 4h + s:
// the low 2 bits at bits 2s of qs[32h + l], the third at bit j of hmask[l] (column l), q = that - 4;
// scales k = 2j (columns 0..15), 2j + 1: 6 bits, low nibble at bits 4(k / 8) of scales[k % 8], high
// 2 bits at bits 2(k / 4) of scales[8 + k % 4], minus 32; w = d sc q
// lo16: scales bytes 2(j & 3), + 1; hi16: bytes 8 + 2(j & 1), + 1; d16: d
__device__ __forceinline__ void q3k_scale_pair(u32 lo16, u32 hi16, u32 d16, int j, float& a0, float& a1) {
    const u32 lo = lo16 >> (4 * (j >> 2)), hi = hi16 >> (2 * (j >> 1));
    const float d = h2f((u16)d16);
    a0 = d * (float)((int)((lo & 15u) | ((hi & 3u) << 4)) - 32);
    a1 = d * (float)((int)(((lo >> 8) & 15u) | (((hi >> 8) & 3u) << 4)) - 32);
}

__device__ __forceinline__ void q3k_scales(const u8* b, int j, float& a0, float& a1) {
    q3k_scale_pair(ld16(b + 96 + 2 * (j & 3)), ld16(b + 104 + 2 * (j & 1)), ld16(b + 108), j, a0, a1);
}

__device__ __forceinline__ void q3k_unit(const u8* __restrict__ row, int u, LUnit& w) {
    const u8* b = row + (u >> 3) * 110;
    const int j = u & 7;
    u32 q[8], m[8];
    ldw_a2<8>(b + 32 + 32 * (j >> 2), q);
    ldw_a2<8>(b, m);
#pragma unroll
    for (int i = 0; i < 8; ++i) w.v[i] = ((q[i] >> (2 * (j & 3))) & 0x03030303u) | (((m[i] >> j) & 0x01010101u) << 2);
    q3k_scales(b, j, w.a0, w.a1);
    w.m0 = w.m1 = 0.0f;
}

template <int QT>
__device__ __forceinline__ void load_lunit(const u8* __restrict__ row, int u, int nu, LUnit& w) {
    if constexpr (QT == QT_Q2_K) {
        q2k_unit(row, u, w);
    } else if constexpr (QT == QT_Q3_K) {
        q3k_unit(row, u, w);
    } else {
        LRaw r;
        lb_load<QT>(row, u, nu, r);
        lb_decode<QT>(r, u, w);
    }
}

// ------------------------------------------------------------------ two words per unit (mmqs.cu)
// lt_load<QT>(row, u, nu, t, r) / lt_decode<QT>(r, u, t, v0, v1, a0, a1): the values of columns 4t..4t+3
// (v0) and 16 + 4t..16 + 4t + 3 (v1) of unit u as LUnit's bytes, and the unit's two scales.
template <int QT> __device__ __forceinline__ void lt_load(const u8* __restrict__ row, int u, int nu, int t, LRaw& r);
template <int QT>
__device__ __forceinline__ void lt_decode(const LRaw& r, int u, int t, u32& v0, u32& v1, float& a0, float& a1);

template <> __device__ __forceinline__ void lt_load<QT_IQ4_NL>(const u8* __restrict__ row, int u, int, int t, LRaw& r) {
    const u8* b = row + u * 18;
    r.a.x = (u32)ld32_a2(b + 2 + 4 * t);
    r.b = ld16(b);
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ4_NL>(const LRaw& r, int u, int, u32& v0, u32& v1, float& a0,
                                                                  float& a1) {
    v0 = iq4_levels(r.a.x & 0x0F0F0F0Fu);
    v1 = iq4_levels((r.a.x >> 4) & 0x0F0F0F0Fu);
    a0 = a1 = h2f((u16)r.b);
}

template <> __device__ __forceinline__ void lt_load<QT_IQ4_XS>(const u8* __restrict__ row, int u, int, int t, LRaw& r) {
    const u8* b = row + (u >> 3) * 136;
    r.a.x = __ldg((const u32*)(b + 8 + 16 * (u & 7) + 4 * t));
    const uint2 hd = __ldg((const uint2*)b);
    r.b = hd.x;
    r.c = hd.y;
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ4_XS>(const LRaw& r, int u, int, u32& v0, u32& v1, float& a0,
                                                                  float& a1) {
    v0 = iq4_levels(r.a.x & 0x0F0F0F0Fu);
    v1 = iq4_levels((r.a.x >> 4) & 0x0F0F0F0Fu);
    a0 = a1 = iq4xs_scale(r, u & 7);
}

template <> __device__ __forceinline__ void lt_load<QT_MXFP4>(const u8* __restrict__ row, int u, int nu, int t, LRaw& r) {
    r.a.x = __ldg((const u32*)(row + 16 * u + 4 * t));
    r.b = __ldg(row + 16 * nu + u);
}

template <> __device__ __forceinline__ void lt_decode<QT_MXFP4>(const LRaw& r, int u, int, u32& v0, u32& v1, float& a0,
                                                                 float& a1) {
    v0 = mxfp4_levels(r.a.x & 0x0F0F0F0Fu);
    v1 = mxfp4_levels((r.a.x >> 4) & 0x0F0F0F0Fu);
    a0 = a1 = e8m0_half(r.b);
}

// the 8-value grid types: columns 4t.. are word t & 1 of group t >> 1, columns 16 + 4t.. the same word
// of group 2 + (t >> 1)
template <> __device__ __forceinline__ void lt_load<QT_IQ2_XXS>(const u8* __restrict__ row, int u, int nu, int, LRaw& r) {
    lb_load<QT_IQ2_XXS>(row, u, nu, r);
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ2_XXS>(const LRaw& r, int u, int t, u32& v0, u32& v1, float& a0,
                                                                   float& a1) {
    const int l = t >> 1, h = t & 1;
    const u32 g0 = (r.a.x >> (8 * l)) & 255u, g1 = (r.a.x >> (8 * l + 16)) & 255u;
    v0 = iq_signed(iq2xxs_grid((int)g0, h), iq_signs((r.a.y >> (7 * l)) & 127u) >> (4 * h));
    v1 = iq_signed(iq2xxs_grid((int)g1, h), iq_signs((r.a.y >> (7 * l + 14)) & 127u) >> (4 * h));
    a0 = a1 = iq2_scale(r.b, r.a.y >> 28);
}

template <> __device__ __forceinline__ void lt_load<QT_IQ2_XS>(const u8* __restrict__ row, int u, int nu, int, LRaw& r) {
    lb_load<QT_IQ2_XS>(row, u, nu, r);
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ2_XS>(const LRaw& r, int u, int t, u32& v0, u32& v1, float& a0,
                                                                  float& a1) {
    const int l = t >> 1, h = t & 1;
    const u32 q0 = (r.a.x >> (16 * l)) & 0xFFFFu, q1 = (r.a.y >> (16 * l)) & 0xFFFFu;   // groups l and 2 + l
    v0 = iq_signed(iq2xs_grid((int)(q0 & 511u), h), iq_signs(q0 >> 9) >> (4 * h));
    v1 = iq_signed(iq2xs_grid((int)(q1 & 511u), h), iq_signs(q1 >> 9) >> (4 * h));
    a0 = iq2_scale(r.b, r.a.z & 15u);
    a1 = iq2_scale(r.b, r.a.z >> 4);
}

template <> __device__ __forceinline__ void lt_load<QT_IQ2_S>(const u8* __restrict__ row, int u, int nu, int, LRaw& r) {
    lb_load<QT_IQ2_S>(row, u, nu, r);
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ2_S>(const LRaw& r, int u, int t, u32& v0, u32& v1, float& a0,
                                                                 float& a1) {
    const int l = t >> 1, h = t & 1;
    const u32 g0 = ((r.a.x >> (8 * l)) & 255u) | (((r.a.z >> (2 * l)) & 3u) << 8);
    const u32 g1 = ((r.a.x >> (8 * l + 16)) & 255u) | (((r.a.z >> (2 * l + 4)) & 3u) << 8);
    v0 = iq_signed(iq2s_grid((int)g0, h), r.a.y >> (8 * l + 4 * h));
    v1 = iq_signed(iq2s_grid((int)g1, h), r.a.y >> (8 * l + 16 + 4 * h));
    a0 = iq2_scale(r.b, r.a.w & 15u);
    a1 = iq2_scale(r.b, r.a.w >> 4);
}

// the 4-value grid types: columns 4t.. are run t, columns 16 + 4t.. run 4 + t
template <> __device__ __forceinline__ void lt_load<QT_IQ3_XXS>(const u8* __restrict__ row, int u, int nu, int, LRaw& r) {
    lb_load<QT_IQ3_XXS>(row, u, nu, r);
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ3_XXS>(const LRaw& r, int u, int t, u32& v0, u32& v1, float& a0,
                                                                   float& a1) {
    const int l = t >> 1, h = t & 1;           // run t: group l, half h; run 4 + t: group 2 + l
    v0 = iq_signed(iq3xxs_grid((int)((r.a.x >> (8 * t)) & 255u)), iq_signs((r.a.z >> (7 * l)) & 127u) >> (4 * h));
    v1 = iq_signed(iq3xxs_grid((int)((r.a.y >> (8 * t)) & 255u)), iq_signs((r.a.z >> (7 * l + 14)) & 127u) >> (4 * h));
    a0 = a1 = h2f((u16)r.b) * (0.5f + (float)(r.a.z >> 28)) * 0.5f;
}

template <> __device__ __forceinline__ void lt_load<QT_IQ3_S>(const u8* __restrict__ row, int u, int nu, int, LRaw& r) {
    lb_load<QT_IQ3_S>(row, u, nu, r);
}

template <> __device__ __forceinline__ void lt_decode<QT_IQ3_S>(const LRaw& r, int u, int t, u32& v0, u32& v1, float& a0,
                                                                 float& a1) {
    v0 = iq3s_run(r, t);
    v1 = iq3s_run(r, 4 + t);
    a0 = a1 = iq3s_scale(r, u & 7);
}

// Q3_K: the qs and hmask words of columns 4t.. and 16 + 4t.. (four 2-byte aligned words), the two
// scale bytes pairs (q3k_scales) and d
template <> __device__ __forceinline__ void lt_load<QT_Q3_K>(const u8* __restrict__ row, int u, int, int t, LRaw& r) {
    const u8* b = row + (u >> 3) * 110;
    const int j = u & 7;
    r.a.x = (u32)ld32_a2(b + 32 + 32 * (j >> 2) + 4 * t);
    r.a.y = (u32)ld32_a2(b + 48 + 32 * (j >> 2) + 4 * t);
    r.a.z = (u32)ld32_a2(b + 4 * t);
    r.a.w = (u32)ld32_a2(b + 16 + 4 * t);
    r.b = ld16(b + 96 + 2 * (j & 3));
    r.c = ld16(b + 104 + 2 * (j & 1));
    r.d = ld16(b + 108);
}

template <> __device__ __forceinline__ void lt_decode<QT_Q3_K>(const LRaw& r, int u, int, u32& v0, u32& v1, float& a0,
                                                                float& a1) {
    const int j = u & 7;
    v0 = ((r.a.x >> (2 * (j & 3))) & 0x03030303u) | (((r.a.z >> j) & 0x01010101u) << 2);
    v1 = ((r.a.y >> (2 * (j & 3))) & 0x03030303u) | (((r.a.w >> j) & 0x01010101u) << 2);
    q3k_scale_pair(r.b, r.c, r.d, j, a0, a1);
}

// ------------------------------------------------------------------ the common decoders
template <int QT>
__device__ __forceinline__ void lunit_floats(const LUnit& x, float (&w)[32]) {
    constexpr int OFF = lowbit_off(QT);
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float q = (float)((int)((x.v[i] >> (8 * k)) & 255u) - OFF);
            w[4 * i + k] = i < 4 ? x.a0 * q + x.m0 : x.a1 * q + x.m1;
        }
}

// FUnit (common.cuh, mmvf.cu): the signed types as Q8_0's bytes q + 128 (funit_s8), scale per half;
// Q2_K and Q3_K as the unsigned types (2 and 3 bits)
template <int QT>
__device__ __forceinline__ void lunit_funit(const LUnit& x, FUnit& w) {
    if constexpr (lowbit_off(QT) == 128) {
#pragma unroll
        for (int i = 0; i < 8; ++i) w.v[i] = x.v[i];
        w.a0 = x.a0;
        w.a1 = x.a1;
        w.c0 = w.c1 = 0.0f;
    } else {
        constexpr int BITS = QT == QT_Q2_K ? 2 : 3, OFF = lowbit_off(QT);
#pragma unroll
        for (int i = 0; i < 8; ++i) w.v[i] = x.v[i] << (7 - BITS);
        // a = 2^(bits+1) A, c = C - 2^bits A with the weight A b + C, C = m - OFF A (power-of-two scalings: exact)
        w.a0 = x.a0 * (float)(2 << BITS);
        w.a1 = x.a1 * (float)(2 << BITS);
        w.c0 = x.m0 - x.a0 * (float)(OFF + (1 << BITS));
        w.c1 = x.m1 - x.a1 * (float)(OFF + (1 << BITS));
    }
}

#define LOWBIT_DECODERS(Q)                                                                                         \
    template <> __device__ __forceinline__ void load_unit<Q>(const u8* __restrict__ row, int u, int K, float (&w)[32]) { \
        LUnit x;                                                                                                   \
        load_lunit<Q>(row, u, K >> 5, x);                                                                          \
        lunit_floats<Q>(x, w);                                                                                     \
    }                                                                                                              \
    template <> __device__ __forceinline__ void load_funit<Q>(const u8* __restrict__ row, int u, int nu, FUnit& w) { \
        LUnit x;                                                                                                   \
        load_lunit<Q>(row, u, nu, x);                                                                              \
        lunit_funit<Q>(x, w);                                                                                      \
    }
LOWBIT_DECODERS(QT_Q2_K)
LOWBIT_DECODERS(QT_Q3_K)
LOWBIT_DECODERS(QT_IQ4_NL)
LOWBIT_DECODERS(QT_IQ4_XS)
LOWBIT_DECODERS(QT_MXFP4)
LOWBIT_DECODERS(QT_IQ2_XXS)
LOWBIT_DECODERS(QT_IQ2_XS)
LOWBIT_DECODERS(QT_IQ2_S)
LOWBIT_DECODERS(QT_IQ3_XXS)
LOWBIT_DECODERS(QT_IQ3_S)
#undef LOWBIT_DECODERS
