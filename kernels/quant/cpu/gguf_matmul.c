/*
 * y = x · W^T with W held as GGUF 4-bit or 8-bit blocks of 32 weights, for CPUs.
 *
 * A decode step reads every weight once, so at a few rows its time is the time to stream the
 * weights from memory: 4-bit blocks are a sixth of the float32 bytes. Each block is expanded to
 * float32 in registers (w = d * q + m for 4-bit, w = d * q for 8-bit, as the dequantized
 * weights would be) and multiplied with float32 activations, so the result is the float32
 * product up to summation order. Activations are never quantized.
 *
 * Layout (made by kernels/quant/gguf_blocks.py at load):
 *   4-bit: qs [N, K/2] bytes, byte j of a block holds weight j (low nibble) and j + 16 (high);
 *          scales and mins [N, K/32] float16.
 *   8-bit: qs [N, K] int8; scales [N, K/32] float16; mins unused.
 *
 * Vector paths: AVX-512, else AVX2 with FMA, else portable C (the compiler's -march=native
 * picks; kernels/c_build.py compiles per CPU).
 *
 * Rows of W are split over the OpenMP threads of the process (torch's own pool, as the library
 * resolves libgomp to the one torch has loaded).
 */
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif

enum { KIND_Q4 = 0, KIND_Q8 = 1 };
/* x rows per tile: with AVX2's 16 vector registers, 4 rows keep two weight rows' expanded
 * block (8 registers) and the accumulators (8) in registers. */
#if defined(__AVX512F__) || !(defined(__AVX2__) && defined(__FMA__))
enum { BLOCK = 32, ROWS_PER_TILE = 8 };
#else
enum { BLOCK = 32, ROWS_PER_TILE = 4 };
#endif

typedef struct {
    const float *x;
    int64_t stride_x;
    float *y;
    int64_t stride_y;
    const uint8_t *qs;
    const uint16_t *scales;
    const uint16_t *mins;
    int64_t m, n, k;
    int kind;
} QMatmulArgs;

static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    uint32_t bits;
    if (exponent == 0x1f) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {  /* subnormal: renormalise */
        exponent = 113;
        while (!(mantissa & 0x400)) {
            mantissa <<= 1;
            exponent--;
        }
        bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
#endif
}

/* The 32 weights of block b of row n, as float32. */
static inline void expand_block(const QMatmulArgs *a, int64_t n, int64_t b, float *w) {
    int64_t blocks = a->k / BLOCK;
    float d = half_to_float(a->scales[n * blocks + b]);
    if (a->kind == KIND_Q4) {
        float m = half_to_float(a->mins[n * blocks + b]);
        const uint8_t *q = a->qs + n * (a->k / 2) + b * (BLOCK / 2);
        for (int j = 0; j < BLOCK / 2; j++) {
            w[j] = d * (float)(q[j] & 15) + m;
            w[j + BLOCK / 2] = d * (float)(q[j] >> 4) + m;
        }
    } else {
        const int8_t *q = (const int8_t *)a->qs + n * a->k + b * BLOCK;
        for (int j = 0; j < BLOCK; j++) w[j] = d * (float)q[j];
    }
}

#if defined(__AVX512F__)
/* Block b of row n of W as float32, in two halves of 16 weights. */
static inline void expand_avx512(const QMatmulArgs *a, int64_t n, int64_t b, __m512 *lo, __m512 *hi) {
    int64_t blocks = a->k / BLOCK;
    __m512 d = _mm512_set1_ps(half_to_float(a->scales[n * blocks + b]));
    if (a->kind == KIND_Q4) {
        __m512 m = _mm512_set1_ps(half_to_float(a->mins[n * blocks + b]));
        __m128i bytes = _mm_loadu_si128((const __m128i *)(a->qs + n * (a->k / 2) + b * 16));
        __m512i q = _mm512_cvtepu8_epi32(bytes);
        *lo = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15))), m);
        *hi = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), m);
    } else {
        const int8_t *q = (const int8_t *)a->qs + n * a->k + b * BLOCK;
        *lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)q))));
        *hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(q + 16)))));
    }
}

/* Rows n, n + 1 of W (or n alone when pair is 0) against up to ROWS_PER_TILE rows of x from
 * row i: each expanded block is used by every x row of the tile. */
