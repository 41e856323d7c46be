/* Decode attention for verify items (engine.spec): a sequence's decode row and its k drafts, query rows at
   positions p, p+1, ..., p+k, row r attending keys 0..p+r, in one pass over the sequence's K/V.

   Each row's result has the bits the lone-row kernel (decode_attention.c) gives it: the work items are the same
   (kv head, PART tokens from token 0) and run the same code (decode_part.h's part and merge_row). A part that every
   row covers in full is one call of part() whose query group is all the rows' groups stacked (a row's math in
   part() depends only on its own query, the part's tokens and their count), so K and V are loaded once for all
   rows; a part that some rows end in (the last one or two) is run per such row with that row's token count, as the
   lone kernel runs it. The merge of a row's parts is merge_row, the parts in order. */
#include "prelude.h"

#include <omp.h>

#include "decode_part.h"

/* A work item: item s's part p (tokens t0 .. t0 + n, n those of its longest row), kv heads kv_lo .. kv_hi */
typedef struct {
    int64_t s, p, kv_lo, kv_hi, n;
} verify_task;

/* offs[i] = element offset of token t0 + i's record (kv head 0) of a sequence, i < n */
static void part_offs(const int64_t *blocks, int64_t block_size, int64_t kv_heads, int64_t dim, int64_t t0,
                      int64_t n, int64_t *offs) {
    for (int64_t i = 0; i < n; i++) {
        const int64_t t = t0 + i, bi = t / block_size;
        offs[i] = ((blocks[bi] * block_size + t - bi * block_size) * kv_heads) * dim;
    }
}

/* One work item, kv head kvh: the rows that cover the part in full stacked into one part() call (it fetches the
   next item's rows by `pf`, and, where the item was not prefetched, its own tokens ahead), then each row that ends
   in the part by itself over its own tokens (now in cache). */
static void verify_part(
    const verify_task *t, int64_t kvh, const void *q, int64_t q_stride, const int64_t *first_rows,
    const int64_t *counts, const int64_t *lens, const void *k_cache, const void *v_cache, const int64_t *offs,
    int64_t group, int64_t kv_heads, int64_t dim, int bf16, int64_t part_len, float scale, float *scratch,
    const int64_t *slot0, char *qs, float *qf, float *s_buf, float *tmp, float *red, uint16_t *ph, int64_t pf_len,
    const pf_next *pf)
{
    const int64_t s = t->s, R = counts[s], t0 = t->p * part_len, n = t->n, esize = bf16 ? 2 : 4;
    const int64_t nparts = (lens[s] + R - 1 + part_len - 1) / part_len, per_part = R * group * (dim + 2);
    float *acc = scratch + slot0[s] + (kvh * nparts + t->p) * per_part, *mx = acc + R * group * dim;
    float *sm = mx + R * group;
    const char *kc = (const char *)k_cache + kvh * dim * esize, *vc = (const char *)v_cache + kvh * dim * esize;
    int64_t r0 = 0; /* rows r0.. cover the part in full (n tokens each); the rows before end in it or before it */
    while (r0 < R && lens[s] + r0 - t0 < n) r0++;
    for (int64_t r = r0; r < R; r++) {
        const char *src = (const char *)q + ((first_rows[s] + r) * q_stride + kvh * group * dim) * esize;
        memcpy(qs + (r - r0) * group * dim * esize, src, (size_t)(group * dim * esize));
    }
    run_part(dim, bf16, (R - r0) * group, kv_heads, 0, qs, 0, kc, vc, offs, n, part_len, scale, qf, s_buf, tmp,
             acc + r0 * group * dim, mx + r0 * group, sm + r0 * group, red, pf_len, pf, ph);
    const pf_next none = {.n = 0};
    for (int64_t r = 0; r < r0; r++) {
        const int64_t nr = lens[s] + r - t0;
        if (nr <= 0) {
            for (int64_t g = 0; g < group; g++) mx[r * group + g] = -3.0e38f, sm[r * group + g] = 0.0f;
            continue;
        }
        run_part(dim, bf16, group, kv_heads, kvh, q, (first_rows[s] + r) * q_stride, kc, vc, offs, nr, part_len,
                 scale, qf, s_buf, tmp, acc + r * group * dim, mx + r * group, sm + r * group, red, 0, &none, ph);
    }
}

void kvchat_paged_verify(
    const void *q, int64_t q_stride, const int64_t *first_rows, const int64_t *counts,
    const void *k_cache, const void *v_cache, int64_t block_size,
    const int64_t *table, int64_t max_blocks, const int64_t *lens,
    void *out, int64_t out_stride,
    int64_t items, int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int bf16, int nthreads, int64_t part_len)
{
    /* item s: rows first_rows[s] + r (q and out), r < counts[s], row r over lens[s] + r keys */
    const int64_t group = heads / kv_heads, esize = bf16 ? 2 : 4;
    int64_t max_rows = 1, all_parts = 0, floats = 0, rows_total = 0;
    int64_t *slot0 = (int64_t *)malloc(sizeof(int64_t) * (size_t)(items + 1)); /* each item's first scratch float */
    if (!slot0) return;
    for (int64_t s = 0; s < items; s++) {
        const int64_t nparts = (lens[s] + counts[s] - 1 + part_len - 1) / part_len;
        slot0[s] = floats;
        all_parts += nparts;
        floats += kv_heads * nparts * counts[s] * group * (dim + 2);
        max_rows = counts[s] > max_rows ? counts[s] : max_rows;
        rows_total += counts[s];
    }
    /* work items as the lone kernel's: (item, part) with all kv heads in turn where there are enough of them, else
       (item, kv head, part) */
    const int grouped = all_parts >= 2 * nthreads && kv_heads > 1;
    const int64_t ntasks = grouped ? all_parts : all_parts * kv_heads;
    verify_task *tasks = (verify_task *)malloc(sizeof(verify_task) * (size_t)(ntasks > 0 ? ntasks : 1));
    /* scratch of (item s, kv head, part): acc[rows * group][dim], then max[rows * group], sum[rows * group] */
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(floats > 0 ? floats : 1));
    if (!tasks || !scratch) {
        free(slot0), free(tasks), free(scratch);
        return;
    }
    int64_t at_task = 0;
    for (int64_t s = 0; s < items; s++) {
        const int64_t nparts = (lens[s] + counts[s] - 1 + part_len - 1) / part_len, longest = lens[s] + counts[s] - 1;
        for (int64_t kvh = 0; kvh < (grouped ? 1 : kv_heads); kvh++)
            for (int64_t p = 0; p < nparts; p++) {
                const int64_t left = longest - p * part_len, n = left < part_len ? left : part_len;
                tasks[at_task++] = (verify_task){s, p, grouped ? 0 : kvh, grouped ? kv_heads : kvh + 1, n};
            }
    }
    /* the pipelined prefetch where two items' K/V take at most half of L2 (as the lone kernel; no record fetches) */
    const int pipelined = 2 * (2 * part_len * 2 * (grouped ? kv_heads : 1) * dim * esize) <= l2_bytes();

