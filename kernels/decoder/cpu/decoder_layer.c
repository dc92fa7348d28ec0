/*
 * One decode step of a Llama-style decoder layer on CPUs, in two calls: the attention block
 * (residual add, RMSNorm, QKV projection, rotary embedding, the cache write, paged attention,
 * the output projection) and the MLP block (residual add, RMSNorm, gate-up projection,
 * SiLU(gate) * up, the down projection).
 *
 * Why C: a decode step of a small model is some seventy torch ops per layer on rows of a few
 * hundred floats, each costing more to dispatch than to compute (SmolLM2: ~24 ms of a 45 ms
 * step on two cores). Here the glue runs in plain loops and the heavy parts call the GGUF
 * matmul (kernels/quant/cpu/gguf_matmul.c) and the paged decode attention
 * (kernels/attention/cpu/paged_decode.c) through function pointers the caller hands over, so
 * each kernel stays in its own library. A tensor-parallel caller all-reduces `delta` between
 * the two calls; the sums stay in the same order as the torch layers' (residual + delta).
 *
 * The glue between the projections is exported on its own too (residual_norm, attend,
 * gated_silu) for a caller that runs the projections itself: float32 weights go through
 * oneDNN, which no C loop here would match. That caller points `qkv`, `delta` and `gate_up`
 * at its projections' outputs and sets `has_delta` before the next call.
 *
 * Activations are float32 throughout. The KV cache view has unit channel stride and holds
 * float32, float16 or bfloat16 (kernels/decoder/cpu_decoder.py checks both before it takes a
 * step); keys and values are rounded into it to nearest even, as torch's casts round, so a
 * step here writes the cells the torch modules would.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { CACHE_F32 = 0, CACHE_BF16 = 1, CACHE_F16 = 2 }; /* cpu_attention.DTYPE_CODES */
#define MAX_HEAD 512 /* paged_decode.c's bound, checked by the caller */

