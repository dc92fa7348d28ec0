/* Paged decode attention on the CPU: one query token per request, read in place from the KV
 * cache view through its strides (any of the six layouts, kernel-block splits included).
 *
 * The work is num_items (request, KV head) items, item i being request i / num_kv_heads and
 * KV head i % num_kv_heads. Each item walks the request's key
 * positions once: it finds a position's cell through the block table (slot = block *
 * block_size + offset; kernel block = slot / kernel_block_size, row = slot % ...), scores the
 * key against every query head that shares this KV head, and keeps an online (flash) softmax
 * with its value accumulator per query head, in fp32. K and V are read exactly once, with no
 * copy. A long item's keys go into parts (parts_of) whose softmax states are merged after;
 * the work goes to OpenMP threads in runs of about equal keys.
 *
 * Built by kernels/cpu_attention.py with the system C compiler; its torch reference is
 * kernels/reference.py::paged_attention_reference.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

enum { DTYPE_F32 = 0, DTYPE_BF16 = 1, DTYPE_F16 = 2 };
#define MAX_HEAD 512     /* head_size and head_size_v bound: the accumulators live on the stack */
#define MAX_GROUP 64     /* query heads per KV head */
#define MAX_THREADS 256
#define CHUNK 32         /* keys scored before each softmax rescale (at most) */

typedef struct {
    const float *query;            /* [T, Hq, D] contiguous fp32 */
    float *out;                    /* [T, Hq, Dv] contiguous fp32 */
    const char *cache;             /* [B, H, N, C] view, element strides below */
    int64_t stride_cb, stride_ch, stride_cn, stride_cc;
    int dtype;
    const int32_t *block_table;    /* [R, stride_bt] */
    int64_t stride_bt;
    const int32_t *seq_lens;       /* [R] tokens after this step */
    const int32_t *token_of;       /* [R] the request's query row in query/out */
    const float *sinks;            /* [Hq] or NULL */
    int num_q_heads, num_kv_heads, head_size, head_size_v;
    int block_size, kernel_block_size;
    int sliding_window;            /* 0: none */
    float scale, softcap;          /* softcap 0: none */
} DecodeArgs;

static inline float load_element(const char *base, int64_t index, int dtype) {
    if (dtype == DTYPE_F32) {
        return ((const float *)base)[index];
    }
    if (dtype == DTYPE_BF16) {
        uint32_t bits = (uint32_t)((const uint16_t *)base)[index] << 16;
        float value;
        memcpy(&value, &bits, sizeof value);
        return value;
    }
    return (float)((const _Float16 *)base)[index];
}

/* A K or V row as fp32: the cache itself when it is contiguous fp32, else a converted copy. */
static inline const float *row_as_f32(float *scratch, const char *base, int64_t first,
                                      int64_t stride, int length, int dtype) {
    if (dtype == DTYPE_F32 && stride == 1) {
        return (const float *)base + first;
    }
    int d = 0;
#if defined(__F16C__)
    /* vcvtph2ps, eight at a time: the cast below would call a libgcc helper per element. */
    if (dtype == DTYPE_F16 && stride == 1) {
        const uint16_t *halves = (const uint16_t *)base + first;
        for (; d + 8 <= length; d += 8) {
            __m128i half = _mm_loadu_si128((const __m128i *)(halves + d));
            _mm256_storeu_ps(scratch + d, _mm256_cvtph_ps(half));
        }
    }
#endif
    for (; d < length; d++) {
        scratch[d] = load_element(base, first + d * stride, dtype);
    }
    return scratch;
}

/* Eight floats in one register (GCC/Clang vector extension: SSE/AVX on x86, NEON on ARM). */
typedef float vfloat __attribute__((vector_size(32)));
#define LANES 8

