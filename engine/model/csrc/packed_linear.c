#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float v8f __attribute__((vector_size(32)));

enum { FMT_Q4_0 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };

static inline int block_bytes(int fmt) { return fmt == FMT_Q4_0 ? 18 : fmt == FMT_Q4_1 ? 20 : 34; }

static inline float f16(const uint8_t *p) { _Float16 h; memcpy(&h, p, 2); return (float)h; }

static inline v8f ld8(const float *p) { v8f v; memcpy(&v, p, 32); return v; }
static inline float hsum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

/* 32 weights of one block as fp32: exactly gguf's dequantization (d * q is exact in fp32, so a fused
   multiply-add rounds the same as gguf's multiply-then-add). */
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
static inline __m256 u8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q)); }
static inline __m256 i8x8(__m128i q) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)); }
static inline __m256 rbf16(__m256 v) {
    __m256i u = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    u = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(u, _mm256_set1_epi32((int)0xffff0000u)));
}
static inline __attribute__((always_inline)) void deq_regs(int fmt, const uint8_t *b, int bf16, __m256 *v) {
    const __m256 d = _mm256_set1_ps(f16(b));
    if (fmt == FMT_Q8_0) {
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b + 2)), q1 = _mm_loadu_si128((const __m128i *)(b + 18));
        v[0] = _mm256_mul_ps(i8x8(q0), d);
        v[1] = _mm256_mul_ps(i8x8(_mm_srli_si128(q0, 8)), d);
        v[2] = _mm256_mul_ps(i8x8(q1), d);
        v[3] = _mm256_mul_ps(i8x8(_mm_srli_si128(q1, 8)), d);
    } else {
        const int off = fmt == FMT_Q4_1 ? 4 : 2;
        const __m256 m = fmt == FMT_Q4_1 ? _mm256_set1_ps(f16(b + 2)) : _mm256_mul_ps(d, _mm256_set1_ps(-8.0f));
        const __m128i q = _mm_loadu_si128((const __m128i *)(b + off)), mask = _mm_set1_epi8(15);
        const __m128i lo = _mm_and_si128(q, mask), hi = _mm_and_si128(_mm_srli_epi16(q, 4), mask);
        if (fmt == FMT_Q4_1) {
            v[0] = _mm256_fmadd_ps(u8x8(lo), d, m);
            v[1] = _mm256_fmadd_ps(u8x8(_mm_srli_si128(lo, 8)), d, m);
            v[2] = _mm256_fmadd_ps(u8x8(hi), d, m);
            v[3] = _mm256_fmadd_ps(u8x8(_mm_srli_si128(hi, 8)), d, m);
        } else { /* (q - 8) * d, with q - 8 exact */
            const __m256 eight = _mm256_set1_ps(8.0f);
            v[0] = _mm256_mul_ps(_mm256_sub_ps(u8x8(lo), eight), d);
            v[1] = _mm256_mul_ps(_mm256_sub_ps(u8x8(_mm_srli_si128(lo, 8)), eight), d);
            v[2] = _mm256_mul_ps(_mm256_sub_ps(u8x8(hi), eight), d);
            v[3] = _mm256_mul_ps(_mm256_sub_ps(u8x8(_mm_srli_si128(hi, 8)), eight), d);
            (void)m;
        }
    }
    if (bf16) for (int i = 0; i < 4; i++) v[i] = rbf16(v[i]);
}
static inline __attribute__((always_inline)) void deq_block(int fmt, const uint8_t *b, int bf16, float *w) {
    __m256 v[4];
    deq_regs(fmt, b, bf16, v);
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(w + 8 * i, v[i]);
}
#define HAVE_FUSED 1
/* RB rows x OB output rows, dequantizing each block straight into registers (no tile buffer): for few rows the
   tile's store and reload cost more than the multiply-adds. */
