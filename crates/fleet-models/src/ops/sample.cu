// The fused sampler of ops/sample.rs, compiled to PTX by build.rs (feature `cuda`); the launcher
// and the CPU twin (the same algorithm, step for step) are in the .rs file of the same name.
#include "common.cuh"

// One block of SAMPLE_THREADS threads per row. Every per-row choice is made by a fixed-order
// reduction or by integer histograms, so a row's token depends on its logits, params and seed
// only (not on the batch, nor on the timing of atomics).
#define SAMPLE_THREADS 1024

// The uniform in (0, 1) of token v for a row with `seed` at step `counter` (SplitMix64's
// finaliser over the three, 24 bits kept), as `gumbel_uniform` in sample.rs.
__device__ __forceinline__ float gumbel_uniform(unsigned long long seed, unsigned int counter,
                                                unsigned int v) {
    unsigned long long x = seed ^ ((unsigned long long)counter * 0x9E3779B97F4A7C15ull) ^
                           ((unsigned long long)v * 0xD1B54A32D192ED03ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    return ((float)(x >> 40) + 0.5f) * (1.0f / 16777216.0f);
}

// A float's bits, reordered so that unsigned order is float order (as `sort_key` in sample.rs).
__device__ __forceinline__ unsigned int sort_key(float x) {
    const unsigned int b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// Fixed-point probability mass (2^-40 units) of a token `d` below the row's max score.
__device__ __forceinline__ unsigned long long fixed_mass(float d) {
    return __float2ull_rz(expf(d) * 1099511627776.0f);
}

// Whether v is in the row's sorted, distinct penalty ids.
__device__ __forceinline__ bool in_sorted(const uint32_t *ids, int n, unsigned int v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (ids[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo < n && ids[lo] == v;
}

// The score sampling sees for token v: the logit, penalised when v was seen (transformers'
// RepetitionPenaltyLogitsProcessor: divided when positive, multiplied when negative), then
// times 1/temperature (a greedy row: inv_t = 0, the penalised logit itself).
__device__ __forceinline__ float score_of(float l, unsigned int v, const uint32_t *pen, int n_pen,
                                          float penalty, float inv_t) {
    if (n_pen > 0 && in_sorted(pen, n_pen, v)) l = l < 0.f ? l * penalty : l / penalty;
    return inv_t > 0.f ? l * inv_t : l;
}

template <typename L>
__device__ __forceinline__ float sample_score(const L *row, unsigned int v, const uint32_t *pen,
                                              int n_pen, float penalty, float inv_t) {
    return score_of(to_f(row[v]), v, pen, n_pen, penalty, inv_t);
}

// Calls f(v, row[v]) for v = threadIdx.x, threadIdx.x + SAMPLE_THREADS, ... in that order (the
// order of the twin's sums), with the loads of sixteen of them issued before the first call:
// with one block per row, a pass is bound by the loads' latency (a 7B step's sampler took
// 100 us at batch 1 loading one logit at a time, 62 us loading four, 53 sixteen: ncu, H200).
template <typename L, typename F>
__device__ __forceinline__ void each_logit(const L *row, int vocab, F f) {
    constexpr int U = 16;
    int v = threadIdx.x;
    for (; v + (U - 1) * SAMPLE_THREADS < vocab; v += U * SAMPLE_THREADS) {
        float x[U];
#pragma unroll
        for (int u = 0; u < U; ++u) x[u] = to_f(row[v + u * SAMPLE_THREADS]);
#pragma unroll
        for (int u = 0; u < U; ++u) f(v + u * SAMPLE_THREADS, x[u]);
    }
    for (; v < vocab; v += SAMPLE_THREADS) f(v, to_f(row[v]));
}

// (max, sum of exp(x - max)) pairs combined; the first pair wins ties of order.
__device__ __forceinline__ void online_merge(float &m, float &s, float m2, float s2) {
    if (m2 == -INFINITY) return;
    if (m == -INFINITY) {
        m = m2;
        s = s2;
        return;
    }
    const float nm = fmaxf(m, m2);
    s = s * expf(m - nm) + s2 * expf(m2 - nm);
    m = nm;
}

// Block argmax of (score, index): the largest score, the lowest index among equals.
__device__ __forceinline__ void block_argmax(float &best, int &best_v, float *sb, int *si) {
    for (int o = 16; o > 0; o >>= 1) {
        const float s = __shfl_xor_sync(0xffffffff, best, o);
        const int i = __shfl_xor_sync(0xffffffff, best_v, o);
        if (s > best || (s == best && i < best_v)) {
            best = s;
            best_v = i;
        }
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) {
        sb[warp] = best;
        si[warp] = best_v;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < SAMPLE_THREADS / 32 ? sb[lane] : -INFINITY;
        best_v = lane < SAMPLE_THREADS / 32 ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float s = __shfl_xor_sync(0xffffffff, best, o);
            const int i = __shfl_xor_sync(0xffffffff, best_v, o);
            if (s > best || (s == best && i < best_v)) {
                best = s;
                best_v = i;
            }
        }
        if (lane == 0) {
            sb[0] = best;
            si[0] = best_v;
        }
    }
    __syncthreads();
    best = sb[0];
    best_v = si[0];
    __syncthreads();
}

// Block (max, sumexp) of per-thread pairs, in a fixed tree order.
__device__ __forceinline__ void block_online(float &m, float &s, float *sm, float *ss) {
    for (int o = 16; o > 0; o >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, m, o);
        const float s2 = __shfl_xor_sync(0xffffffff, s, o);
        online_merge(m, s, m2, s2);
    }
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __syncthreads();
    if (lane == 0) {
        sm[warp] = m;
        ss[warp] = s;
    }
    __syncthreads();
    if (warp == 0) {
        m = sm[lane];
        s = ss[lane];
        for (int o = 16; o > 0; o >>= 1) {
            const float m2 = __shfl_xor_sync(0xffffffff, m, o);
            const float s2 = __shfl_xor_sync(0xffffffff, s, o);
            online_merge(m, s, m2, s2);
        }
        if (lane == 0) {
            sm[0] = m;
            ss[0] = s;
        }
    }
    __syncthreads();
    m = sm[0];
    s = ss[0];
    __syncthreads();
}

// The key at which the weight of the keys >= t_min, summed from the highest down, first
// reaches `target` (a radix select over the order keys, 8 bits a pass, from integer
// histograms): weight 1 gives the target-th highest key (top-k), the fixed-point mass the
// lowest key whose higher keys' mass stays below target (top-p). 0 (keep all) when the total
// stays below target. Called by every thread of the block; `hist`, `pick` and `left` are
// shared memory.
template <typename L>
__device__ unsigned int radix_select(const L *row, int vocab, const uint32_t *pen, int n_pen,
                                     float penalty, float inv_t, unsigned int t_min, bool mass,
                                     float smax, unsigned long long target,
                                     unsigned long long *hist, unsigned int *pick,
                                     unsigned long long *left) {
    unsigned int prefix = 0;
    for (int shift = 24; shift >= 0; shift -= 8) {
        const unsigned int hi_mask = shift == 24 ? 0u : (0xFFFFFFFFu << (shift + 8));
        for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) hist[b] = 0;
        __syncthreads();
        for (int v = threadIdx.x; v < vocab; v += SAMPLE_THREADS) {
            const float sc = sample_score(row, v, pen, n_pen, penalty, inv_t);
            const unsigned int key = sort_key(sc);
            if (key >= t_min && (key & hi_mask) == prefix)
                atomicAdd(&hist[(key >> shift) & 0xFF], mass ? fixed_mass(sc - smax) : 1ull);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            unsigned long long above = 0;
            int b = 255;
            for (; b >= 0; --b) {
                if (above + hist[b] >= target) break;
                above += hist[b];
            }
            pick[0] = b < 0 ? 0xFFFFFFFFu : (unsigned int)b;
            *left = target - above;
        }
        __syncthreads();
        const unsigned int b = pick[0];
        target = *left;
        __syncthreads();
        if (b == 0xFFFFFFFFu) return 0;
        prefix |= b << shift;
    }
    return prefix;
}

// One sampled token per row, with transformers' processors in transformers' order: repetition
// penalty, temperature, top-k, top-p, min-p (see `sample_tokens` in sample.rs), drawn by the
// Gumbel-max trick over the tokens kept; greedy rows take the argmax of the penalised logits.
// Writes the token and the log-probability of it under the raw logits (vLLM's raw_logprobs)
// as out[2r], out[2r + 1] (f32 bits).
//
// params, 8 u32 per row: seed (low, high), counter, 1/temperature (f32 bits; 0 = greedy), top_k
// (0 = off), top_p (f32 bits; >= 1 = off), min_p (f32 bits; 0 = off), repetition penalty (f32
// bits; 1 = off). pen: rows + 1 offsets into the ids that follow them, then each row's sorted,
// distinct ids (the prompt's and the generated tokens).
//
// Thresholds are found without sorting: top-k and top-p by a radix select over the scores'
// sort keys, 8 bits a pass, from integer histograms (counts; masses in 2^-40 units), so the
// result does not depend on the order of atomics. Every token whose score ties the threshold
// stays, as transformers keeps top-k ties.
//
// The logits are f32, or the model's bf16/f16 read as they are (each converted to f32 exactly
// on load, so the draw is the f32 kernel's on the converted logits, without a cast kernel and
// its buffer before every step).
template <typename L>
__device__ void sample_tokens(const L *logits, const uint32_t *params, const uint32_t *pen,
                              uint32_t *out, int vocab, int rows) {
    const int r = blockIdx.x;
    const uint32_t *p = params + 8 * (size_t)r;
    const unsigned long long seed = (unsigned long long)p[0] | ((unsigned long long)p[1] << 32);
    const unsigned int counter = p[2];
    const float inv_t = __uint_as_float(p[3]);
    const unsigned int top_k = p[4];
    const float top_p = __uint_as_float(p[5]);
    const float min_p = __uint_as_float(p[6]);
    const float penalty = __uint_as_float(p[7]);
    const L *row = logits + (size_t)r * vocab;
    const uint32_t *pen_ids = pen + (rows + 1) + pen[r];
    const int n_pen = penalty != 1.f ? (int)(pen[r + 1] - pen[r]) : 0;

    __shared__ float sm[32], ss[32];
    __shared__ int si[32];
    __shared__ unsigned long long hist[256];
    __shared__ unsigned int pick[1];
    __shared__ unsigned long long left;

    const bool greedy = !(inv_t > 0.f);
    // Whether top-k, top-p or min-p may drop tokens: only then does the draw need the passes
    // below first; otherwise it keeps every token and is made in the first pass.
    const bool filtered = !greedy && ((top_k > 0 && top_k < (unsigned int)vocab) || top_p < 1.f ||
                                      min_p > 0.f);
    // The draw's candidate for token v: score + Gumbel noise (greedy: the score), kept as the
    // thread's best (the lowest index among equals).
    float best = -INFINITY;
    int best_v = 0x7fffffff;
    auto draw = [&](int v, float sc) {
        const float z = greedy ? sc : sc - logf(-logf(gumbel_uniform(seed, counter, (unsigned int)v)));
        if (z > best || (z == best && v < best_v)) {
            best = z;
            best_v = v;
        }
    };

    // 1. The raw logits' (max, sum exp) for the log-probability; the scores' max; unfiltered,
    // the draw itself (the same candidates in the same order as step 5's pass with every token
    // kept, so the same token: one pass over the logits instead of two).
    float m = -INFINITY, s = 0.f, smax = -INFINITY;
    each_logit(row, vocab, [&](int v, float l) {
        online_merge(m, s, l, 1.f);
        const float sc = score_of(l, v, pen_ids, n_pen, penalty, inv_t);
        smax = fmaxf(smax, sc);
        if (!filtered) draw(v, sc);
    });
    block_online(m, s, sm, ss);

    if (filtered) {
        {
            int unused = 0;
            block_argmax(smax, unused, sm, si);
        }
        // 2. Top-k: the k-th largest key.
        const unsigned int t_k =
            top_k > 0 && top_k < (unsigned int)vocab
                ? radix_select(row, vocab, pen_ids, n_pen, penalty, inv_t, 0u, false, smax,
                               top_k, hist, pick, &left)
                : 0u;
        // 3. Top-p over the tokens top-k kept: the lowest key whose higher keys' mass is below
        // top_p of the kept mass (at least one unit: the top key always stays).
        unsigned int t_p = 0;
        if (top_p < 1.f) {
            for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) hist[b] = 0;
            __syncthreads();
            for (int v = threadIdx.x; v < vocab; v += SAMPLE_THREADS) {
                const float sc = sample_score(row, v, pen_ids, n_pen, penalty, inv_t);
                if (sort_key(sc) >= t_k) atomicAdd(&hist[0], fixed_mass(sc - smax));
            }
            __syncthreads();
            const unsigned long long target =
                max((unsigned long long)((double)top_p * (double)hist[0]), 1ull);
            __syncthreads();
            t_p = radix_select(row, vocab, pen_ids, n_pen, penalty, inv_t, t_k, true, smax,
                               target, hist, pick, &left);
        }
        // 4. Min-p: scores at least max + ln(min_p).
        const unsigned int t_m = min_p > 0.f ? sort_key(smax + logf(min_p)) : 0u;
        const unsigned int threshold = max(t_k, max(t_p, t_m)); // keys >= threshold are kept

        // 5. The draw over the kept tokens: argmax of score + Gumbel noise.
        each_logit(row, vocab, [&](int v, float l) {
            const float sc = score_of(l, v, pen_ids, n_pen, penalty, inv_t);
            if (sort_key(sc) >= threshold) draw(v, sc);
        });
    }
    block_argmax(best, best_v, sm, si);
    if (threadIdx.x == 0) {
        const int tok = best_v == 0x7fffffff ? 0 : best_v;
        out[2 * r] = (uint32_t)tok;
        out[2 * r + 1] = __float_as_uint(to_f(row[tok]) - m - logf(s));
    }
}

// At most 64 registers a thread (SAMPLE_THREADS of them a block): the sixteen loads in flight
// took it to the bound, which a later compiler must not pass.
#define SAMPLE(L, NAME)                                                                           \
    extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)                                  \
        NAME(const L *logits, const uint32_t *params, const uint32_t *pen, uint32_t *out,         \
             int vocab, int rows) {                                                               \
        sample_tokens<L>(logits, params, pen, out, vocab, rows);                                  \
    }
SAMPLE(float, sample_tokens_f32)
SAMPLE(__nv_bfloat16, sample_tokens_bf16)
SAMPLE(__half, sample_tokens_f16)
