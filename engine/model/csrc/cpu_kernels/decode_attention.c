#include "prelude.h"

#include <omp.h>

#include "decode_part.h"

/* Tokens of work item `task` (0 for a part past its sequence's end). */
static inline int64_t task_len(int64_t task, int grouped, int64_t nparts, int64_t kv_heads, int64_t part_len,
                               const int64_t *lens) {
    const int64_t b = grouped ? task / nparts : task / (kv_heads * nparts), t0 = (task % nparts) * part_len;
    return t0 >= lens[b] ? 0 : (lens[b] - t0 < part_len ? lens[b] - t0 : part_len);
}

/* offs[i] = element offset of token i's record (kv head 0) in work item `task`, block by block; returns its tokens */
static int64_t task_offs(int64_t task, int grouped, int64_t nparts, int64_t kv_heads, int64_t part_len, int64_t dim,
                         int64_t block_size, const int64_t *table, int64_t max_blocks, const int64_t *lens,
                         int64_t *offs) {
    const int64_t b = grouped ? task / nparts : task / (kv_heads * nparts), t0 = (task % nparts) * part_len;
    const int64_t n = task_len(task, grouped, nparts, kv_heads, part_len, lens);
    const int64_t *blocks = table + b * max_blocks;
    for (int64_t i = 0; i < n;) {
        const int64_t t = t0 + i, bi = t / block_size, within = t - bi * block_size;
        const int64_t base = (blocks[bi] * block_size + within) * kv_heads;
        for (int64_t j = 0; j < block_size - within && i < n; j++, i++) offs[i] = (base + j * kv_heads) * dim;
    }
    return n;
}