typedef struct { /* kernels/quant/cpu/gguf_matmul.c */
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

typedef struct { /* kernels/attention/cpu/paged_decode.c */
    const float *query;
    float *out;
    const char *cache;
    int64_t stride_cb, stride_ch, stride_cn, stride_cc;
    int dtype;
    const int32_t *block_table;
    int64_t stride_bt;
    const int32_t *seq_lens;
    const int32_t *token_of;
    const float *sinks;
    int num_q_heads, num_kv_heads, head_size, head_size_v;
    int block_size, kernel_block_size;
    int sliding_window;
    float scale, softcap;
} DecodeArgs;

typedef int (*MatmulFn)(const QMatmulArgs *);
typedef int (*AttentionFn)(DecodeArgs *, int64_t, int);

typedef struct {
    const uint8_t *qs;
    const uint16_t *scales;
    const uint16_t *mins;
    int64_t n, k;
    int kind;
    const float *bias; /* [n] or NULL */
} QWeight;

typedef struct { /* fixed for the model */
    int64_t hidden, num_heads, num_kv_heads, head_size, intermediate;
    float eps;
    MatmulFn matmul, matmul_int16;
    int64_t int16_max_rows; /* rows up to which matmul_int16 is the faster */
    AttentionFn attention;
} DecoderModel;

typedef struct { /* fixed for a layer while its cache is bound */
    const float *input_norm, *post_norm;
    QWeight qkv, o, gate_up, down;
    char *cache; /* the layer's [B, H, N, C] view; strides in elements */
    int64_t stride_cb, stride_ch, stride_cn;
    int kernel_block_size;
    int cache_dtype; /* CACHE_* */
} DecoderLayer;

typedef struct { /* one step */
    int64_t rows;
    float *residual;        /* [T, hidden]: the stream, the embeddings at first */
    float *delta;           /* [T, hidden]: a block's output, added to the stream next */
    int has_delta;          /* 0 before the first block */
    float *normed;          /* [T, hidden] */
    float *qkv;             /* [T, (Hq + 2 Hk) D] */
    float *query;           /* [T, Hq D] rotated */
    float *attended;        /* [T, Hq D] */
    float *gate_up;         /* [T, 2 I] */
    float *activated;       /* [T, I] */
    const float *cos, *sin; /* [T, D] */
    const int64_t *slots;   /* [T] */
    DecodeArgs attention;   /* the step's metadata; query, out and cache are set per layer */
    int64_t num_items;      /* the attention's (request, KV head) items */
    int num_threads;
} DecoderStep;

static int project(const DecoderModel *m, const QWeight *w, const float *x, float *y,
                   int64_t rows) {
    QMatmulArgs args = {x, w->k, y, w->n, w->qs, w->scales, w->mins, rows, w->n, w->k, w->kind};
    int use_int16 = m->matmul_int16 != NULL && rows <= m->int16_max_rows;
    int code = (use_int16 ? m->matmul_int16 : m->matmul)(&args);
    if (code != 0) return code;
    if (w->bias != NULL) {
        for (int64_t r = 0; r < rows; r++)
            for (int64_t j = 0; j < w->n; j++) y[r * w->n + j] += w->bias[j];
    }
    return 0;
}

/* residual += delta (when there is one); normed = RMSNorm(residual) * weight. */
static void add_and_norm(const DecoderModel *m, DecoderStep *s, const float *weight) {
    int64_t h = m->hidden;
    for (int64_t r = 0; r < s->rows; r++) {
        float *x = s->residual + r * h;
        if (s->has_delta) {
            const float *d = s->delta + r * h;
            for (int64_t j = 0; j < h; j++) x[j] += d[j];
        }
        float lanes[8] = {0};
        int64_t j = 0;
        for (; j + 8 <= h; j += 8)
            for (int l = 0; l < 8; l++) lanes[l] += x[j + l] * x[j + l];
        float squares = 0.0f;
        for (int l = 0; l < 8; l++) squares += lanes[l];
        for (; j < h; j++) squares += x[j] * x[j];
        float inverse = 1.0f / sqrtf(squares / (float)h + m->eps);
        float *out = s->normed + r * h;
        for (j = 0; j < h; j++) out[j] = x[j] * inverse * weight[j];
    }
    s->has_delta = 0;
}

/* The half-split rotation of one head: (a, b) -> (a cos - b sin, b cos + a sin). */
static inline void rotate(const float *x, float *out, const float *cos, const float *sin,
                          int64_t d) {
    int64_t half = d / 2;
    for (int64_t j = 0; j < half; j++) {
        float a = x[j], b = x[j + half];
        out[j] = a * cos[j] - b * sin[j];
        out[j + half] = b * cos[j + half] + a * sin[j + half];
    }
}

/* `count` floats into the cache from element `index` on, in the cache's dtype. */
static void store_cell(char *cache, int64_t index, const float *values, int64_t count,
                       int dtype) {
    if (dtype == CACHE_F32) {
        memcpy((float *)cache + index, values, (size_t)count * sizeof(float));
        return;
    }
    uint16_t *out = (uint16_t *)cache + index;
    if (dtype == CACHE_BF16) {
        for (int64_t j = 0; j < count; j++) {
            uint32_t bits;
            memcpy(&bits, values + j, sizeof bits);
            if ((bits & 0x7fffffffu) > 0x7f800000u) { /* NaN: torch's quiet NaN */
                out[j] = 0x7fc0;
            } else { /* round to nearest, ties to the even half */
                out[j] = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
            }
        }
        return;
    }
    int64_t j = 0;
#if defined(__F16C__)
    for (; j + 8 <= count; j += 8) {
        __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(values + j), _MM_FROUND_TO_NEAREST_INT);
        _mm_storeu_si128((__m128i *)(out + j), half);
    }
#endif
    for (; j < count; j++) { /* without F16C the cast calls a libgcc helper */
        _Float16 half = (_Float16)values[j];
        memcpy(out + j, &half, sizeof half);
    }
}

/* Rotated queries to s->query; rotated keys and the values into their cache slots. */
static void rotate_and_store(const DecoderModel *m, const DecoderLayer *l, DecoderStep *s) {
    int64_t d = m->head_size, q_width = m->num_heads * d, kv_width = m->num_kv_heads * d;
    int64_t width = q_width + 2 * kv_width;
    float key[MAX_HEAD];
    for (int64_t r = 0; r < s->rows; r++) {
        const float *row = s->qkv + r * width, *cos = s->cos + r * d, *sin = s->sin + r * d;
        for (int64_t head = 0; head < m->num_heads; head++)
            rotate(row + head * d, s->query + r * q_width + head * d, cos, sin, d);
        int64_t slot = s->slots[r];
        int64_t cells = (slot / l->kernel_block_size) * l->stride_cb
                        + (slot % l->kernel_block_size) * l->stride_cn;
        for (int64_t head = 0; head < m->num_kv_heads; head++) {
            int64_t cell = cells + head * l->stride_ch;
            rotate(row + q_width + head * d, key, cos, sin, d);
            store_cell(l->cache, cell, key, d, l->cache_dtype);
            store_cell(l->cache, cell + d, row + q_width + kv_width + head * d, d,
                       l->cache_dtype);
        }
    }
}

