"""Fused CPU kernels of one decode step: attention against a `shared_prefix.SharedPrefixCache`, the glue around it
(rotary + cache write, residual add + RMSNorm) and sampling (inverse-CDF with the token's log-probability).

Owns the C source and its build (`native_build`, cached per user and CPU), `available`/`applies`, the tiled key
layout (`tile_keys`, `write_tiled`, `prompt_bias`, `check_layout`), `shared_prefix_attention`,
`shared_prefix_decode`, `add_rms_norm` and `sample_tokens`. float32, head sizes a multiple of 32, on torch's OpenMP
team; equal to the torch path up to rounding (~1e-6). Without a compiler, on a failed build or with
`VERL_DECODE_KERNEL=0` the torch path runs. benchmarks/README.md has the figures.
Layer 2: torch and verl.cpu.native_build only.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from verl.cpu import native_build

ENV_SWITCH = "VERL_DECODE_KERNEL"  # 0: always the torch path; 1 (default): the kernel where it applies

TILE = 32  # keys per tile of the kernel's key layout: (..., tiles, head_dim, TILE), each tile's keys side by side
MASKED = -1e30  # the bias of a prompt position that is not attended

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#include <math.h>

#define TILE 32
typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 load8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
static inline void store8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* exp(x) for x <= 0, 8 at a time: x = n ln2 + f, |f| <= ln2 / 2 (Cody-Waite), exp(f) by its Taylor polynomial of
   degree 6 (relative error < 2e-8 there), times 2^n built in the exponent bits; exactly 0 below -87.3. */
static inline v8 exp8(v8 x) {
    const i8 live = x >= -87.3f; /* -1 (all bits) where x >= -87.3, else 0 */
    i8 xb, lo;
    const v8 floor_ = (v8){0} - 87.3f;
    memcpy(&xb, &x, sizeof xb);
    memcpy(&lo, &floor_, sizeof lo);
    xb = (xb & live) | (lo & ~live);
    memcpy(&x, &xb, sizeof x);
    const v8 n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f; /* round to nearest: 1.5 * 2^23 */
    v8 f = x - n * 0.693145751953125f;
    f = f - n * 1.428606765330187e-06f;
    v8 p = f * 1.3888889e-03f + 8.3333333e-03f;
    p = p * f + 4.1666667e-02f;
    p = p * f + 1.6666667e-01f;
    p = p * f + 0.5f;
    p = p * f + 1.0f;
    p = p * f + 1.0f;
    const i8 bits = (__builtin_convertvector(n, i8) + 127) << 23;
    v8 scale;
    memcpy(&scale, &bits, sizeof scale);
    i8 out;
    v8 e = p * scale;
    memcpy(&out, &e, sizeof out);
    out &= live;
    memcpy(&e, &out, sizeof e);
    return e;
}

static inline v8 max8(v8 a, v8 b) {
    const i8 take_a = a > b;
    i8 ab, bb;
    memcpy(&ab, &a, sizeof ab);
    memcpy(&bb, &b, sizeof bb);
    ab = (ab & take_a) | (bb & ~take_a);
    memcpy(&a, &ab, sizeof a);
    return a;
}

static inline float hmax8(v8 a) {
    float m = a[0];
    for (int k = 1; k < 8; k++) m = a[k] > m ? a[k] : m;
    return m;
}

static inline float hsum8(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

/* scores[i * stride + j] = q_i . key_j for the keys of `tiles` tiles (each (dim, TILE): a tile's keys side by side)
   and the per_kv queries q (per_kv, dim): TILE scores per tile, two queries at a time, in registers. */
static void tile_dots(const float *q, const float *keys, int64_t tiles, int64_t per_kv, int64_t dim, float *scores,
                      int64_t stride) {
    for (int64_t t = 0; t < tiles; t++) {
        const float *tile = keys + t * dim * TILE;
        for (int64_t i = 0; i < per_kv; i += 2) {
            const int two = i + 1 < per_kv;
            const float *q0 = q + i * dim, *q1 = two ? q0 + dim : q0;
            v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, b0 = {0}, b1 = {0}, b2 = {0}, b3 = {0};
            for (int64_t d = 0; d < dim; d++) {
                const float *k = tile + d * TILE;
                const v8 k0 = load8(k), k1 = load8(k + 8), k2 = load8(k + 16), k3 = load8(k + 24);
                const float x = q0[d], y = q1[d];
                a0 += x * k0; a1 += x * k1; a2 += x * k2; a3 += x * k3;
                b0 += y * k0; b1 += y * k1; b2 += y * k2; b3 += y * k3;
            }
            float *s = scores + i * stride + t * TILE;
            store8(s, a0); store8(s + 8, a1); store8(s + 16, a2); store8(s + 24, a3);
            if (two) { s += stride; store8(s, b0); store8(s + 8, b1); store8(s + 16, b2); store8(s + 24, b3); }
        }
    }
}

/* columns c .. c + 8 * blocks of out_i (+)= sum_j w_i[j] value_j, for queries w0/o0 and w1/o1 (two: both) */
static inline void weighted_block(const float *w0, const float *w1, const float *values, int64_t count, int64_t dim,
                                  int64_t c, float *o0, float *o1, int two, int accumulate, const int blocks) {
    v8 a[8], b[8];
    for (int k = 0; k < blocks; k++) {
        a[k] = accumulate ? load8(o0 + c + 8 * k) : (v8){0};
        b[k] = accumulate ? load8(o1 + c + 8 * k) : (v8){0};
    }
    for (int64_t j = 0; j < count; j++) {
        const float *v = values + j * dim + c;
        const float x = w0[j], y = w1[j];
        for (int k = 0; k < blocks; k++) {
            const v8 vk = load8(v + 8 * k);
            a[k] += x * vk;
            b[k] += y * vk;
        }
    }
    for (int k = 0; k < blocks; k++) {
        store8(o0 + c + 8 * k, a[k]);
        if (two) store8(o1 + c + 8 * k, b[k]);
    }
}

/* out_i (+)= sum_j w[i * stride + j] value_j over the `count` values (count, dim) for the per_kv queries: two
   queries and 64 columns at a time in registers (32 for the last ones when dim is an odd multiple of 32) */
static void weighted_sum(const float *w, const float *values, int64_t count, int64_t per_kv, int64_t dim, float *out,
                         int64_t stride, int accumulate) {
    for (int64_t i = 0; i < per_kv; i += 2) {
        const int two = i + 1 < per_kv;
        const float *w0 = w + i * stride, *w1 = two ? w0 + stride : w0;
        float *o0 = out + i * dim, *o1 = two ? o0 + dim : o0;
        int64_t c = 0;
        for (; c + 64 <= dim; c += 64) weighted_block(w0, w1, values, count, dim, c, o0, o1, two, accumulate, 8);
        if (c < dim) weighted_block(w0, w1, values, count, dim, c, o0, o1, two, accumulate, 4);
    }
}

/* The attention of one (row, KV head) task: o (per_kv, dim) = softmax([q.Kp^T + pb, q.Kr^T]) [Vp; Vr] over the row's
   prompt (keys pk in tiles, values pv (prompt_len, dim), bias pb) and its first `length` response positions (keys rk
   in tiles, values rv (length, dim)). q (per_kv, dim), already scaled; scores: scratch of per_kv * stride floats. */
static void attend_task(const float *qt, const float *pk, const float *pv, const float *pb, const float *rk,
                        const float *rv, float *o, float *scores, int64_t per_kv, int64_t dim, int64_t prompt_len,
                        int64_t length) {
    const int64_t prompt_tiles = (prompt_len + TILE - 1) / TILE, response_tiles = (length + TILE - 1) / TILE;
    const int64_t padded_prompt = prompt_tiles * TILE, stride = padded_prompt + response_tiles * TILE;
    const int64_t chunks = (length + 7) / 8; /* response scores in chunks of 8; those past `length` get -1e30 */
    tile_dots(qt, pk, prompt_tiles, per_kv, dim, scores, stride);
    tile_dots(qt, rk, response_tiles, per_kv, dim, scores + padded_prompt, stride);
    for (int64_t i = 0; i < per_kv; i++) {
        float *s = scores + i * stride, *r = s + padded_prompt;
        for (int64_t j = length; j < chunks * 8; j++) r[j] = -1e30f;
        v8 top = load8(r);
        for (int64_t j = 0; j < padded_prompt; j += 8) {
            const v8 x = load8(s + j) + load8(pb + j);
            store8(s + j, x);
            top = max8(top, x);
        }
        for (int64_t j = 0; j < chunks * 8; j += 8) top = max8(top, load8(r + j));
        const float m = hmax8(top);
        v8 total = {0};
        for (int64_t j = 0; j < padded_prompt; j += 8) {
            const v8 e = exp8(load8(s + j) - m);
            store8(s + j, e);
            total += e;
        }
        for (int64_t j = 0; j < chunks * 8; j += 8) {
            const v8 e = exp8(load8(r + j) - m);
            store8(r + j, e);
            total += e;
        }
        const float inv = 1.0f / hsum8(total);
        for (int64_t j = 0; j < padded_prompt + chunks * 8; j += 8) store8(s + j, load8(s + j) * inv);
    }
    weighted_sum(scores, pv, prompt_len, per_kv, dim, o, stride, 0);
    weighted_sum(scores + padded_prompt, rv, length, per_kv, dim, o, stride, 1);
}

/* This thread's scratch of at least `floats` floats, kept for the thread's life and grown when a call needs more: no
   malloc per call (with one glibc arena, MALLOC_ARENA_MAX=1 as CPU workers run, the threads' mallocs would wait on
   each other's lock). NULL when memory runs out. */
static float *thread_scratch(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        float *grown = (float *)realloc(buffer, sizeof(float) * floats);
        if (!grown) return NULL;
        buffer = grown;
        capacity = floats;
    }
    return buffer;
}

/* Floats of one thread's scratch: the scores of per_kv queries over the prompt and `length` response positions, then
   room for the rotated queries and key of a decode step. */
static int64_t scratch_floats(int64_t per_kv, int64_t dim, int64_t prompt_len, int64_t length) {
    const int64_t stride = ((prompt_len + TILE - 1) / TILE + (length + TILE - 1) / TILE) * TILE;
    return per_kv * stride + (per_kv + 1) * dim;
}

/* out (rows, kv_heads, per_kv, dim) = softmax([q.Kp^T + bias, q.Kr^T]) [Vp; Vr] for each row and KV head.
   q: (rows, kv_heads, per_kv, dim), already scaled. The row's prompt is group[row]: its keys pk (prompts, kv_heads,
   prompt_tiles, dim, TILE), values pv (prompts, kv_heads, prompt_len, dim), bias (prompts, prompt_tiles * TILE), 0
   where the prompt has a token, -1e30 on its padding and past prompt_len. The row's response: its first `length`
   positions of rk (rows, kv_heads, capacity / TILE, dim, TILE) and rv (rows, kv_heads, capacity, dim). All
   contiguous float32; dim a multiple of 32. */
void shared_prefix_attention(const float *q, const float *pk, const float *pv, const float *bias,
                             const int64_t *group, const float *rk, const float *rv, float *out, int64_t rows,
                             int64_t kv_heads, int64_t per_kv, int64_t dim, int64_t prompt_len, int64_t capacity,
                             int64_t length, int threads) {
    const int64_t padded_prompt = (prompt_len + TILE - 1) / TILE * TILE;
    #pragma omp parallel num_threads(threads)
    {
        float *scores = thread_scratch(scratch_floats(per_kv, dim, prompt_len, length));
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            const int64_t row = task / kv_heads, head = task % kv_heads;
            const int64_t prompt_head = group[row] * kv_heads + head;
            attend_task(q + task * per_kv * dim, pk + prompt_head * padded_prompt * dim,
                        pv + prompt_head * prompt_len * dim, bias + group[row] * padded_prompt,
                        rk + task * capacity * dim, rv + task * capacity * dim, out + task * per_kv * dim, scores,
                        per_kv, dim, prompt_len, length);
        }
    }
}

/* HF's rotary embedding (half rotation) of one head x (dim) at one position's cos/sin (dim), times `scale` */
static inline void rotate_head(const float *x, const float *c, const float *s, float scale, int64_t dim, float *out) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < half; d++) out[d] = (x[d] * c[d] - x[d + half] * s[d]) * scale;
    for (int64_t d = half; d < dim; d++) out[d] = (x[d] * c[d] + x[d - half] * s[d]) * scale;
}

/* One whole decode step's attention from the projections: for each row and KV head, the rotary embedding of its
   per_kv query heads (times `scale`) and of its key at the row's position (positions[row], a row of the cos/sin
   tables (table_len, dim)), the key and value written at response position `length` of rk/rv, then the attention
   of shared_prefix_attention over length + 1 positions. q: (rows, kv_heads * per_kv, dim), k and v: (rows,
   kv_heads, dim), out (rows, kv_heads * per_kv, dim), all contiguous float32. Returns the number of rows whose
   position is outside the tables (nothing is written or computed then). */
int shared_prefix_decode(const float *q, const float *k, const float *v, const float *cos_t, const float *sin_t,
                         const int64_t *positions, int64_t table_len, float scale, const float *pk, const float *pv,
                         const float *bias, const int64_t *group, float *rk, float *rv, float *out, int64_t rows,
                         int64_t kv_heads, int64_t per_kv, int64_t dim, int64_t prompt_len, int64_t capacity,
                         int64_t length, int threads) {
    int outside = 0;
    for (int64_t row = 0; row < rows; row++) outside += positions[row] < 0 || positions[row] >= table_len;
    if (outside || length >= capacity) return outside + (length >= capacity);
    const int64_t padded_prompt = (prompt_len + TILE - 1) / TILE * TILE;
    #pragma omp parallel num_threads(threads)
    {
        float *scores = thread_scratch(scratch_floats(per_kv, dim, prompt_len, length + 1));
        float *qt = scores + scratch_floats(per_kv, dim, prompt_len, length + 1) - (per_kv + 1) * dim;
        float *kt = qt + per_kv * dim;
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            const int64_t row = task / kv_heads, head = task % kv_heads;
            const int64_t prompt_head = group[row] * kv_heads + head;
            const float *c = cos_t + positions[row] * dim, *s = sin_t + positions[row] * dim;
            for (int64_t i = 0; i < per_kv; i++) rotate_head(q + (task * per_kv + i) * dim, c, s, scale, dim, qt + i * dim);
            rotate_head(k + task * dim, c, s, 1.0f, dim, kt);
            float *tile = rk + task * capacity * dim + (length / TILE) * dim * TILE + length % TILE;
            for (int64_t d = 0; d < dim; d++) tile[d * TILE] = kt[d];
            memcpy(rv + (task * capacity + length) * dim, v + task * dim, sizeof(float) * dim);
            attend_task(qt, pk + prompt_head * padded_prompt * dim, pv + prompt_head * prompt_len * dim,
                        bias + group[row] * padded_prompt, rk + task * capacity * dim, rv + task * capacity * dim,
                        out + task * per_kv * dim, scores, per_kv, dim, prompt_len, length + 1);
        }
    }
    return 0;
}

/* The next token of each row of logits (rows, vocab) and its log-probability log_softmax(logits / temperature):
   with draws (rows,) uniforms in [0, 1), inverse-CDF sampling from softmax(logits / temperature) (the first token
   whose running sum of probabilities exceeds draw * their total, the sums in double), else the first largest logit.
   log_probs may be NULL. Rows split over `threads` when there are enough of them. */
void sample_tokens(const float *logits, float temperature, const float *draws, int64_t *tokens, float *log_probs,
                   int64_t rows, int64_t vocab, int threads) {
    #pragma omp parallel num_threads(threads) if (rows * vocab >= 65536)
    {
        float *e = thread_scratch(vocab + 8);
        #pragma omp for schedule(static)
        for (int64_t row = 0; row < rows; row++) {
            const float *x = logits + row * vocab;
            int64_t best = 0;
            float m = x[0] / temperature;
            for (int64_t j = 0; j < vocab; j++) {
                e[j] = x[j] / temperature;
                if (e[j] > m) { m = e[j]; best = j; }
            }
            double total = 0.0;
            int64_t j = 0;
            for (; j + 8 <= vocab; j += 8) {
                const v8 v = exp8(load8(e + j) - m);
                store8(e + j, v);
                for (int k = 0; k < 8; k++) total += v[k];
            }
            for (; j < vocab; j++) {
                v8 v = {0};
                v[0] = e[j] - m;
                e[j] = exp8(v)[0];
                total += e[j];
            }
            int64_t token = best;
            if (draws) {
                const double threshold = (double)draws[row] * total;
                double running = 0.0;
                token = vocab - 1;
                for (j = 0; j < vocab; j++) {
                    running += e[j];
                    if (running > threshold) { token = j; break; }
                }
            }
            tokens[row] = token;
            if (log_probs) log_probs[row] = x[token] / temperature - m - (float)log(total);
        }
    }
}

/* HF's RMSNorm of each row of x (rows, n), after x += delta when delta is given (in place): h = weight * (x *
   rsqrt(mean(x^2) + eps)). Rows split over `threads` when the tensor is large enough to be worth it. */
void add_rms_norm(float *x, const float *delta, const float *weight, float eps, float *h, int64_t rows, int64_t n,
                  int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (rows * n >= 16384)
    for (int64_t row = 0; row < rows; row++) {
        float *xr = x + row * n, *hr = h + row * n;
        v8 acc = {0};
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            v8 xv = load8(xr + j);
            if (delta) { xv += load8(delta + row * n + j); store8(xr + j, xv); }
            acc += xv * xv;
        }
        float total = hsum8(acc);
        for (; j < n; j++) {
            if (delta) xr[j] += delta[row * n + j];
            total += xr[j] * xr[j];
        }
        const float r = 1.0f / sqrtf(total / (float)n + eps);
        for (j = 0; j < n; j++) hr[j] = weight[j] * (xr[j] * r);
    }
}
"""

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _build() -> ctypes.CDLL | None:
    library = native_build.build_library("decode_attention", _SOURCE)
    if library is not None:
        fn = library.shared_prefix_attention
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 7 + [ctypes.c_int]
        fn = library.shared_prefix_decode
        fn.restype = ctypes.c_int
        fn.argtypes = ([ctypes.c_void_p] * 6 + [ctypes.c_int64, ctypes.c_float] + [ctypes.c_void_p] * 7
                       + [ctypes.c_int64] * 7 + [ctypes.c_int])  # fmt: skip
        fn = library.sample_tokens
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_int]
        fn = library.add_rms_norm
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                               ctypes.c_int]  # fmt: skip
    return library


