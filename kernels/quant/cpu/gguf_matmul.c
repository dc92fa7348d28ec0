/*
 * y = x · W^T with W held as GGUF 4-bit or 8-bit blocks of 32 weights, for CPUs.
 *
 * A decode step reads every weight once, so at a few rows its time is the time to stream the
 * weights from memory: 4-bit blocks are a sixth of the float32 bytes. Each block is expanded to
 * float32 in registers (w = d * q + m for 4-bit, w = d * q for 8-bit, as the dequantized
 * weights would be) and multiplied with float32 activations, so the result is the float32
 * product up to summation order. The integer path further down (a decode step's few rows)
 * rounds the activations to int16 per block instead.
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
#include <stdlib.h>
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

/* How far ahead of the row being multiplied its thread asks for W's bytes. At a decode step's
 * one or two rows the kernel is bound by memory: without the hint a row's bytes are requested
 * only when its arithmetic starts, and the core waits; eight rows ahead (2.3 KB of a 576-wide
 * 4-bit W) cut SmolLM2's step matmuls by a tenth (3.7 vs 3.9 ms, LM head 1.07 vs 1.21 ms,
 * two cores, bitwise the same). */
enum { PREFETCH_ROWS = 8 };

/* Ask for row n of W (its blocks, scales and minimums) to be brought into the cache. An
 * address past the end is harmless: prefetches never fault. */
static inline void prefetch_row(const QMatmulArgs *a, int64_t n) {
    int64_t blocks = a->k / BLOCK;
    int64_t row_bytes = a->kind == KIND_Q4 ? a->k / 2 : a->k;
    const uint8_t *q = a->qs + n * row_bytes;
    for (int64_t offset = 0; offset < row_bytes; offset += 64) __builtin_prefetch(q + offset);
    __builtin_prefetch(a->scales + n * blocks);
    if (a->kind == KIND_Q4) __builtin_prefetch(a->mins + n * blocks);
}

#if defined(__AVX2__)
/* The eight lanes' sum (the AVX2 tile and the int16 path, on AVX-512 machines too). */
static inline float sum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#endif

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

/* Rows n, n + 1 of W (or n alone when pair is 0) against `rows` (1 to ROWS_PER_TILE) rows
 * of x from row i: each expanded block is used by every x row of the tile. Inlined with `rows`
 * a constant, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void rows_tile(const QMatmulArgs *a, int64_t n,
                                                            int pair, int64_t i, const int rows) {
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

/* One instantiation per row count: with `rows` known only at run time the accumulators are
 * indexed in memory, and a tile of 5 rows (a speculative verification's) loads and stores
 * one for every multiply-add (the Q8 LM head: 4.63 against 3.98 ms at 5 rows). */
static void row_tile(const QMatmulArgs *a, int64_t n, int pair, int64_t i, int rows) {
    switch (rows) {
    case 1: rows_tile(a, n, pair, i, 1); break;
    case 2: rows_tile(a, n, pair, i, 2); break;
    case 3: rows_tile(a, n, pair, i, 3); break;
    case 4: rows_tile(a, n, pair, i, 4); break;
    case 5: rows_tile(a, n, pair, i, 5); break;
    case 6: rows_tile(a, n, pair, i, 6); break;
    case 7: rows_tile(a, n, pair, i, 7); break;
    default: rows_tile(a, n, pair, i, ROWS_PER_TILE); break;
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
        prefetch_row(a, n + PREFETCH_ROWS);
        prefetch_row(a, n + 1 + PREFETCH_ROWS);
        for (int64_t i = 0; i < a->m; i += ROWS_PER_TILE) {
            int64_t left = a->m - i;
            row_tile(a, n, pair, i, left < ROWS_PER_TILE ? (int)left : ROWS_PER_TILE);
        }
    }
    return 0;
}