static inline vfloat vload(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline float dot(const float *a, const float *b, int n) {
    vfloat acc = {0};
    int d = 0;
    for (; d + LANES <= n; d += LANES) {
        acc += vload(a + d) * vload(b + d);
    }
    float sum = 0.0f;
    for (int lane = 0; lane < LANES; lane++) {
        sum += acc[lane];
    }
    for (; d < n; d++) {
        sum += a[d] * b[d];
    }
    return sum;
}

/* acc = acc * scale + sum_j weight[j] * rows[j], each accumulator lane kept in a register
 * across the rows. */
static inline void accumulate(float *acc, float scale, const float *weight,
                              const float *const *rows, int count, int n) {
    int d = 0;
    for (; d + LANES <= n; d += LANES) {
        vfloat sum = vload(acc + d) * scale;
        for (int j = 0; j < count; j++) {
            sum += weight[j] * vload(rows[j] + d);
        }
        memcpy(acc + d, &sum, sizeof sum);
    }
    for (; d < n; d++) {
        float sum = acc[d] * scale;
        for (int j = 0; j < count; j++) {
            sum += weight[j] * rows[j][d];
        }
        acc[d] = sum;
    }
}

/* The chunk from position pos (0 keys at or past seq_len): its key count, and its first
 * cell into *first_cell. */
static inline int chunk_at(const DecodeArgs *a, const int32_t *blocks, int kv_head, int pos,
                           int seq_len, int64_t *first_cell) {
    if (pos >= seq_len) return 0;
    const int64_t slot = (int64_t)blocks[pos / a->block_size] * a->block_size
                         + pos % a->block_size;
    const int row = (int)(slot % a->kernel_block_size);
    int count = a->kernel_block_size - row;
    count = count < seq_len - pos ? count : seq_len - pos;
    count = count < CHUNK ? count : CHUNK;
    *first_cell = (slot / a->kernel_block_size) * a->stride_cb + kv_head * a->stride_ch
                  + row * a->stride_cn;
    return count;
}

/* Ask for the K and V of one cell (a position of one KV head) to be brought into the cache. */
static inline void prefetch_cell(const DecodeArgs *a, int64_t cell) {
    const int element = a->dtype == DTYPE_F32 ? 4 : 2;
    const char *first = a->cache + cell * element;
    const int64_t span = (int64_t)(a->head_size + a->head_size_v) * a->stride_cc * element;
    for (int64_t offset = 0; offset < span; offset += 64) __builtin_prefetch(first + offset);
}

/* What one (request, KV head) item reads and writes: all its keys, or one part of them. */
typedef struct {
    int kv_head, group, seq_len;
    int first_key;          /* past the sliding window's reach, keys are not read */
    int end_key;            /* keys first_key .. end_key - 1 are this item's (or part's) */
    int with_sink;          /* the part whose softmax starts from the sink */
    const float *query;     /* the request's query row, every head */
    float *out;             /* its output row */
    const int32_t *blocks;  /* its block table row */
    float *partial;         /* NULL: write out; else [max, sum, acc] for a later merge */
} Item;

static inline Item item_at(const DecodeArgs *a, int64_t item) {
    const int request = (int)(item / a->num_kv_heads);
    Item it = {(int)(item % a->num_kv_heads), a->num_q_heads / a->num_kv_heads,
               a->seq_lens[request], 0, a->seq_lens[request], 1, NULL, NULL, NULL, NULL};
    const int position = it.seq_len - 1;  /* the query's own position */
    if (a->sliding_window > 0 && position - a->sliding_window + 1 > 0) {
        it.first_key = position - a->sliding_window + 1;
    }
    const int64_t row = a->token_of[request];
    it.query = a->query + row * a->num_q_heads * a->head_size;
    it.out = a->out + row * a->num_q_heads * a->head_size_v;
    it.blocks = a->block_table + (int64_t)request * a->stride_bt;
    return it;
}

/* Part `part` of `parts` equal runs of an item's keys, its softmax state into `partial`. */
static inline Item item_part(const DecodeArgs *a, int64_t item, int part, int parts,
                             float *partial) {
    Item it = item_at(a, item);
    const int64_t keys = it.end_key - it.first_key, first = it.first_key;
    it.first_key = (int)(first + keys * part / parts);
    it.end_key = (int)(first + keys * (part + 1) / parts);
    it.with_sink = part == 0;
    it.partial = partial;
    return it;
}

/* Each query head's softmax starts from its sink (a logit with no value) or from nothing. */
static inline void start_softmax(const DecodeArgs *a, const Item *it, float *row_max,
                                 float *row_sum, float *acc) {
    for (int g = 0; g < it->group; g++) {
        const int q_head = it->kv_head * it->group + g;
        const int sink = a->sinks != NULL && it->with_sink;
        row_max[g] = sink ? a->sinks[q_head] : -FLT_MAX;  /* finite: exp of it is 0 */
        row_sum[g] = sink ? 1.0f : 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)(it->group * a->head_size_v));
}

/* out = acc / sum for each query head of the item; or, for a part, its state as it stands. */
static inline void write_outputs(const Item *it, const float *acc, const float *row_max,
                                 const float *row_sum, int head_v) {
    if (it->partial != NULL) {
        memcpy(it->partial, row_max, sizeof(float) * (size_t)it->group);
        memcpy(it->partial + it->group, row_sum, sizeof(float) * (size_t)it->group);
        memcpy(it->partial + 2 * it->group, acc, sizeof(float) * (size_t)(it->group * head_v));
        return;
    }
    for (int g = 0; g < it->group; g++) {
        float *dst = it->out + (int64_t)(it->kv_head * it->group + g) * head_v;
        const float inverse = row_sum[g] > 0.0f ? 1.0f / row_sum[g] : 0.0f;
        for (int d = 0; d < head_v; d++) {
            dst[d] = acc[g * head_v + d] * inverse;
        }
    }
}

