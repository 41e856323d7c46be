/* Shared by the kernels: bf16 <-> fp32 as torch rounds, 16-lane fp32 vectors, exp, 16-way sums. */
#ifndef KVCHAT_PRELUDE_H
#define KVCHAT_PRELUDE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_load(const uint16_t *p) {
    uint32_t u = (uint32_t)(*p) << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t bf16_store(float f) {  /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* dst[0:n] = row as fp32; returns a pointer to the fp32 values (the row itself when it already is fp32). */
static inline const float *row_f32(const void *base, int64_t off, int64_t n, int bf16, float *restrict dst) {
    if (!bf16) return (const float *)base + off;
    const uint16_t *src = (const uint16_t *)base + off;
#pragma omp simd
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = (uint32_t)src[i] << 16;
        float f;
        memcpy(&f, &u, 4);
        dst[i] = f;
    }
    return dst;
}

/* GCC vector extensions: 16 fp32 lanes (one AVX-512 register, two AVX2 ones, scalar code elsewhere). */
typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

static inline v16f load16(const float *p) { v16f v; memcpy(&v, p, 64); return v; }
static inline void store16(float *p, v16f v) { memcpy(p, &v, 64); }
/* x in every lane (a broadcast; `(v16f){} + x` would also add 0.0 to x first, which may not be dropped: -0.0) */
static inline v16f splat16(float x) { return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

/* 16 bf16 values as fp32, and back with bf16_store's rounding */
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline v16f bf16_load16(const uint16_t *p) {
    v16h h;
    memcpy(&h, p, 32);
    return (v16f)(__builtin_convertvector(h, v16u) << 16);
}

/* bf16_store's rounding on 16 lanes, kept as fp32 (the low 16 bits cleared) */
static inline v16f bf16_round16(v16f f) {
    const v16u u = (v16u)f;
    const v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const v16u nan = (v16u)((u & 0x7fffffffu) > 0x7f800000u);
    return (v16f)((rounded & ~nan) | ((u | 0x400000u) & 0xffff0000u & nan));
}

static inline void bf16_put16(uint16_t *p, v16f rounded) { /* 16 values already rounded by bf16_round16 */
    const v16h h = __builtin_convertvector((v16u)rounded >> 16, v16h);
    memcpy(p, &h, 32);
}

static inline void bf16_store16(uint16_t *p, v16f f) { bf16_put16(p, bf16_round16(f)); } /* bf16_store, 16 lanes */

/* floor(x) as integers: truncation, then negative values that it rounded up taken down */
#define FLOOR_GENERIC(VF, VI, x) \
    ({ VI n_ = __builtin_convertvector(x, VI); n_ + (__builtin_convertvector(n_, VF) > (x)); })
#ifdef __AVX512F__
#include <immintrin.h>
/* (one conversion rounding down: the same integers, 1 instruction instead of 4) */
#define FLOOR16(x) ((v16i)_mm512_cvt_roundps_epi32((__m512)(x), _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC))
#else
#define FLOOR16(x) FLOOR_GENERIC(v16f, v16i, x)
#endif

/* exp(x) for x <= 0, 16 lanes (Cephes expf polynomial, ~1 ulp); EXP_NEG makes it for other vector widths. */
#define EXP_NEG(NAME, VF, VI, FLOOR)                                                                        \
static inline VF NAME(VF x) {                                                                                        \
    const VF lo = x - x - 87.0f;                                                                                     \
    const VI below = x < lo; /* lanes are 0 or -1 */                                                                 \
    x = (VF)(((VI)x & ~below) | ((VI)lo & below));                                                                   \
    const VF fx = x * 1.44269504088896341f + 0.5f;                                                                   \
    const VI n = FLOOR(fx);                                                                                          \
    const VF nf = __builtin_convertvector(n, VF);                                                                    \
    const VF r = x - nf * 0.693359375f + nf * 2.12194440e-4f;                                                        \
    VF p = r * 1.9875691500e-4f + 1.3981999507e-3f;                                                                  \
    p = p * r + 8.3334519073e-3f;                                                                                    \
    p = p * r + 4.1665795894e-2f;                                                                                    \
    p = p * r + 1.6666665459e-1f;                                                                                    \
    p = p * r + 5.0000001201e-1f;                                                                                    \
    p = p * r * r + r + 1.0f;                                                                                        \
    return p * (VF)((n + 127) << 23);                                                                                \
}
EXP_NEG(exp_neg16, v16f, v16i, FLOOR16)
/* 8 lanes: one AVX2 register (where 16-lane vectors are register pairs, and 8-lane loops measured faster) */
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));
#define FLOOR8(x) FLOOR_GENERIC(v8f, v8i, x)
EXP_NEG(exp_neg8, v8f, v8i, FLOOR8)