/* Rotary embedding and the cache write from s->qkv, then paged attention to s->attended. */
int attend(const DecoderModel *m, const DecoderLayer *l, DecoderStep *s) {
    rotate_and_store(m, l, s);
    DecodeArgs args = s->attention;
    args.query = s->query;
    args.out = s->attended;
    args.cache = l->cache;
    args.dtype = l->cache_dtype;
    args.stride_cb = l->stride_cb;
    args.stride_ch = l->stride_ch;
    args.stride_cn = l->stride_cn;
    args.stride_cc = 1;
    args.kernel_block_size = l->kernel_block_size;
    return m->attention(&args, s->num_items, s->num_threads) != 0 ? 10 : 0;
}

int attention_block(const DecoderModel *m, const DecoderLayer *l, DecoderStep *s) {
    add_and_norm(m, s, l->input_norm);
    int code = project(m, &l->qkv, s->normed, s->qkv, s->rows);
    if (code != 0) return code;
    code = attend(m, l, s);
    if (code != 0) return code;
    code = project(m, &l->o, s->attended, s->delta, s->rows);
    s->has_delta = 1;
    return code;
}

/* s->activated = SiLU(gate) * up from s->gate_up, rows split over the threads: at a batch of
 * decode rows the exponentials outweigh a parallel region's start. */
#if defined(__AVX512F__)
/* exp(x) for any float x: x = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' degree-6
 * polynomial (within 2 ulp of expf), times 2^n. Clamped to [-103, 88.7]: below, expf is 0
 * or a denormal and this about 1e-45; above, SiLU's 1 + exp(-x) only needs to be huge.
 * paged_decode.c's exp_ps is the same polynomial clamped below only; each C file is a library
 * of its own, built and cached by kernels/c_build.py from that one source, so the lines are
 * repeated rather than shared through a header the cache key would not see. */
static inline __m512 exp_any(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-103.0f)), _mm512_set1_ps(88.7f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    const __m512 y = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, n);
}
#endif

/* out[j] = gate[j] / (1 + exp(-gate[j])) * up[j]. One expf per element was most of a decode
 * step's SiLU (0.2 ms of embedded:20m's 32 rows x 1408 on two cores); sixteen lanes of the
 * polynomial above take a tenth of that. */
static void silu_times(const float *gate, const float *up, float *out, int64_t n) {
    int64_t j = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.0f);
    for (; j + 16 <= n; j += 16) {
        const __m512 g = _mm512_loadu_ps(gate + j);
        const __m512 e = exp_any(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = _mm512_div_ps(g, _mm512_add_ps(one, e));
        _mm512_storeu_ps(out + j, _mm512_mul_ps(silu, _mm512_loadu_ps(up + j)));
    }
#endif
    for (; j < n; j++) out[j] = gate[j] / (1.0f + expf(-gate[j])) * up[j];
}

/* SiLU(gate) * up for `rows` rows of [gate | up] (2 x inter floats each) into rows of inter:
 * a step's glue here, and the modules' longer steps (kernels/decoder/cpu_decoder.py), where
 * torch's silu of the strided gate and the product took three passes over the rows. */
int gated_silu_rows(const float *gate_up, float *out, int64_t rows, int64_t inter) {
#pragma omp parallel for schedule(static) if (rows * inter >= 32768)
    for (int64_t r = 0; r < rows; r++) {
        const float *gate = gate_up + r * 2 * inter;
        silu_times(gate, gate + inter, out + r * inter, inter);
    }
    return 0;
}

int gated_silu(const DecoderModel *m, DecoderStep *s) {
    return gated_silu_rows(s->gate_up, s->activated, s->rows, m->intermediate);
}

int mlp_block(const DecoderModel *m, const DecoderLayer *l, DecoderStep *s) {
    add_and_norm(m, s, l->post_norm);
    int code = project(m, &l->gate_up, s->normed, s->gate_up, s->rows);
    if (code != 0) return code;
    gated_silu(m, s);
    code = project(m, &l->down, s->activated, s->delta, s->rows);
    s->has_delta = 1;
    return code;
}

/* Every layer's two blocks in turn, for a rank with nothing to all-reduce between them (TP 1):
 * one call where two per layer through ctypes cost SmolLM2's step about half a millisecond.
 * Returns the first failing block's code, or 0. */
int decoder_layers(const DecoderModel *m, const DecoderLayer *layers, int64_t num_layers,
                   DecoderStep *s) {
    for (int64_t i = 0; i < num_layers; i++) {
        int code = attention_block(m, &layers[i], s);
        if (code == 0) code = mlp_block(m, &layers[i], s);
        if (code != 0) return code;
    }
    return 0;
}

/* residual += delta (when there is one); normed = RMSNorm(residual) * weight: before a block's
 * projections, and the model's last norm. */
int residual_norm(const DecoderModel *m, const float *weight, DecoderStep *s) {
    add_and_norm(m, s, weight);
    return 0;
}