#if defined(__AVX2__) && defined(__FMA__)
/*
 * The integer path (AVX2): each 32-value block of an x row is held as int16 with its own
 * scale (s = max|x| / INT16_LEVELS, an error of at most s / 2 per value: 14 significant bits,
 * where llama.cpp's 8-bit activations keep 7), so a block's products are exact integer
 * multiply-adds (vpmaddwd, or vpdpbusd on the split-byte path below) and one float multiply by
 * the two scales. At a few rows this does half the instructions of expanding every weight to
 * float32. Q4's minimum enters through the block's float sum of x:
 * sum(x * (d q + m)) = d sum(x q) + m sum(x).
 *
 * 14 bits, not 15: the split-byte path needs v / 128 to fit a signed byte.
 */
#define INT16_LEVELS 16383.0f
typedef struct {
    int16_t *q;   /* [M, K] */
    float *scale; /* [M, K / 32] */
    float *sum;   /* [M, K / 32], float sums of the unrounded values */
} Int16Rows;

static void quantize_rows(const QMatmulArgs *a, const Int16Rows *x16) {
    int64_t blocks = a->k / BLOCK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
/* A decode step's one or two rows are rounded on this thread: a parallel region costs a
 * fork and join (~5 us each on two cores), more than the rounding, ~120 times a step. */
#pragma omp parallel for schedule(static) if (a->m >= 8)
    for (int64_t i = 0; i < a->m; i++) {
        for (int64_t b = 0; b < blocks; b++) {
            const float *x = a->x + i * a->stride_x + b * BLOCK;
            __m256 v[4], top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
            for (int j = 0; j < 4; j++) {
                v[j] = _mm256_loadu_ps(x + 8 * j);
                top = _mm256_max_ps(top, _mm256_andnot_ps(sign, v[j]));
                total = _mm256_add_ps(total, v[j]);
            }
            __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
            t = _mm_max_ps(t, _mm_movehl_ps(t, t));
            float largest = _mm_cvtss_f32(_mm_max_ss(t, _mm_movehdup_ps(t)));
            int16_t *q = x16->q + i * a->k + b * BLOCK;
            x16->sum[i * blocks + b] = sum_avx2(total);
            x16->scale[i * blocks + b] = largest / INT16_LEVELS;
            __m256 inverse = _mm256_set1_ps(largest > 0.0f ? INT16_LEVELS / largest : 0.0f);
            for (int j = 0; j < 4; j += 2) {
                __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));
                __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(v[j + 1], inverse));
                /* packs works per 128-bit lane: put the four quarters back in order */
                __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xD8);
                _mm256_storeu_si256((__m256i *)(q + 8 * j), packed);
            }
        }
    }
}

/* Block b of row n of W as int16: weights 0-15 and 16-31. */
static inline void widen_block(const QMatmulArgs *a, int64_t n, int64_t b, __m256i *lo, __m256i *hi) {
    if (a->kind == KIND_Q4) {
        __m128i bytes = _mm_loadu_si128((const __m128i *)(a->qs + n * (a->k / 2) + b * 16));
        __m256i wide = _mm256_cvtepu8_epi16(bytes);
        *lo = _mm256_and_si256(wide, _mm256_set1_epi16(15));
        *hi = _mm256_srli_epi16(wide, 4);
    } else {
        const int8_t *q = (const int8_t *)a->qs + n * a->k + b * BLOCK;
        *lo = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)q));
        *hi = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16)));
    }
}

/* The eight int32 lanes of each of v[0..7] summed: lane j of the result is v[j]'s sum. */
static inline __m256i lane_sums8(const __m256i v[8]) {
    __m256i h01 = _mm256_hadd_epi32(v[0], v[1]), h23 = _mm256_hadd_epi32(v[2], v[3]);
    __m256i h45 = _mm256_hadd_epi32(v[4], v[5]), h67 = _mm256_hadd_epi32(v[6], v[7]);
    __m256i h0123 = _mm256_hadd_epi32(h01, h23), h4567 = _mm256_hadd_epi32(h45, h67);
    /* each 128-bit half now holds four partial sums: add the halves */
    return _mm256_add_epi32(_mm256_permute2x128_si256(h0123, h4567, 0x20),
                            _mm256_permute2x128_si256(h0123, h4567, 0x31));
}