static void row_tile(const QMatmulArgs *a, int64_t n, int pair, int64_t i, int rows) {
    int64_t blocks = a->k / BLOCK;
    __m512 acc0[ROWS_PER_TILE], acc1[ROWS_PER_TILE];
    for (int r = 0; r < ROWS_PER_TILE; r++) acc0[r] = acc1[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m512 lo0, hi0, lo1 = _mm512_setzero_ps(), hi1 = _mm512_setzero_ps();
        expand_avx512(a, n, b, &lo0, &hi0);
        if (pair) expand_avx512(a, n + 1, b, &lo1, &hi1);
        for (int r = 0; r < rows; r++) {
            const float *x = a->x + (i + r) * a->stride_x + b * BLOCK;
            __m512 x_lo = _mm512_loadu_ps(x), x_hi = _mm512_loadu_ps(x + 16);
            acc0[r] = _mm512_fmadd_ps(hi0, x_hi, _mm512_fmadd_ps(lo0, x_lo, acc0[r]));
            if (pair) acc1[r] = _mm512_fmadd_ps(hi1, x_hi, _mm512_fmadd_ps(lo1, x_lo, acc1[r]));
        }
    }
    for (int r = 0; r < rows; r++) {
        float *y = a->y + (i + r) * a->stride_y + n;
        y[0] = _mm512_reduce_add_ps(acc0[r]);
        if (pair) y[1] = _mm512_reduce_add_ps(acc1[r]);
    }
}
#elif defined(__AVX2__) && defined(__FMA__)
/* Block b of row n of W as float32, in four vectors of 8 weights (0-7, 8-15, 16-23, 24-31). */
static inline void expand_avx2(const QMatmulArgs *a, int64_t n, int64_t b, __m256 w[4]) {
    int64_t blocks = a->k / BLOCK;
    __m256 d = _mm256_set1_ps(half_to_float(a->scales[n * blocks + b]));
    if (a->kind == KIND_Q4) {
        __m256 m = _mm256_set1_ps(half_to_float(a->mins[n * blocks + b]));
        __m128i bytes = _mm_loadu_si128((const __m128i *)(a->qs + n * (a->k / 2) + b * 16));
        __m128i nibble = _mm_set1_epi8(15);
        __m128i low = _mm_and_si128(bytes, nibble);
        __m128i high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
        __m128i parts[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
        for (int v = 0; v < 4; v++) {
            __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[v]));
            w[v] = _mm256_fmadd_ps(d, q, m);
        }
    } else {
        const int8_t *q = (const int8_t *)a->qs + n * a->k + b * BLOCK;
        for (int v = 0; v < 4; v++) {
            __m128i bytes = _mm_loadl_epi64((const __m128i *)(q + 8 * v));
            w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)));
        }
    }
}

static inline float sum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* As the AVX-512 tile: rows n, n + 1 of W against up to ROWS_PER_TILE rows of x. */
static void row_tile(const QMatmulArgs *a, int64_t n, int pair, int64_t i, int rows) {
    int64_t blocks = a->k / BLOCK;
    __m256 acc0[ROWS_PER_TILE], acc1[ROWS_PER_TILE];
    for (int r = 0; r < ROWS_PER_TILE; r++) acc0[r] = acc1[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; b++) {
        __m256 w0[4], w1[4];
        expand_avx2(a, n, b, w0);
        if (pair) expand_avx2(a, n + 1, b, w1);
        for (int r = 0; r < rows; r++) {
            const float *x = a->x + (i + r) * a->stride_x + b * BLOCK;
            for (int v = 0; v < 4; v++) {
                __m256 xv = _mm256_loadu_ps(x + 8 * v);
                acc0[r] = _mm256_fmadd_ps(w0[v], xv, acc0[r]);
                if (pair) acc1[r] = _mm256_fmadd_ps(w1[v], xv, acc1[r]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float *y = a->y + (i + r) * a->stride_y + n;
        y[0] = sum_avx2(acc0[r]);
        if (pair) y[1] = sum_avx2(acc1[r]);
    }
}
#else
static void row_tile_one(const QMatmulArgs *a, int64_t n, int64_t i, int rows) {
    int64_t blocks = a->k / BLOCK;
    float acc[ROWS_PER_TILE][BLOCK];
    memset(acc, 0, sizeof acc);
    float w[BLOCK];
    for (int64_t b = 0; b < blocks; b++) {
        expand_block(a, n, b, w);
        for (int r = 0; r < rows; r++) {
            const float *x = a->x + (i + r) * a->stride_x + b * BLOCK;
            for (int j = 0; j < BLOCK; j++) acc[r][j] += w[j] * x[j];
        }
    }
    for (int r = 0; r < rows; r++) {
        float sum = 0.0f;
        for (int j = 0; j < BLOCK; j++) sum += acc[r][j];
        a->y[(i + r) * a->stride_y + n] = sum;
    }
}

static void row_tile(const QMatmulArgs *a, int64_t n, int pair, int64_t i, int rows) {
    row_tile_one(a, n, i, rows);
    if (pair) row_tile_one(a, n + 1, i, rows);
}
#endif

int gguf_matmul(const QMatmulArgs *a) {
    if (a->k % BLOCK != 0) return 1;
    if (a->kind != KIND_Q4 && a->kind != KIND_Q8) return 2;
    int64_t pairs = (a->n + 1) / 2;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < pairs; p++) {
        int64_t n = 2 * p;
        int pair = n + 1 < a->n;
        for (int64_t i = 0; i < a->m; i += ROWS_PER_TILE) {
            int64_t left = a->m - i;
            row_tile(a, n, pair, i, left < ROWS_PER_TILE ? (int)left : ROWS_PER_TILE);
        }
    }
    return 0;
}

/* W as float32 [N, K] into out (for products of many rows, which a float GEMM does faster). */
int gguf_dequantize(const QMatmulArgs *a, float *out) {
    if (a->k % BLOCK != 0) return 1;
    if (a->kind != KIND_Q4 && a->kind != KIND_Q8) return 2;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < a->n; n++) {
        for (int64_t b = 0; b < a->k / BLOCK; b++) {
            float *w = out + n * a->k + b * BLOCK;
#if defined(__AVX512F__)
            __m512 lo, hi;
            expand_avx512(a, n, b, &lo, &hi);
            _mm512_storeu_ps(w, lo);
            _mm512_storeu_ps(w + 16, hi);
#elif defined(__AVX2__) && defined(__FMA__)
            __m256 parts[4];
            expand_avx2(a, n, b, parts);
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(w + 8 * v, parts[v]);
#else
            expand_block(a, n, b, w);
#endif
        }
    }
    return 0;
}