static inline float exp_neg(float x) {
    v16f v = {x};
    return exp_neg16(v)[0];
}

/* Sums of 16 vectors: out[j] = sum of a[j]'s lanes, by a transpose-reduce tree (15 pairs of two-source shuffles,
   each pair's halves added). With AVX-512 the shuffles are 128-bit-lane selects (vshuff32x4) and in-lane selects
   (vshufps), cheaper than the index permutes (vpermt2ps, which also overwrites a source) the generic form compiles
   to; that tree leaves the sum of its k-th input in lane 4 * (k % 4) + k / 4, so it takes its inputs in that order. */
#ifdef __AVX512F__
#include <immintrin.h>
static inline __attribute__((always_inline)) v16f sum16v(const v16f *a) {
    static const int order[16] = {0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15};
    __m512 l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++) { /* 256-bit halves: [x0 + x2, x1 + x3, y0 + y2, y1 + y3] in 128-bit lanes */
        const __m512 x = (__m512)a[order[2 * i]], y = (__m512)a[order[2 * i + 1]];
        l1[i] = _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x44), _mm512_shuffle_f32x4(x, y, 0xEE));
    }
    for (int i = 0; i < 4; i++) /* 128-bit lanes: lane L of l2[i] holds 4 partial sums of input 4i + L */
        l2[i] = _mm512_add_ps(_mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0x88),
                              _mm512_shuffle_f32x4(l1[2 * i], l1[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* within lanes: pairs */
        l3[i] = _mm512_add_ps(_mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0x44),
                              _mm512_shuffle_ps(l2[2 * i], l2[2 * i + 1], 0xEE));
    return (v16f)_mm512_add_ps(_mm512_shuffle_ps(l3[0], l3[1], 0x88), _mm512_shuffle_ps(l3[0], l3[1], 0xDD));
}
#else
static inline __attribute__((always_inline)) v16f sum16v(const v16f *a) {
    const v16i lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
    const v16i hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
    const v16i lo2 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
    const v16i hi2 = {4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31};
    const v16i lo3 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
    const v16i hi3 = {2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31};
    const v16i lo4 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
    const v16i hi4 = {1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    v16f l1[8], l2[4], l3[2];
    for (int i = 0; i < 8; i++)
        l1[i] = __builtin_shuffle(a[2 * i], a[2 * i + 1], lo1) + __builtin_shuffle(a[2 * i], a[2 * i + 1], hi1);
    for (int i = 0; i < 4; i++)
        l2[i] = __builtin_shuffle(l1[2 * i], l1[2 * i + 1], lo2) + __builtin_shuffle(l1[2 * i], l1[2 * i + 1], hi2);
    for (int i = 0; i < 2; i++)
        l3[i] = __builtin_shuffle(l2[2 * i], l2[2 * i + 1], lo3) + __builtin_shuffle(l2[2 * i], l2[2 * i + 1], hi3);
    return __builtin_shuffle(l3[0], l3[1], lo4) + __builtin_shuffle(l3[0], l3[1], hi4);
}
#endif

#endif