/* Block b of W row n times block b of an int16 x row: eight int32 partial sums. */
static inline __m256i block_sums(const QMatmulArgs *a, int64_t n, int64_t b, const int16_t *x) {
    __m256i w_lo, w_hi;
    widen_block(a, n, b, &w_lo, &w_hi);
    __m256i x_lo = _mm256_loadu_si256((const __m256i *)(x + b * BLOCK));
    __m256i x_hi = _mm256_loadu_si256((const __m256i *)(x + b * BLOCK + 16));
    return _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo), _mm256_madd_epi16(w_hi, x_hi));
}

/* out plus block b of W row n against block b of int16 x row i, scales and Q4's minimum
 * applied (added to out one after the other: sampled answers follow the last bit): the blocks
 * past the last group of eight. */
static float add_lone_block(const QMatmulArgs *a, const Int16Rows *x16, int64_t n, int64_t i,
                            int64_t b, float out) {
    int64_t blocks = a->k / BLOCK;
    __m256i v = block_sums(a, n, b, x16->q + i * a->k);
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_hadd_epi32(h, h);
    h = _mm_hadd_epi32(h, h);
    out += half_to_float(a->scales[n * blocks + b]) * x16->scale[i * blocks + b]
           * (float)_mm_cvtsi128_si32(h);
    if (a->kind == KIND_Q4) out += half_to_float(a->mins[n * blocks + b]) * x16->sum[i * blocks + b];
    return out;
}

/* Row n of W against int16 row i of x. Blocks go eight at a time: their exact integer sums
 * gathered in one vector meet eight scales at once (converted from float16 together), so a
 * block costs its multiply-adds and an eighth of the float work. */
static float int16_row_dot(const QMatmulArgs *a, const Int16Rows *x16, int64_t n, int64_t i) {
    int64_t blocks = a->k / BLOCK;
    const int16_t *x = x16->q + i * a->k;
    const float *x_scale = x16->scale + i * blocks, *x_sum = x16->sum + i * blocks;
    const uint16_t *d = a->scales + n * blocks;
    const uint16_t *mins = a->kind == KIND_Q4 ? a->mins + n * blocks : NULL;
    __m256 acc = _mm256_setzero_ps(), acc_min = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
        __m256i sums[8];
        for (int j = 0; j < 8; j++) sums[j] = block_sums(a, n, b + j, x);
        __m256 w_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        __m256 scale = _mm256_mul_ps(w_scale, _mm256_loadu_ps(x_scale + b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_sums8(sums)), scale, acc);
        if (mins != NULL) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + b)));
            acc_min = _mm256_fmadd_ps(m, _mm256_loadu_ps(x_sum + b), acc_min);
        }
    }
    float out = sum_avx2(acc) + sum_avx2(acc_min);
    for (; b < blocks; b++) out = add_lone_block(a, x16, n, i, b, out);
    return out;
}

/* Row n of W against `rows` (1 to 4) int16 rows of x from row i, into y. Each W block is
 * widened once for the tile; a block's eight int32 sums per x row become floats at once and
 * meet their one scale (W's, from eight converted together, times x's) in an FMA, and Q4's
 * minimums join the same accumulator eight blocks at a time. Inlined with `rows` a constant. */