void kvchat_paged_decode(
    const void *q, int64_t q_stride, const int64_t *q_rows,
    const void *k_cache, const void *v_cache, int64_t block_size,
    const int64_t *table, int64_t max_blocks, const int64_t *lens,
    void *out, int64_t out_stride, const int64_t *out_rows,
    int64_t batch, int64_t heads, int64_t kv_heads, int64_t dim,
    float scale, int bf16, int nthreads, int64_t part_len)
{
    const int64_t group = heads / kv_heads;
    int64_t max_len = 0;
    for (int64_t b = 0; b < batch; b++) max_len = lens[b] > max_len ? lens[b] : max_len;
    const int64_t nparts = (max_len + part_len - 1) / part_len;
    const int64_t per_task = group * (dim + 2); /* acc[group][dim], then max[group], sum[group] */
    /* Work items: (sequence, part) with all its kv heads in turn, when there are enough of them (16 x 1k
       context, bf16, from memory: 28 -> 24 ms against one item per kv head, when items prefetched their own
       tokens). Else (sequence, kv head, part), which keeps both threads busy on a lone short sequence. */
    const int grouped = batch * nparts >= 2 * nthreads && kv_heads > 1;
    const int64_t ntasks = grouped ? batch * nparts : batch * kv_heads * nparts;
    const int64_t nslots = batch * kv_heads * nparts;
    float *scratch = (float *)malloc(sizeof(float) * (size_t)(nslots * per_task));
    if (!scratch) return;
    const int64_t esize = bf16 ? 2 : 4;
    /* the pipelined prefetch holds two items' K/V in L2: only where they take at most half of it (else each item
       fetches its own tokens PREFETCH ahead). SmolLM2, 128-token items: 96 KiB in bf16, 192 in fp32. Measured, 16 x
       1k context, 30 layers, fp32 (384 KiB for two items) on a Zen 3 EPYC (512 KiB L2): 50 ms pipelined, 44 not
       (a kv head's rows a pass). Record fetches (AVX2_ONLY) pipeline where two items fit in all of L2. */
    const int64_t two_items = 2 * part_len * 2 * (grouped ? kv_heads : 1) * dim * esize;
    const int records = AVX2_ONLY && grouped && (dim * esize) % 128 == 0; /* (whole K/V line pairs a call) */
    const int pipelined = (records ? two_items : 2 * two_items) <= l2_bytes();

#pragma omp parallel num_threads(nthreads)
    {
        const size_t floats = (size_t)(group * dim + group * (part_len + 16) + dim + 64 + group * 256
                                       + group * (part_len + 16) / 2); /* (then the bf16 weights) */
        float *buf = (float *)malloc(sizeof(float) * floats);
        int64_t *offs_buf = (int64_t *)malloc(sizeof(int64_t) * (size_t)(2 * part_len));
        float *qf = buf, *s = buf + group * dim, *tmp = s + group * (part_len + 16), *red = tmp + dim + 64;
        uint16_t *ph = (uint16_t *)(red + group * 256);
        /* This thread's items: a contiguous run, split by token counts so that the threads get equal work (each
           item's next one is then known, for the pipelined prefetch). */
        const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
        int64_t total = 0;
        for (int64_t task = 0; task < ntasks; task++)
            total += task_len(task, grouped, nparts, kv_heads, part_len, lens);
        int64_t lo = ntasks, hi = ntasks, seen = 0;
        for (int64_t task = 0; task < ntasks; task++) {
            const int64_t n = task_len(task, grouped, nparts, kv_heads, part_len, lens);
            int owner = total ? (int)(((2 * seen + n) * nth) / (2 * total)) : 0; /* by the item's middle */
            owner = owner < nth ? owner : nth - 1; /* (empty items at the end) */
            seen += n;
            if (owner == tid && lo == ntasks) lo = task;
            if (owner > tid) { hi = task; break; }
        }
        int64_t *offs = offs_buf, *next_offs = offs_buf + part_len;
        if (lo < hi) task_offs(lo, grouped, nparts, kv_heads, part_len, dim, block_size, table, max_blocks, lens, offs);
        int fetched = 0;
        for (int64_t task = lo; task < hi; task++) {
            const int64_t b = grouped ? task / nparts : task / (kv_heads * nparts), p = task % nparts;
            const int64_t kv_lo = grouped ? 0 : (task / nparts) % kv_heads, kv_hi = grouped ? kv_heads : kv_lo + 1;
            const int64_t n = task_len(task, grouped, nparts, kv_heads, part_len, lens);
            int64_t at[2] = {0, 0};
            pf_next pf = {.records = records, .rec_lines = kv_heads * dim * esize / 64, .at = at};
            int64_t next_kv = 0;
            if (task + 1 < hi) {
                const int64_t next_n = task_offs(task + 1, grouped, nparts, kv_heads, part_len, dim, block_size,
                                                 table, max_blocks, lens, next_offs);
                pf.n = pipelined && n > 0 ? next_n : 0; /* (an empty item has no passes to fetch during) */
                pf.offs = next_offs;
                next_kv = grouped ? 0 : ((task + 1) / nparts) % kv_heads;
            }
            for (int64_t kvh = kv_lo; kvh < kv_hi; kvh++) {
                float *acc = scratch + ((b * kv_heads + kvh) * nparts + p) * per_task, *mx = acc + group * dim;
                float *sm = mx + group;
                if (n == 0) {
                    for (int64_t g = 0; g < group; g++) { mx[g] = -3.0e38f; sm[g] = 0.0f; }
                    continue;
                }
                const char *kc = (const char *)k_cache + kvh * dim * esize;
                const char *vc = (const char *)v_cache + kvh * dim * esize;
                /* this pass fetches the next item's rows of its kv head number (kvh - kv_lo); records from the first */
                const int64_t fetch_kv = records ? 0 : next_kv + kvh - kv_lo;
                pf.k = (const char *)k_cache + fetch_kv * dim * esize;
                pf.v = (const char *)v_cache + fetch_kv * dim * esize;
                /* an item not prefetched (a thread's first) fetches its own tokens PREFETCH ahead */
                const int64_t pf_len = fetched ? 0 : grouped && kvh == kv_lo ? kv_heads * dim : dim;
                run_part(dim, bf16, group, kv_heads, kvh, q, q_rows[b] * q_stride, kc, vc, offs, n, part_len,
                         scale, qf, s, tmp, acc, mx, sm, red, pf_len, &pf, ph);
                if (records && kvh + 1 == kv_hi) /* what the passes left (a next item longer than this one) */
                    while (at[0] < pf.n) pf_token(&pf, pf.k, 0, dim, esize);
                for (int64_t i = n; i < pf.n && !records; i++) { /* a next item longer than this one: the rest */
                    pf_token(&pf, pf.k, i, dim, esize);
                    pf_token(&pf, pf.v, i, dim, esize);
                }
            }
            fetched = pipelined && n > 0;
            int64_t *swap = offs;
            offs = next_offs;
            next_offs = swap;
        }
#pragma omp barrier

#pragma omp for schedule(static)
        for (int64_t bh = 0; bh < batch * heads; bh++) {
            const int64_t b = bh / heads, h = bh % heads, kvh = h / group, g = h % group;
            const float *base = scratch + (b * kv_heads + kvh) * nparts * per_task;
            merge_row(base, nparts, per_task, g * dim, group * dim + g, group * dim + group + g, dim, bf16, tmp, out,
                      out_rows[b] * out_stride + h * dim);
        }
        free(offs_buf);
        free(buf);
    }
    free(scratch);
}