#pragma omp parallel num_threads(nthreads)
    {
        const int64_t G = max_rows * group; /* the stacked group's most query rows */
        const size_t nfloats = (size_t)(G * dim + G * (part_len + 16) + dim + 64 + G * 256 + G * (part_len + 16) / 2);
        float *buf = (float *)malloc(sizeof(float) * nfloats);
        int64_t *offs_buf = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * part_len));
        char *qs = (char *)malloc((size_t)(G * dim * esize)); /* the stacked rows' queries of one kv head */
        float *qf = buf, *s_buf = buf + G * dim, *tmp = s_buf + G * (part_len + 16), *red = tmp + dim + 64;
        uint16_t *ph = (uint16_t *)(red + G * 256);
        /* this thread's items: a contiguous run, split by token counts (each item's next one is then known) */
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t total = 0, lo = ntasks, hi = ntasks, seen = 0;
        for (int64_t task = 0; task < ntasks; task++) total += tasks[task].n;
        for (int64_t task = 0; task < ntasks; task++) {
            const int64_t n = tasks[task].n;
            int owner = total ? (int)(((2 * seen + n) * nth) / (2 * total)) : 0; /* by the item's middle */
            owner = owner < nth ? owner : nth - 1;
            seen += n;
            if (owner == tid && lo == ntasks) lo = task;
            if (owner > tid) { hi = task; break; }
        }
        int64_t *offs = offs_buf, *next_offs = offs_buf + part_len;
        if (lo < hi) {
            const verify_task *t = tasks + lo;
            part_offs(table + t->s * max_blocks, block_size, kv_heads, dim, t->p * part_len, t->n, offs);
        }
        int fetched = 0;
        for (int64_t task = lo; task < hi; task++) {
            const verify_task *t = tasks + task;
            int64_t at[2] = {0, 0};
            pf_next pf = {.at = at};
            int64_t next_kv = 0;
            if (task + 1 < hi) {
                const verify_task *u = t + 1;
                part_offs(table + u->s * max_blocks, block_size, kv_heads, dim, u->p * part_len, u->n, next_offs);
                pf.n = pipelined ? u->n : 0;
                pf.offs = next_offs;
                next_kv = u->kv_lo;
            }
            for (int64_t kvh = t->kv_lo; kvh < t->kv_hi; kvh++) {
                /* this pass fetches the next item's rows of its kv head number (kvh - kv_lo) */
                pf.k = (const char *)k_cache + (next_kv + kvh - t->kv_lo) * dim * esize;
                pf.v = (const char *)v_cache + (next_kv + kvh - t->kv_lo) * dim * esize;
                const int64_t pf_len = fetched ? 0 : grouped && kvh == t->kv_lo ? kv_heads * dim : dim;
                verify_part(t, kvh, q, q_stride, first_rows, counts, lens, k_cache, v_cache, offs, group, kv_heads,
                            dim, bf16, part_len, scale, scratch, slot0, qs, qf, s_buf, tmp, red, ph, pf_len, &pf);
                for (int64_t i = t->n; i < pf.n; i++) { /* a next item longer than this one: the rest */
                    pf_token(&pf, pf.k, i, dim, esize);
                    pf_token(&pf, pf.v, i, dim, esize);
                }
            }
            fetched = pipelined;
            int64_t *swap = offs;
            offs = next_offs;
            next_offs = swap;
        }
#pragma omp barrier

#pragma omp for schedule(static)
        for (int64_t rh = 0; rh < rows_total * heads; rh++) {
            int64_t s = 0, row = rh / heads;
            while (row >= counts[s]) row -= counts[s++];
            const int64_t h = rh % heads, kvh = h / group, g = h % group, R = counts[s];
            const int64_t nparts = (lens[s] + R - 1 + part_len - 1) / part_len, per_part = R * group * (dim + 2);
            const int64_t own = (lens[s] + row + part_len - 1) / part_len, x = row * group + g;
            const float *base = scratch + slot0[s] + kvh * nparts * per_part;
            merge_row(base, own, per_part, x * dim, R * group * dim + x, R * group * (dim + 1) + x, dim, bf16, tmp,
                      out, (first_rows[s] + row) * out_stride + h * dim);
        }
        free(qs);
        free(offs_buf);
        free(buf);
    }
    free(scratch);
    free(tasks);
    free(slot0);
}