static inline __attribute__((always_inline)) void int16_tile_dot(
    const QMatmulArgs *a, const Int16Rows *x16, int64_t n, int64_t i, const int rows) {
    int64_t blocks = a->k / BLOCK;
    const uint16_t *d = a->scales + n * blocks;
    const uint16_t *mins = a->kind == KIND_Q4 ? a->mins + n * blocks : NULL;
    __m256 acc[4];
    for (int r = 0; r < rows; r++) acc[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 8 <= blocks; b += 8) {
        __m256 w_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(d + b)));
        for (int j = 0; j < 8; j++) {
            __m256i w_lo, w_hi;
            widen_block(a, n, b + j, &w_lo, &w_hi);
            __m256 d_j = _mm256_permutevar8x32_ps(w_scale, _mm256_set1_epi32(j));
            for (int r = 0; r < rows; r++) {
                const int16_t *x = x16->q + (i + r) * a->k + (b + j) * BLOCK;
                __m256i x_lo = _mm256_loadu_si256((const __m256i *)x);
                __m256i x_hi = _mm256_loadu_si256((const __m256i *)(x + 16));
                __m256i sums = _mm256_add_epi32(_mm256_madd_epi16(w_lo, x_lo),
                                                _mm256_madd_epi16(w_hi, x_hi));
                __m256 scale = _mm256_mul_ps(d_j, _mm256_set1_ps(x16->scale[(i + r) * blocks + b + j]));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), scale, acc[r]);
            }
        }
        if (mins != NULL) {
            __m256 m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(mins + b)));
            for (int r = 0; r < rows; r++)
                acc[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(x16->sum + (i + r) * blocks + b), acc[r]);
        }
    }
    for (int r = 0; r < rows; r++) {
        float out = sum_avx2(acc[r]);
        for (int64_t t = b; t < blocks; t++) out = add_lone_block(a, x16, n, i + r, t, out);
        a->y[(i + r) * a->stride_y + n] = out;
    }
}

/* Row n of W against every row of x: one or two rows one at a time (their sums meet the
 * scales eight blocks at once), more in tiles of four that share each widened block. */
static void int16_rows_dot(const QMatmulArgs *a, const Int16Rows *x16, int64_t n) {
    prefetch_row(a, n + PREFETCH_ROWS);
    if (a->m <= 2) {
        for (int64_t i = 0; i < a->m; i++) a->y[i * a->stride_y + n] = int16_row_dot(a, x16, n, i);
        return;
    }
    int64_t i = 0;
    for (; i + 4 <= a->m; i += 4) int16_tile_dot(a, x16, n, i, 4);
    switch (a->m - i) {
    case 3: int16_tile_dot(a, x16, n, i, 3); break;
    case 2: int16_tile_dot(a, x16, n, i, 2); break;
    case 1: int16_tile_dot(a, x16, n, i, 1); break;
    default: break;
    }
}


#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__F16C__)
/*
 * The split-byte path (AVX-512 VNNI, up to SPLIT_MAX_ROWS x rows): each int16 value v of x,
 * at most INT16_LEVELS in magnitude, is split as v = 128 hi + lo (hi signed, lo 0-127, both
 * bytes), so vpdpbusd multiplies W's bytes with x's 64 at a time: 4-bit weights as they are
 * (0-15) and 8-bit ones with their sign bit flipped (w + 128, unsigned), whose extra 128 sum(v)
 * per four values is taken off again from `fix`. The integer sums are exact, as on the
 * vpmaddwd path, in a third of its instructions: no weight is widened to 16 bits. A register's
 * lanes meet their blocks' scales (W's times x's) in one FMA.
 *
 * 4-bit W goes four blocks at a time: their 64 bytes of qs hold weights 0-15 of each block in
 * the low nibbles and 16-31 in the high ones, so one AND and one shift-and-AND make two
 * registers whose 32-bit lane l belongs to block b + l / 4 in both, and one integer sum per
 * lane takes both halves: half the instructions of two blocks a register, which had left
 * SmolLM2's layer matmuls short of the memory's speed (one thread 5.8 against 4.8 ms a step,
 * two 3.1 against 2.9, in a C loop over its 30 layers' weights).
 * x's bytes are laid out to match: for each group of four blocks (fewer in a last group), the
 * first halves x_b[0:16], x_b+1[0:16], ..., then the second halves x_b[16:32], .... 8-bit W
 * goes two blocks to a register, x in natural order.
 */