#define FUSED(RB, OB)                                                                                         \
static inline __attribute__((always_inline)) void fused_##RB##_##OB(                                         \
    int fmt, int bf16, const float *x, int64_t K, const uint8_t *w, int64_t row_bytes, int bb, float *out) {  \
    __m256 acc[RB][OB][4];                                                                                    \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) for (int j = 0; j < 4; j++)                    \
        acc[r][o][j] = _mm256_setzero_ps();                                                                   \
    for (int64_t b = 0; b < K / 32; b++) {                                                                    \
        for (int o = 0; o < OB; o++) {                                                                        \
            __m256 v[4];                                                                                      \
            deq_regs(fmt, w + o * row_bytes + b * bb, bf16, v);                                               \
            for (int r = 0; r < RB; r++) for (int j = 0; j < 4; j++)                                          \
                acc[r][o][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + b * 32 + 8 * j), v[j], acc[r][o][j]); \
        }                                                                                                     \
    }                                                                                                         \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) {                                               \
        const __m256 a01 = _mm256_add_ps(acc[r][o][0], acc[r][o][1]);                                        \
        out[r * OB + o] = hsum8((v8f)_mm256_add_ps(a01, _mm256_add_ps(acc[r][o][2], acc[r][o][3])));          \
    }                                                                                                         \
}

#else
static inline float rbf16s(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}
static inline void deq_block(int fmt, const uint8_t *b, int bf16, float *w) {
    const float d = f16(b);
    for (int j = 0; j < 32; j++) {
        float v;
        if (fmt == FMT_Q8_0) v = (float)(int8_t)b[2 + j] * d;
        else {
            const int off = fmt == FMT_Q4_1 ? 4 : 2;
            const int q = j < 16 ? (b[off + j] & 15) : (b[off + j - 16] >> 4);
            v = fmt == FMT_Q4_1 ? (float)q * d + f16(b + 2) : (float)(q - 8) * d;
        }
        w[j] = bf16 ? rbf16s(v) : v;
    }
}
#endif

/* y[r][o] for RB rows x OB outputs, over K (multiple of 8); weights dequantized into w (OB rows of K) */
#define MICRO(RB, OB)                                                                                         \
static inline __attribute__((always_inline)) void micro_##RB##_##OB(                                         \
    const float *x, int64_t xs, const float *w, int64_t K, float *out /* [RB][OB] */) {                     \
    v8f acc[RB][OB];                                                                                          \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) acc[r][o] = (v8f){0};                          \
    for (int64_t k = 0; k < K; k += 8) {                                                                      \
        v8f wv[OB];                                                                                           \
        for (int o = 0; o < OB; o++) wv[o] = ld8(w + o * K + k);                                              \
        for (int r = 0; r < RB; r++) {                                                                        \
            const v8f xv = ld8(x + r * xs + k);                                                               \
            for (int o = 0; o < OB; o++) acc[r][o] += xv * wv[o];                                             \
        }                                                                                                     \
    }                                                                                                         \
    for (int r = 0; r < RB; r++) for (int o = 0; o < OB; o++) out[r * OB + o] = hsum8(acc[r][o]);            \
}
MICRO(6, 2) /* 12 accumulators: measured best of 4x2, 4x3, 3x4, 5x2, 6x2, 7x2 on AVX2 */
MICRO(2, 4)
MICRO(1, 8)
#ifdef HAVE_FUSED
FUSED(1, 2)
FUSED(1, 1)
FUSED(2, 1)
#endif

#define OT 8

/* y[r][o] = v + bias[o], rounded to bf16 when the activations are bf16 */
static inline void put(void *y, int y_bf16, int64_t r, int64_t O, int64_t o, float v, const float *bias) {
    const int64_t idx = r * O + o;
    if (bias) v += bias[o];
    if (y_bf16) {
        uint32_t u; memcpy(&u, &v, 4);
        if ((u & 0x7fffffffu) > 0x7f800000u) { ((uint16_t *)y)[idx] = (uint16_t)((u >> 16) | 0x40u); return; } /* NaN */
        u += 0x7fffu + ((u >> 16) & 1u);
        ((uint16_t *)y)[idx] = (uint16_t)(u >> 16);
    } else {
        ((float *)y)[idx] = v;
    }
}