def available() -> bool:
    """Whether the kernel is switched on (`VERL_DECODE_KERNEL`, default 1) and built: the first call builds it."""
    global _library, _tried
    switch = os.environ.get(ENV_SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{ENV_SWITCH}={switch!r}: allowed are 0 (torch's ops) and 1 (the fused kernel)")
    if switch == "0":
        return False
    with _lock:
        if not _tried:
            _tried = True
            _library = _build()
    return _library is not None


def applies(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the kernel can decode a cache of this head size, dtype and device: float32 on the CPU, a head size
    that is a multiple of 32, and the kernel switched on and built."""
    return device.type == "cpu" and dtype == torch.float32 and head_dim % 32 == 0 and available()


def tiled_capacity(positions: int) -> int:
    """`positions` rounded up to whole tiles of the kernel's key layout."""
    return -(-positions // TILE) * TILE


def tile_keys(keys: torch.Tensor) -> torch.Tensor:
    """keys (..., positions, head_dim) in the kernel's layout: (..., tiles, head_dim, TILE), zeros past the end."""
    *lead, positions, dim = keys.shape
    padded = keys.new_zeros(*lead, tiled_capacity(positions), dim)
    padded[..., :positions, :] = keys
    return padded.view(*lead, -1, TILE, dim).transpose(-1, -2).contiguous()


def prompt_bias(prompt_mask: torch.Tensor) -> torch.Tensor:
    """The kernel's form of the prompts' attention mask (prompts, P), 1 on tokens: a float32 bias (prompts, P rounded
    up to whole tiles), 0 on tokens and MASKED (-1e30, whose exp is exactly 0 in the kernel) elsewhere."""
    bias = torch.full((len(prompt_mask), tiled_capacity(prompt_mask.shape[1])), MASKED, dtype=torch.float32)
    bias[:, : prompt_mask.shape[1]].masked_fill_(prompt_mask.bool().cpu(), 0.0)
    return bias


def write_tiled(buffer: torch.Tensor, position: int, keys: torch.Tensor) -> None:
    """Write keys (rows, kv_heads, 1, head_dim) of one step at `position` of a tiled buffer (rows, kv_heads, tiles,
    head_dim, TILE)."""
    buffer[:, :, position // TILE, :, position % TILE] = keys[:, :, 0]


def check_layout(
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    bias: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
) -> None:
    """Raise unless the cache's tensors are what `shared_prefix_attention` reads (see its docstring): a wrong shape,
    dtype or layout would make the kernel read outside them. Called once per layout, not per step."""
    tensors = {"prefix_keys": prefix_keys, "prefix_values": prefix_values, "bias": bias, "key_buffer": key_buffer,
               "value_buffer": value_buffer}  # fmt: skip
    for name, t in tensors.items():
        if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"decode kernel: {name} must be contiguous float32 on the CPU, got {t.dtype} on "
                             f"{t.device} (contiguous: {t.is_contiguous()})")  # fmt: skip
    prompts, kv_heads, prompt_len, dim = prefix_values.shape
    rows, capacity = value_buffer.shape[0], value_buffer.shape[2]
    expected = {
        "prefix_keys": (prompts, kv_heads, tiled_capacity(prompt_len) // TILE, dim, TILE),
        "bias": (prompts, tiled_capacity(prompt_len)),
        "key_buffer": (rows, kv_heads, capacity // TILE, dim, TILE),
        "value_buffer": (rows, kv_heads, capacity, dim),
    }
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"decode kernel: {name} must have shape {shape}, got {tuple(tensors[name].shape)}")
    if dim % 32 or capacity % TILE:
        raise ValueError(f"decode kernel: head size {dim} must be a multiple of 32, capacity {capacity} of {TILE}")


def shared_prefix_attention(
    query: torch.Tensor,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    bias: torch.Tensor,
    groups: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """One decode step's attention: query (rows, kv_heads, per_kv, dim), scaled, against each row's prompt and its
    first `length` response positions, one softmax over both. Returns (rows, kv_heads, per_kv, dim).

    prefix_keys: (prompts, kv_heads, prompt_tiles, dim, TILE) (`tile_keys`); prefix_values: (prompts, kv_heads, P,
    dim); bias: (prompts, prompt_tiles * TILE) (`prompt_bias`); groups: (rows,) int64, each row's prompt, within
    0..prompts-1; key_buffer: (rows, kv_heads, capacity / TILE, dim, TILE); value_buffer: (rows, kv_heads, capacity,
    dim). The cache tensors must have passed `check_layout`; the query and the groups are checked here."""
    rows, kv_heads, per_kv, dim = query.shape
    capacity = value_buffer.shape[2]
    if query.dtype != torch.float32 or query.device.type != "cpu" or value_buffer.shape[:2] != (rows, kv_heads):
        raise ValueError(f"decode kernel: query must be float32 (rows, kv_heads, per_kv, dim) on the CPU matching "
                         f"the buffers {tuple(value_buffer.shape)}, got {query.dtype} {tuple(query.shape)}")  # fmt: skip
    if groups.dtype != torch.int64 or groups.shape != (rows,) or not 0 < length <= capacity:
        raise ValueError(f"decode kernel: groups must be int64 ({rows},) and 0 < length <= {capacity}, got "
                         f"{groups.dtype} {tuple(groups.shape)}, length {length}")  # fmt: skip
    query = query.contiguous()
    out = torch.empty_like(query)
    _library.shared_prefix_attention(
        query.data_ptr(), prefix_keys.data_ptr(), prefix_values.data_ptr(), bias.data_ptr(),
        groups.data_ptr(), key_buffer.data_ptr(), value_buffer.data_ptr(), out.data_ptr(),
        rows, kv_heads, per_kv, dim, prefix_values.shape[2], capacity, length, torch.get_num_threads(),
    )  # fmt: skip
    return out


def _float32_cpu(name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise unless `t` is a contiguous float32 CPU tensor of `shape` (what the kernels read and write), or the
    kernel is not built (`available` builds it)."""
    if _library is None:
        raise RuntimeError("decode kernel: not built; call decode_kernel.available() first (it builds the kernel)")
    if t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or tuple(t.shape) != shape:
        raise ValueError(f"decode kernel: {name} must be contiguous float32 {shape} on the CPU, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device} (contiguous: {t.is_contiguous()})")  # fmt: skip


def shared_prefix_decode(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    scale: float,
    prefix_keys: torch.Tensor,
    prefix_values: torch.Tensor,
    bias: torch.Tensor,
    groups: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    length: int,
) -> torch.Tensor:
    """A whole decode step's attention from the step's projections: query (rows, heads * dim), key and value (rows,
    kv_heads * dim) as the q/k/v projections give them. For each row the rotary embedding (HF's half rotation) at its
    position (`positions` (rows,) int64, rows of the `cos`/`sin` tables (positions, dim)) is applied to its query
    heads (then times `scale`) and its keys, the keys and values are written at response position `length` of
    `key_buffer`/`value_buffer` (the next free one), and the attention of `shared_prefix_attention` runs over
    `length + 1` positions. Returns (rows, heads * dim), the heads in HF's order: what the output projection takes.
    The other arguments are `shared_prefix_attention`'s (they must have passed `check_layout`)."""
    rows, kv_heads, capacity, dim = value_buffer.shape
    heads = query.shape[-1] // dim
    _float32_cpu("query", query, (rows, heads * dim))
    _float32_cpu("key", key, (rows, kv_heads * dim))
    _float32_cpu("value", value, (rows, kv_heads * dim))
    _float32_cpu("cos", cos, (len(cos), dim))
    _float32_cpu("sin", sin, (len(cos), dim))
    if heads % kv_heads or positions.dtype != torch.int64 or positions.shape != (rows,) or groups.shape != (rows,):
        raise ValueError(f"decode kernel: {heads} query heads for {kv_heads} KV heads, positions and groups int64 "
                         f"({rows},); got positions {positions.dtype} {tuple(positions.shape)}, groups "
                         f"{tuple(groups.shape)}")  # fmt: skip
    positions = positions.contiguous()
    out = torch.empty_like(query)
    outside = _library.shared_prefix_decode(
        query.data_ptr(), key.data_ptr(), value.data_ptr(), cos.data_ptr(), sin.data_ptr(), positions.data_ptr(),
        len(cos), scale, prefix_keys.data_ptr(), prefix_values.data_ptr(), bias.data_ptr(), groups.data_ptr(),
        key_buffer.data_ptr(), value_buffer.data_ptr(), out.data_ptr(),
        rows, kv_heads, heads // kv_heads, dim, prefix_values.shape[2], capacity, length, torch.get_num_threads(),
    )  # fmt: skip
    if outside:
        raise ValueError(f"decode kernel: response position {length} of a cache of {capacity}, or positions "
                         f"{positions.min().item()}..{positions.max().item()} outside the rotary tables of "
                         f"{len(cos)}: nothing written")  # fmt: skip
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm (Qwen2/Qwen3/Llama, float32) of x (rows, n) after `x += delta` (in place; none when delta is
    None): returns weight * (x * rsqrt(mean(x^2) + eps)), a new tensor. x, delta and weight contiguous float32."""
    rows, n = x.shape
    _float32_cpu("x", x, (rows, n))
    _float32_cpu("weight", weight, (n,))
    if delta is not None:
        _float32_cpu("delta", delta, (rows, n))
    out = torch.empty_like(x)
    _library.add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(), eps,
                          out.data_ptr(), rows, n, torch.get_num_threads())  # fmt: skip
    return out


def sample_tokens(
    logits: torch.Tensor, temperature: float, draws: torch.Tensor | None, log_probs: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The next token of each row of logits (rows, vocab), contiguous float32 on the CPU, and (`log_probs`) its
    log_softmax(logits / temperature): inverse-CDF sampling from softmax(logits / temperature) with one uniform per
    row (`draws` (rows,)), or the first largest logit when `draws` is None. What `hf_rollout`'s torch ops compute
    (softmax, cumsum, searchsorted, log_softmax, gather) in one pass per row; a draw within float rounding of a
    boundary between two tokens' cumulative probabilities can pick the neighbour."""
    rows, vocab = logits.shape
    logits = logits.contiguous()
    _float32_cpu("logits", logits, (rows, vocab))
    if not temperature > 0:
        raise ValueError(f"decode kernel: temperature must be > 0, got {temperature}")
    if draws is not None:
        draws = draws.to(torch.float32).contiguous()
        if draws.shape != (rows,):
            raise ValueError(f"decode kernel: draws must be ({rows},), got {tuple(draws.shape)}")
    tokens = torch.empty(rows, dtype=torch.int64)
    out = torch.empty(rows, dtype=torch.float32) if log_probs else None
    _library.sample_tokens(logits.data_ptr(), temperature, None if draws is None else draws.data_ptr(),
                           tokens.data_ptr(), None if out is None else out.data_ptr(), rows, vocab,
                           torch.get_num_threads())  # fmt: skip
    return tokens, out