/* Decode steps' layers take it for one or two rows (from three, the float tiles are the faster
 * for Q4 layers), an LM head for up to six (kernels/quant/cpu_matmul.py): Q8_0 49152 x 576 on
 * two cores, split against float tiles, 1.5 / 2.5 ms at 3 rows, 2.65 / 3.45 at 5, 3.2 / 3.5 at
 * 6, 3.8 / 3.85 at 8. */
#define SPLIT_MAX_ROWS 6
typedef struct {
    int8_t *hi, *lo; /* [M, K] each, in W's byte order */
    int32_t *fix;    /* [M, K / 4]: 128 times each four values' sum (8-bit W only) */
} SplitRows;

/* Where the 16 values at byte position p of a row come from (4-bit W: the group order
 * above; p a multiple of 16). */
static inline int64_t split_source(const QMatmulArgs *a, int64_t p) {
    if (a->kind != KIND_Q4) return p;
    int64_t first = (p / (4 * BLOCK)) * 4, left = a->k / BLOCK - first;
    int64_t count = left < 4 ? left : 4, r = p - first * BLOCK; /* the group's blocks */
    int64_t half = r / (16 * count), block = (r % (16 * count)) / 16;
    return (first + block) * BLOCK + half * 16;
}

/* Sixteen values at a time: one byte-at-a-time pass with its index arithmetic cost a decode
 * step 1.6 us per matmul, 0.19 ms of SmolLM2's 121. */
static void split_rows(const QMatmulArgs *a, const Int16Rows *x16, const SplitRows *xs) {
    const __m256i low_bits = _mm256_set1_epi16(127);
    for (int64_t i = 0; i < a->m; i++) {
        const int16_t *q = x16->q + i * a->k;
        int8_t *hi = xs->hi + i * a->k, *lo = xs->lo + i * a->k;
        for (int64_t p = 0; p < a->k; p += 16) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(q + split_source(a, p)));
            _mm_storeu_si128((__m128i *)(hi + p), _mm256_cvtepi16_epi8(_mm256_srai_epi16(v, 7)));
            _mm_storeu_si128((__m128i *)(lo + p),
                             _mm256_cvtepi16_epi8(_mm256_and_si256(v, low_bits)));
        }
        if (a->kind == KIND_Q8)
            for (int64_t j = 0; j < a->k / 4; j++)
                xs->fix[i * (a->k / 4) + j] = 128 * (q[4 * j] + q[4 * j + 1] + q[4 * j + 2] + q[4 * j + 3]);
    }
}

/* 8-bit blocks b, b + 1 of W row n as 64 unsigned bytes (sign bits flipped). */
static inline __m512i split_pair(const QMatmulArgs *a, int64_t n, int64_t b) {
    __m512i q = _mm512_loadu_si512((const void *)(a->qs + n * a->k + b * BLOCK));
    return _mm512_xor_si512(q, _mm512_set1_epi8((char)0x80));
}

/* 8-bit block b of W row n alone (the last of an odd count) as 32 unsigned bytes. */
static inline __m256i split_block(const QMatmulArgs *a, int64_t n, int64_t b) {
    __m256i q = _mm256_loadu_si256((const __m256i *)(a->qs + n * a->k + b * BLOCK));
    return _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80));
}

/* The exact integer sums of W's bytes w against x's from byte position p of row i. */
static inline __m512i split_sums(const SplitRows *xs, const QMatmulArgs *a, __m512i w, int64_t i,
                                 int64_t p) {
    __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                    _mm512_loadu_si512((const void *)(xs->hi + i * a->k + p)));
    __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w,
                                    _mm512_loadu_si512((const void *)(xs->lo + i * a->k + p)));
    __m512i s = _mm512_add_epi32(_mm512_slli_epi32(h, 7), l);
    return _mm512_sub_epi32(s, _mm512_loadu_si512((const void *)(xs->fix + i * (a->k / 4) + p / 4)));
}