/* y[R, O] = x[R, K] @ W^T (+ bias); W packed rows of K/32 blocks. x fp32 (already converted). */
void kvchat_packed_linear(const float *x, int64_t R, int64_t K, const uint8_t *w, int fmt, int64_t O,
                          const float *bias, void *y, int bf16, int nthreads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
    const int64_t ntiles = (O + OT - 1) / OT;
#ifdef HAVE_FUSED
    if (R <= 2) {
        const int bb = block_bytes(fmt);
        const int64_t step = R == 1 ? 2 : 1;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t o = 0; o < O; o += step) {
            float res[2];
            const uint8_t *wo = w + o * row_bytes;
            int n = 1;
            if (R == 1 && o + 1 < O) { fused_1_2(fmt, bf16, x, K, wo, row_bytes, bb, res); n = 2; }
            else if (R == 1) fused_1_1(fmt, bf16, x, K, wo, row_bytes, bb, res);
            else fused_2_1(fmt, bf16, x, K, wo, row_bytes, bb, res);
            for (int r = 0; r < R; r++)
                for (int j = 0; j < n; j++) put(y, bf16, r, O, o + j, res[r * n + j], bias);
        }
        return;
    }
#endif
#pragma omp parallel num_threads(nthreads)
    {
        float *wt = (float *)aligned_alloc(64, sizeof(float) * (size_t)(OT * K));
        float res[12];
#pragma omp for schedule(static)
        for (int64_t t = 0; t < ntiles; t++) {
            if (!wt) continue; /* out of memory: leave y unset rather than crash (cannot happen at these sizes) */
            const int64_t o0 = t * OT, on = (O - o0 < OT) ? O - o0 : OT;
            for (int64_t o = 0; o < on; o++) {
                const uint8_t *row = w + (o0 + o) * row_bytes;
                for (int64_t b = 0; b < nb; b++) deq_block(fmt, row + b * block_bytes(fmt), bf16, wt + o * K + b * 32);
            }
            for (int64_t o = on; o < OT; o++) memset(wt + o * K, 0, sizeof(float) * K);
            int64_t r = 0;
            for (; r + 6 <= R; r += 6)
                for (int o = 0; o < OT; o += 2) {
                    micro_6_2(x + r * K, K, wt + o * K, K, res);
                    for (int i = 0; i < 6; i++)
                        for (int j = 0; j < 2; j++)
                            if (o + j < on) put(y, bf16, r + i, O, o0 + o + j, res[i * 2 + j], bias);
                }
            for (; r + 2 <= R; r += 2)
                for (int o = 0; o < OT; o += 4) {
                    micro_2_4(x + r * K, K, wt + o * K, K, res);
                    for (int i = 0; i < 2; i++) for (int j = 0; j < 4; j++)
                        if (o + j < on) put(y, bf16, r + i, O, o0 + o + j, res[i * 4 + j], bias);
                }
            for (; r < R; r++) {
                micro_1_8(x + r * K, K, wt, K, res);
                for (int j = 0; j < on; j++) put(y, bf16, r, O, o0 + j, res[j], bias);
            }
        }
        free(wt);
    }
}

void kvchat_packed_dequant(const uint8_t *w, int fmt, int64_t O, int64_t K, float *out, int bf16, int nthreads)
{
    const int64_t nb = K / 32, row_bytes = nb * block_bytes(fmt);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t o = 0; o < O; o++)
        for (int64_t b = 0; b < nb; b++)
            deq_block(fmt, w + o * row_bytes + b * block_bytes(fmt), bf16, out + o * K + b * 32);
}