static void decode_item(const DecodeArgs *a, const Item it) {
    const int kv_head = it.kv_head, group = it.group, seq_len = it.end_key;
    const int head = a->head_size, head_v = a->head_size_v;
    const float *query = it.query;
    const int32_t *blocks = it.blocks;

    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    float acc[MAX_GROUP * MAX_HEAD];
    float logits[MAX_GROUP * CHUNK];
    float key_scratch[CHUNK * MAX_HEAD], value_scratch[CHUNK * MAX_HEAD];
    const float *keys[CHUNK], *values[CHUNK];
    start_softmax(a, &it, row_max, row_sum, acc);

    /* One chunk is a run of rows of one kernel block: consecutive positions whose cells are
     * stride_cn apart, so the block table and the divisions are consulted once per chunk.
     * While a chunk is scored, the next one's rows are asked for, one per key scored: its
     * cells sit in another block, where the hardware prefetchers (which follow a stream
     * within a page) do not go by themselves. 64 requests of 250 keys: 15.5 GB/s against
     * 13.3 without (two cores, float32 cache). */
    int64_t first_cell = 0, next_cell = 0;
    int count = chunk_at(a, blocks, kv_head, it.first_key, seq_len, &first_cell);
    for (int pos = it.first_key; pos < seq_len;) {
        const int next_count = chunk_at(a, blocks, kv_head, pos + count, seq_len, &next_cell);
        for (int j = 0; j < count; j++) {
            const int64_t cell = first_cell + j * a->stride_cn;
            keys[j] = row_as_f32(key_scratch + j * head, a->cache, cell, a->stride_cc, head,
                                 a->dtype);
            values[j] = row_as_f32(value_scratch + j * head_v, a->cache,
                                   cell + (int64_t)head * a->stride_cc, a->stride_cc, head_v,
                                   a->dtype);
        }
        for (int g = 0; g < group; g++) {
            const float *q = query + (int64_t)(kv_head * group + g) * head;
            float *logit = logits + g * CHUNK;
            float new_max = row_max[g];
            for (int j = 0; j < count; j++) {
                if (g == 0 && j < next_count) prefetch_cell(a, next_cell + j * a->stride_cn);
                float x = dot(q, keys[j], head) * a->scale;
                if (a->softcap > 0.0f) {
                    x = a->softcap * tanhf(x / a->softcap);
                }
                logit[j] = x;
                new_max = x > new_max ? x : new_max;
            }
            /* Online softmax: what was summed so far shrinks when the maximum grows. */
            const float rescale = expf(row_max[g] - new_max);
            row_max[g] = new_max;
            row_sum[g] *= rescale;
            for (int j = 0; j < count; j++) {
                logit[j] = expf(logit[j] - new_max);
                row_sum[g] += logit[j];
            }
            accumulate(acc + g * head_v, rescale, logit, values, count, head_v);
        }
        pos += count;
        count = next_count;
        first_cell = next_cell;
    }
    write_outputs(&it, acc, row_max, row_sum, head_v);
}

#if defined(__AVX512F__)
/* The same item on AVX-512 for a float32 cache with unit channel stride and head sizes of 16k
 * (no softcap): sixteen lanes, the key and value rows read once per chunk for the whole query
 * group, and the chunk's exponentials sixteen at a time. The scalar loop above spent about
 * half its time in per-key expf calls and 8-lane horizontal sums; at 64 requests x 250 keys
 * (8/4 heads of 64, two cores) this one reads the cache at 19.2-20.3 GB/s where that
 * one read 15.9-16.1 (and 41 against 29-30 from the L2 cache). */

/* exp(x) for the softmax's x <= 0: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by Cephes' degree-6
 * polynomial (within 2 ulp of expf), times 2^n. Below -103 expf is 0 or a denormal; here it
 * is about 1e-45, which weighs nothing beside the maximum's 1. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-103.0f));
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

static inline int fits_avx512(const DecodeArgs *a) {
    return a->dtype == DTYPE_F32 && a->stride_cc == 1 && a->softcap == 0.0f
           && a->head_size == a->head_size_v && a->head_size % 16 == 0;
}

/* One chunk of `count` keys for query head g: scores into logit[0..count). */
static inline void score_chunk(const DecodeArgs *a, const float *q, const float *const *keys,
                               int count, float *logit, int head) {
    for (int j = 0; j < count; j++) {
        __m512 sum = _mm512_setzero_ps();
        for (int d = 0; d < head; d += 16)
            sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(keys[j] + d), sum);
        logit[j] = _mm512_reduce_add_ps(sum) * a->scale;
    }
}