static inline __m256i split_block_sums(const SplitRows *xs, const QMatmulArgs *a, __m256i w,
                                       int64_t i, int64_t p) {
    __m256i h = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w,
                                    _mm256_loadu_si256((const __m256i *)(xs->hi + i * a->k + p)));
    __m256i l = _mm256_dpbusd_epi32(_mm256_setzero_si256(), w,
                                    _mm256_loadu_si256((const __m256i *)(xs->lo + i * a->k + p)));
    __m256i s = _mm256_add_epi32(_mm256_slli_epi32(h, 7), l);
    return _mm256_sub_epi32(s, _mm256_loadu_si256((const __m256i *)(xs->fix + i * (a->k / 4) + p / 4)));
}

/* Blocks b .. b + count - 1 (count 1-4; `bytes` masks their 16 bytes each) of 4-bit row q
 * against `rows` x rows, into acc: the lanes' exact sums times their blocks' scales (`pick`
 * chooses from the sixteen in `scale`). */
static inline __attribute__((always_inline)) void quad_step(
    const QMatmulArgs *a, const SplitRows *xs, const uint8_t *q, int64_t b, int64_t count,
    __mmask64 bytes, __m512i pick, const __m512 *scale, __m512 *acc, const int rows) {
    const __m512i nibble = _mm512_set1_epi8(15);
    const __m512i raw = _mm512_maskz_loadu_epi8(bytes, q + b * 16);
    const __m512i low = _mm512_and_si512(raw, nibble);
    const __m512i high = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
    for (int r = 0; r < rows; r++) {
        const int8_t *hi = xs->hi + r * a->k + b * BLOCK, *lo = xs->lo + r * a->k + b * BLOCK;
        __m512i h = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_maskz_loadu_epi8(bytes, hi));
        __m512i l = _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, _mm512_maskz_loadu_epi8(bytes, lo));
        h = _mm512_dpbusd_epi32(h, high, _mm512_maskz_loadu_epi8(bytes, hi + 16 * count));
        l = _mm512_dpbusd_epi32(l, high, _mm512_maskz_loadu_epi8(bytes, lo + 16 * count));
        const __m512 sums = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(h, 7), l));
        acc[r] = _mm512_fmadd_ps(sums, _mm512_permutexvar_ps(pick, scale[r]), acc[r]);
    }
}

/* 4-bit row n of W against `rows` (1 to SPLIT_MAX_ROWS) x rows from row 0, into y, four
 * blocks a step (the group order above). Sixteen blocks' scales (W's float16 ones times x's)
 * are made at once; each group's lanes pick theirs with a permute. A last group of fewer blocks
 * is read through masks. Inlined with `rows` a constant. */
static inline __attribute__((always_inline)) void quad_rows_dot(
    const QMatmulArgs *a, const Int16Rows *x16, const SplitRows *xs, int64_t n, const int rows) {
    const int64_t blocks = a->k / BLOCK;
    const uint16_t *d = a->scales + n * blocks, *mins = a->mins + n * blocks;
    const uint8_t *q = a->qs + n * (a->k / 2);
    const __m512i lane_block = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    __m512 acc[SPLIT_MAX_ROWS], acc_min[SPLIT_MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = acc_min[r] = _mm512_setzero_ps();
    for (int64_t b0 = 0; b0 < blocks; b0 += 16) {
        const int64_t end = blocks - b0 < 16 ? blocks : b0 + 16;
        const __mmask16 mask = (__mmask16)((1u << (end - b0)) - 1);
        const __m512 w_scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + b0));
        const __m512 m = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, mins + b0));
        __m512 scale[SPLIT_MAX_ROWS];
        for (int r = 0; r < rows; r++) {
            scale[r] = _mm512_mul_ps(w_scale, _mm512_maskz_loadu_ps(mask, x16->scale + r * blocks + b0));
            acc_min[r] = _mm512_fmadd_ps(m, _mm512_maskz_loadu_ps(mask, x16->sum + r * blocks + b0),
                                         acc_min[r]);
        }
        __m512i pick = lane_block;
        int64_t b = b0;
        for (; b + 4 <= end; b += 4) {
            quad_step(a, xs, q, b, 4, ~0ULL, pick, scale, acc, rows);
            pick = _mm512_add_epi32(pick, _mm512_set1_epi32(4));
        }
        if (b < end)
            quad_step(a, xs, q, b, end - b, (1ULL << (16 * (end - b))) - 1, pick, scale, acc, rows);
    }
    for (int r = 0; r < rows; r++)
        a->y[r * a->stride_y + n] = _mm512_reduce_add_ps(acc[r]) + _mm512_reduce_add_ps(acc_min[r]);
}

