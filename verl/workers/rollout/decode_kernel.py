"""A fused CPU kernel for one decode step's attention against a `shared_prefix.SharedPrefixCache`.

Owns the kernel's C source, its build (`verl.utils.native_build`: gcc or cc at first use, cached per user and CPU),
`available`/`applies`, the kernel's cache layout (`tile_keys`, `write_tiled`, `prompt_bias`, `check_layout`) and
`shared_prefix_attention`, the call that `shared_prefix.attend` makes when the kernel applies.

Why: a decode step's attention reads every row's response keys and values once per layer, and at long responses that
read is most of the step's growth. torch runs it as two batched matmuls with two query rows per KV head (scores, then
probabilities times values) with a softmax and concatenations between them: on 2 cores of an AMD EPYC (Zen 4) the
response part took 2.6-3.8x the time of reading the keys and values once at the machine's read bandwidth (4 layers,
128 rows, 2 KV heads x 2 queries, 32-480 response tokens). Here one pass per (row, KV head) computes the scores of its
query heads against the row's prompt (the shared copy, which the rows of one prompt read in turn from cache) and its
own response keys, one softmax over both, and the weighted sum of the values: each key and value is read once. The
keys are stored in tiles of TILE positions (a tile's keys side by side per column), so a tile's scores are vertical
multiply-adds with no horizontal sums; values stay row by row.

The kernel runs float32 with head sizes that are a multiple of 32 on the calling thread's torch threads (OpenMP:
the shared object binds to the libgomp torch already loaded, so it uses torch's thread team; no second pool). It is
the same attention as the torch path up to float rounding (~1e-6: a different summation order and its own `exp`,
a degree-6 polynomial after range reduction, relative error ~2e-7). When no C compiler is found, the build fails or
`VERL_DECODE_KERNEL=0`, the torch path runs (one notice line when a build was tried and failed).

Layer 5: imports torch and verl.utils.native_build only; must not import Ray.
"""

from __future__ import annotations

import ctypes
import os
import threading

import torch

from verl.utils import native_build

ENV_SWITCH = "VERL_DECODE_KERNEL"  # 0: always the torch path; 1 (default): the kernel where it applies

TILE = 32  # keys per tile of the kernel's key layout: (..., tiles, head_dim, TILE), each tile's keys side by side
MASKED = -1e30  # the bias of a prompt position that is not attended

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

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
    const int64_t prompt_tiles = (prompt_len + TILE - 1) / TILE, response_tiles = (length + TILE - 1) / TILE;
    const int64_t padded_prompt = prompt_tiles * TILE, stride = padded_prompt + response_tiles * TILE;
    const int64_t chunks = (length + 7) / 8; /* response scores in chunks of 8; those past `length` get -1e30 */
    #pragma omp parallel num_threads(threads)
    {
        float *scores = (float *)malloc(sizeof(float) * per_kv * stride);
        #pragma omp for schedule(static)
        for (int64_t task = 0; task < rows * kv_heads; task++) {
            const int64_t row = task / kv_heads, head = task % kv_heads;
            const int64_t prompt_head = group[row] * kv_heads + head;
            const float *qt = q + task * per_kv * dim;
            const float *pb = bias + group[row] * padded_prompt;
            tile_dots(qt, pk + prompt_head * padded_prompt * dim, prompt_tiles, per_kv, dim, scores, stride);
            tile_dots(qt, rk + task * capacity * dim, response_tiles, per_kv, dim, scores + padded_prompt, stride);
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
            float *o = out + task * per_kv * dim;
            weighted_sum(scores, pv + prompt_head * prompt_len * dim, prompt_len, per_kv, dim, o, stride, 0);
            weighted_sum(scores + padded_prompt, rv + task * capacity * dim, length, per_kv, dim, o, stride, 1);
        }
        free(scores);
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