/* logit[j] = exp(logit[j] - max) for the chunk's keys; returns their sum. */
static inline float exp_chunk(float *logit, int count, float max) {
    __m512 total = _mm512_setzero_ps();
    const __m512 shift = _mm512_set1_ps(max);
    for (int j = 0; j < count; j += 16) {
        const __mmask16 mask = count - j >= 16 ? 0xffff : (__mmask16)((1u << (count - j)) - 1);
        const __m512 e = exp_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, logit + j), shift));
        _mm512_mask_storeu_ps(logit + j, mask, e);
        total = _mm512_add_ps(total, _mm512_maskz_mov_ps(mask, e));
    }
    return _mm512_reduce_add_ps(total);
}

/* acc = acc * rescale + sum_j weight[j] * values[j], sixteen lanes at a time. */
static inline void accumulate16(float *acc, float rescale, const float *weight,
                                const float *const *values, int count, int head) {
    for (int d = 0; d < head; d += 16) {
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(acc + d), _mm512_set1_ps(rescale));
        for (int j = 0; j < count; j++)
            sum = _mm512_fmadd_ps(_mm512_set1_ps(weight[j]), _mm512_loadu_ps(values[j] + d), sum);
        _mm512_storeu_ps(acc + d, sum);
    }
}

static void decode_item_avx512(const DecodeArgs *a, const Item it) {
    const int kv_head = it.kv_head, group = it.group, seq_len = it.end_key;
    const int head = a->head_size;
    float row_max[MAX_GROUP], row_sum[MAX_GROUP];
    float acc[MAX_GROUP * MAX_HEAD], logit[CHUNK];
    const float *keys[CHUNK], *values[CHUNK];
    start_softmax(a, &it, row_max, row_sum, acc);
    const float *cache = (const float *)a->cache;
    int64_t first_cell = 0, next_cell = 0;
    int count = chunk_at(a, it.blocks, kv_head, it.first_key, seq_len, &first_cell);
    for (int pos = it.first_key; pos < seq_len;) {
        const int next_count = chunk_at(a, it.blocks, kv_head, pos + count, seq_len, &next_cell);
        for (int j = 0; j < count; j++) {  /* the next chunk is asked for, as above */
            if (j < next_count) prefetch_cell(a, next_cell + j * a->stride_cn);
            keys[j] = cache + first_cell + j * a->stride_cn;
            values[j] = keys[j] + head;
        }
        for (int g = 0; g < group; g++) {
            score_chunk(a, it.query + (int64_t)(kv_head * group + g) * head, keys, count, logit,
                        head);
            float new_max = row_max[g];
            for (int j = 0; j < count; j++) new_max = logit[j] > new_max ? logit[j] : new_max;
            const float rescale = expf(row_max[g] - new_max);
            row_max[g] = new_max;
            row_sum[g] = row_sum[g] * rescale + exp_chunk(logit, count, new_max);
            accumulate16(acc + g * head, rescale, logit, values, count, head);
        }
        pos += count;
        count = next_count;
        first_cell = next_cell;
    }
    write_outputs(&it, acc, row_max, row_sum, head);
}
#endif

static void decode_one(const DecodeArgs *a, const Item it) {
#if defined(__AVX512F__)
    if (fits_avx512(a)) {
        decode_item_avx512(a, it);
        return;
    }
#endif
    decode_item(a, it);
}

/* Floats of one part's state: each query head's maximum and sum, then its accumulator. */
static inline int64_t partial_size(const DecodeArgs *a) {
    const int group = a->num_q_heads / a->num_kv_heads;
    return (int64_t)group * (2 + a->head_size_v);
}

/* An item's output from its parts' states: each part's sum and accumulator weighed by
 * exp(its maximum - the largest), added in part order. */