/* 8-bit row n of W against `rows` (1 to SPLIT_MAX_ROWS) x rows from row 0, into y: W's
 * bytes are read once for all. Sixteen blocks' scales (W's float16 ones times x's) are made at
 * once and each pair's lanes pick theirs with a permute. Inlined with `rows` a constant. */
static inline __attribute__((always_inline)) void split_rows_dot(
    const QMatmulArgs *a, const Int16Rows *x16, const SplitRows *xs, int64_t n, const int rows) {
    int64_t blocks = a->k / BLOCK;
    const uint16_t *d = a->scales + n * blocks;
    /* lane l of a pair belongs to block 2p + pick[l] */
    const __m512i pick = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[SPLIT_MAX_ROWS];
    for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    int64_t pairs = blocks / 2;
    for (int64_t b0 = 0; b0 < 2 * pairs; b0 += 16) {
        int64_t count = 2 * pairs - b0 < 16 ? 2 * pairs - b0 : 16;
        __mmask16 mask = (__mmask16)((1u << count) - 1);
        __m512 w_scale = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, d + b0));
        __m512 scale[SPLIT_MAX_ROWS];
        for (int r = 0; r < rows; r++)
            scale[r] = _mm512_mul_ps(w_scale, _mm512_maskz_loadu_ps(mask, x16->scale + r * blocks + b0));
        __m512i lanes = pick;
        for (int64_t b = b0; b < b0 + count; b += 2) {
            __m512i w = split_pair(a, n, b);
            for (int r = 0; r < rows; r++) {
                __m512 s = _mm512_cvtepi32_ps(split_sums(xs, a, w, r, b * BLOCK));
                acc[r] = _mm512_fmadd_ps(s, _mm512_permutexvar_ps(lanes, scale[r]), acc[r]);
            }
            lanes = _mm512_add_epi32(lanes, _mm512_set1_epi32(2));
        }
    }
    for (int r = 0; r < rows; r++) {
        float out = _mm512_reduce_add_ps(acc[r]);
        if (blocks % 2) { /* the lone last block */
            int64_t b = blocks - 1;
            __m256 s = _mm256_cvtepi32_ps(split_block_sums(xs, a, split_block(a, n, b), r, b * BLOCK));
            __m128 h = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
            h = _mm_add_ps(h, _mm_movehl_ps(h, h));
            float total = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
            out += half_to_float(d[b]) * x16->scale[r * blocks + b] * total;
        }
        a->y[r * a->stride_y + n] = out;
    }
}

static inline __attribute__((always_inline)) void split_row_dot(
    const QMatmulArgs *a, const Int16Rows *x16, const SplitRows *xs, int64_t n, const int rows) {
    if (a->kind == KIND_Q4)
        quad_rows_dot(a, x16, xs, n, rows);
    else
        split_rows_dot(a, x16, xs, n, rows);
}

/* Every row of W against ROWS x rows, ROWS a literal: the parallel loop's body becomes a
 * function of its own, where a count passed in as a constant is a variable again and the
 * accumulators go to memory (the LM head's one row: 1.3-1.6 against 0.8-1.0 ms). */
