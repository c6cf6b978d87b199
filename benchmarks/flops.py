"""A true floor for one GRPO step: the step's FLOPs over the machine's measured float32 matmul rate.

Owns `step_flops` (the FLOPs one step of a GRPO configuration must do, by phase: prefill, decode, reference
forward, update forward + backward), `measure_matmul_rates` (the machine's float32 `torch.mm` rate at the
model's own matmul shapes, per phase, and at a large square shape) and `floor_seconds`.

What is counted (a dense Qwen2-style decoder; d hidden, f MLP width, V vocabulary, h heads of size d/h, k KV
heads): per token and layer the projections 2 (2 d^2 + 2 d k d/h + 3 d f) FLOPs and attention 4 d c, c being the
number of positions the token attends to (causal); the LM head 2 d V per position whose logits are needed.
The work any implementation of the step must do, so the least of it: each distinct prompt prefilled once
(its `n` samples share it), decoding B n rows for L_r - 1 steps (the first token comes from the prefill), the
reference forward over each prompt once plus every response (LM head on response positions only), the update
as forward + backward (3x the forward), no old-log-prob pass (the rollout's log-probs are the old policy's).
The padded count (every row carries its prompt, as HF `generate` and TRL do) is reported beside it.
Not counted: norms, rotary embeddings, softmax, sampling, the optimizer (AdamW: ~10 FLOPs per parameter) and
the weight sync: memory-bound work that the ratio to the floor shows as "the rest".

A benchmark helper (benchmarks/ is not a package); imports torch only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

LARGE_SQUARE = 2048


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config) -> ModelShape:
        """From a transformers config (Qwen2Config or a dict with the same keys)."""
        get = config.get if isinstance(config, dict) else lambda k: getattr(config, k)
        return cls(
            get("hidden_size"),
            get("num_hidden_layers"),
            get("num_attention_heads"),
            get("num_key_value_heads"),
            get("intermediate_size"),
            get("vocab_size"),
        )

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.hidden // self.heads

    def linear_shapes(self) -> list[tuple[int, int]]:
        """(in, out) of every projection of one layer."""
        d, f, kv = self.hidden, self.intermediate, self.kv_width
        return [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]

    def projection_flops_per_token(self) -> float:
        return 2.0 * self.layers * sum(i * o for i, o in self.linear_shapes())

    def lm_head_flops(self) -> float:
        return 2.0 * self.hidden * self.vocab

    def attention_flops(self, attended: float) -> float:
        """Scores and weighted sum of one token attending to `attended` positions, all layers."""
        return 4.0 * self.layers * self.hidden * attended


@dataclass(frozen=True)
class StepShape:
    """One step: `prompts` distinct prompts of mean length `prompt_len` (mean square `prompt_len_sq`),
    `n` samples each, responses of `response_len` tokens."""

    prompts: int
    n: int
    prompt_len: float
    prompt_len_sq: float
    response_len: float


def step_flops(model: ModelShape, step: StepShape, padded_prompt_len: float | None = None) -> dict[str, float]:
    """FLOPs of one GRPO step by phase (see the module doc). With `padded_prompt_len`, the padded count instead:
    every one of the B n rows carries a prompt of that length in prefill, reference and update."""
    B, n, Lr = step.prompts, step.n, step.response_len
    proj, head = model.projection_flops_per_token(), model.lm_head_flops()
    if padded_prompt_len is None:
        prompt_rows, Lp, Lp_sq = B, step.prompt_len, step.prompt_len_sq
    else:
        prompt_rows, Lp, Lp_sq = B * n, padded_prompt_len, padded_prompt_len**2
    # a prompt of length p: projections on p tokens, causal attention over sum_{i<=p} i = (p^2 + p) / 2 positions
    prompt_pass = prompt_rows * (Lp * proj + model.attention_flops((Lp_sq + Lp) / 2))
    # response token j (0-based) of a row attends to the prompt and j + 1 response positions
    mean_attended = Lp + (Lr + 1) / 2
    response_pass = B * n * Lr * (proj + head + model.attention_flops(mean_attended))
    decode_steps = max(Lr - 1, 0)
    decode = B * n * decode_steps * (proj + head + model.attention_flops(Lp + (decode_steps - 1) / 2 + 1))
    prefill = prompt_pass + prompt_rows * head  # logits of the last prompt position only
    return {
        "prefill": prefill,
        "decode": decode,
        "ref": prompt_pass + response_pass,
        "update": 3.0 * (prompt_pass + response_pass),
    }


def _mm_rate(m: int, k: int, n: int, min_seconds: float = 0.2, repeats: int = 3) -> float:
    """Best float32 `torch.mm` rate (FLOP/s) of an (m, k) @ (k, n) product over `repeats` timings."""
    a, b = torch.randn(m, k), torch.randn(k, n)
    out = torch.empty(m, n)
    torch.mm(a, b, out=out)  # warm-up
    best = 0.0
    for _ in range(repeats):
        calls, start = 0, time.perf_counter()
        while True:
            torch.mm(a, b, out=out)
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_seconds:
                break
        best = max(best, 2.0 * m * k * n * calls / elapsed)
    return best


def _rate_over(shapes: list[tuple[int, int, int]]) -> float:
    """The rate of doing every product in `shapes` once each: total FLOPs over total time at each one's rate."""
    flops = [2.0 * m * k * n for m, k, n in shapes]
    seconds = sum(f / _mm_rate(*shape) for f, shape in zip(flops, shapes))
    return sum(flops) / seconds


def measure_matmul_rates(model: ModelShape, step: StepShape, threads: int, micro_batch: int) -> dict[str, float]:
    """float32 matmul rates (FLOP/s) with `threads` torch threads: `decode` at the decode step's shapes (B n rows
    by each projection and the LM head), `train` at a micro-batch's shapes (forward products and the backward's
    transposed ones), `large_square` at LARGE_SQUARE^3."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        rows = step.prompts * step.n
        layer = model.linear_shapes() + [(model.hidden, model.vocab)]
        decode = [(rows, i, o) for i, o in layer]
        tokens = int(micro_batch * (step.prompt_len / step.n + step.response_len))  # a shared-prompt micro-batch
        train = (
            [(tokens, i, o) for i, o in layer] + [(tokens, o, i) for i, o in layer] + [(i, tokens, o) for i, o in layer]
        )
        return {
            "decode": _rate_over(decode),
            "train": _rate_over(train),
            "large_square": _mm_rate(LARGE_SQUARE, LARGE_SQUARE, LARGE_SQUARE),
        }
    finally:
        torch.set_num_threads(previous)


def floor_seconds(flops: dict[str, float], rates: dict[str, float]) -> dict[str, float]:
    """Seconds of each phase at the model-shape rates (prefill and the passes at the training rate, decode at the
    decode rate), their sum `floor`, and `floor_large_square`: all FLOPs at the large-square rate."""
    seconds = {
        "prefill": flops["prefill"] / rates["train"],
        "decode": flops["decode"] / rates["decode"],
        "ref": flops["ref"] / rates["train"],
        "update": flops["update"] / rates["train"],
    }
    seconds["floor"] = sum(seconds.values())
    seconds["floor_large_square"] = sum(flops.values()) / rates["large_square"]
    return seconds