static void merge_parts(const DecodeArgs *a, int64_t item, const float *partials, int parts) {
    const Item it = item_at(a, item);
    const int group = it.group, head_v = a->head_size_v;
    const int64_t size = partial_size(a);
    for (int g = 0; g < group; g++) {
        float largest = -FLT_MAX, total = 0.0f, weight[MAX_THREADS];
        for (int t = 0; t < parts; t++) {
            const float m = partials[t * size + g];
            largest = m > largest ? m : largest;
        }
        for (int t = 0; t < parts; t++) {
            weight[t] = expf(partials[t * size + g] - largest);
            total += partials[t * size + group + g] * weight[t];
        }
        const float inverse = total > 0.0f ? 1.0f / total : 0.0f;
        float *dst = it.out + (int64_t)(it.kv_head * group + g) * head_v;
        for (int d = 0; d < head_v; d++) {
            float sum = 0.0f;
            for (int t = 0; t < parts; t++)
                sum += partials[t * size + 2 * group + g * head_v + d] * weight[t];
            dst[d] = sum * inverse;
        }
    }
}

/* One piece of the work: part `part` of an item's `parts` runs of keys (the whole item when
 * `parts` is 1), its softmax state at `partial` floats into the states (for a split item). */
typedef struct {
    int64_t item, partial, keys;
    int part, parts;
} Unit;

/* An item's keys go into as many parts as there are threads, with at least MIN_PART_KEYS
 * keys a part. The number depends on the item alone, never on the batch around it, so a
 * request's attention is the same whatever else runs (a speculative verification's rows
 * and plain decode steps agree); and a decode step of one request over SmolLM2's three KV
 * heads keeps both threads busy, where whole items left one with two and the other with
 * one. */
enum { MIN_PART_KEYS = 32 };

static int parts_of(int64_t keys, int num_threads) {
    const int64_t parts = keys / MIN_PART_KEYS;
    return parts < 1 ? 1 : parts > num_threads ? num_threads : (int)parts;
}

/* The units, and into cut[0..num_threads] where each thread's run of them starts: runs of
 * about equal keys. Returns the units' count. */
static int64_t plan_units(const DecodeArgs *a, int64_t num_items, int num_threads, Unit *units,
                          int64_t *cut, int64_t *num_partial_floats) {
    const int64_t size = partial_size(a);
    int64_t count = 0, floats = 0, total = 0;
    for (int64_t i = 0; i < num_items; i++) {
        const Item it = item_at(a, i);
        const int64_t keys = it.end_key - it.first_key; /* item_part's runs */
        const int parts = parts_of(keys, num_threads);
        for (int p = 0; p < parts; p++) {
            const int64_t run = keys * (p + 1) / parts - keys * p / parts;
            units[count++] = (Unit){i, parts > 1 ? floats + p * size : -1, run, p, parts};
            total += run;
        }
        if (parts > 1) floats += parts * size;
    }
    int64_t before = 0, u = 0;
    for (int t = 0; t <= num_threads; t++) {
        while (u < count && before * num_threads < t * total) before += units[u++].keys;
        cut[t] = t == num_threads ? count : u;
    }
    *num_partial_floats = floats;
    return count;
}

/* Returns 0, -1 when a size is beyond the stack accumulators, or 3 when memory runs out. */
int paged_decode_attention(DecodeArgs *args, int64_t num_items, int num_threads) {
    if (args->head_size > MAX_HEAD || args->head_size_v > MAX_HEAD
        || args->num_q_heads / args->num_kv_heads > MAX_GROUP || num_threads < 1
        || num_threads > MAX_THREADS) {
        return -1;
    }
    Unit *units = malloc(sizeof(Unit) * (size_t)(num_items * num_threads + 1));
    int64_t cut[MAX_THREADS + 1], floats = 0;
    if (units == NULL) return 3;
    const int64_t count = plan_units(args, num_items, num_threads, units, cut, &floats);
    float *partials = floats > 0 ? malloc(sizeof(float) * (size_t)floats) : NULL;
    if (floats > 0 && partials == NULL) {
        free(units);
        return 3;
    }
    /* The runs go to the OpenMP pool torch has started (the library resolves libgomp to
     * torch's): a fresh thread per run per call cost ~0.5 ms, more than a decode step's
     * attention at short contexts. Built without OpenMP, the runs go one after another. */
#pragma omp parallel for schedule(static, 1) num_threads(num_threads)
    for (int t = 0; t < num_threads; t++) {
        for (int64_t u = cut[t]; u < cut[t + 1]; u++) {
            const Unit *unit = &units[u];
            decode_one(args, unit->parts == 1
                                 ? item_at(args, unit->item)
                                 : item_part(args, unit->item, unit->part, unit->parts,
                                             partials + unit->partial));
        }
    }
#pragma omp parallel for schedule(static) num_threads(num_threads) if (count > 64)
    for (int64_t u = 0; u < count; u++) {
        if (units[u].parts > 1 && units[u].part == 0)
            merge_parts(args, units[u].item, partials + units[u].partial, units[u].parts);
    }
    free(partials);
    free(units);
    return 0;
}