#define SPLIT_ALL_ROWS(ROWS)                                                                  \
    do {                                                                                      \
        _Pragma("omp parallel for schedule(static)")                                         \
        for (int64_t n = 0; n < a->n; n++) {                                                  \
            prefetch_row(a, n + PREFETCH_ROWS);                                               \
            split_row_dot(a, x16, &xs, n, ROWS);                                              \
        }                                                                                     \
    } while (0)

static int split_matmul(const QMatmulArgs *a, const Int16Rows *x16) {
    SplitRows xs;
    xs.hi = malloc((size_t)(a->m * a->k) * 2);
    xs.fix = a->kind == KIND_Q8 ? malloc((size_t)(a->m * (a->k / 4)) * sizeof(int32_t)) : NULL;
    if (xs.hi == NULL || (a->kind == KIND_Q8 && xs.fix == NULL)) {
        free(xs.hi);
        free(xs.fix);
        return 3;
    }
    xs.lo = xs.hi + a->m * a->k;
    split_rows(a, x16, &xs);
    switch (a->m) {
    case 1: SPLIT_ALL_ROWS(1); break;
    case 2: SPLIT_ALL_ROWS(2); break;
    case 3: SPLIT_ALL_ROWS(3); break;
    case 4: SPLIT_ALL_ROWS(4); break;
    case 5: SPLIT_ALL_ROWS(5); break;
    default: SPLIT_ALL_ROWS(SPLIT_MAX_ROWS); break;
    }
    free(xs.hi);
    free(xs.fix);
    return 0;
}
#define HAVE_SPLIT_PATH 1
#endif

int gguf_matmul_int16(const QMatmulArgs *a) {
    if (a->k % BLOCK != 0) return 1;
    if (a->kind != KIND_Q4 && a->kind != KIND_Q8) return 2;
    int64_t blocks = a->k / BLOCK;
    Int16Rows x16;
    x16.q = malloc((size_t)(a->m * a->k) * sizeof(int16_t));
    x16.scale = malloc((size_t)(a->m * blocks) * 2 * sizeof(float));
    if (x16.q == NULL || x16.scale == NULL) {
        free(x16.q);
        free(x16.scale);
        return 3;
    }
    x16.sum = x16.scale + a->m * blocks;
    quantize_rows(a, &x16);
    int code = 0;
#if defined(HAVE_SPLIT_PATH)
    if (a->m <= SPLIT_MAX_ROWS) {
        code = split_matmul(a, &x16);
    } else
#endif
    {
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < a->n; n++) int16_rows_dot(a, &x16, n);
    }
    free(x16.q);
    free(x16.scale);
    return code;
}

/* The rows up to which the integer path takes the split-byte form (0: no AVX-512 VNNI). */
int gguf_split_max_rows(void) {
#if defined(HAVE_SPLIT_PATH)
    return SPLIT_MAX_ROWS;
#else
    return 0;
#endif
}

/* The rows up to which the integer path serves, from SmolLM2's weights on two cores:
 * AVX-512's float tiles (16 lanes, two FMAs per block and x row) beat it from 3 rows on (7.4
 * vs 10.3 ms at 3, 42 vs 67 at 32). Against AVX2's float tiles it won at every row count
 * (8.5 vs 10.9 ms at 3, 18.8 vs 14.1 at 5, 85 vs 101 at 32), but it is kept to decode
 * batches and speculative verifications of up to 8 rows: a prefill chunk on it moved the
 * real model's greedy answers, which the float path keeps. */
int gguf_int16_max_rows(void) {
#if defined(__AVX512F__)
    return 2;
#else
    return 8;
#endif
}
#else
int gguf_matmul_int16(const QMatmulArgs *a) {
    (void)a;
    return 4; /* no AVX2 here: the caller keeps the float path */
}

int gguf_int16_max_rows(void) { return 0; } /* no integer path */

int gguf_split_max_rows(void) { return 0; }
#endif

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
