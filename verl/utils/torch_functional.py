"""Tensor helpers shared by the actor, critic, rollout and algorithm code.

Owns: log-probabilities, entropy and sum of squared probabilities from logits, masked statistics (sum, mean, var,
whiten), response masks from EOS tokens, position ids from attention masks, prompt tokenisation with left padding,
padding helpers, and the grouping of rows that share a prompt (`prompt_groups`, `group_first_rows`).
Layer 1 (see docs/architecture.md#layers): imports only torch; must not import Ray, models or any other layer of the package.
Numerical conventions follow verl 0.9.1.
"""

import contextlib
import inspect
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F

# Number of logits processed at once by `logprobs_from_logits` (rows * vocab). 2**24 float32 values are 64 MiB, so
# the temporary softmax/logsumexp work never costs more than that, whatever the batch and vocabulary size.
LOGPROB_CHUNK_ELEMENTS = 2**24

TRUNCATION_MODES = ("error", "left", "right", "middle")


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, LOGPROB_CHUNK_ELEMENTS // max(1, vocab_size))


class _LogprobsFromLogits(torch.autograd.Function):
    """log_softmax(logits)[label] computed row-chunk by row-chunk; saves only the logsumexp per row for backward.

    d logp / d logits = onehot(label) - softmax(logits); the softmax is recomputed per chunk in backward.
    """

    @staticmethod
    def forward(ctx, logits_2d: torch.Tensor, labels_1d: torch.Tensor) -> torch.Tensor:
        num_rows, vocab_size = logits_2d.shape
        step = _rows_per_chunk(vocab_size)
        compute_dtype = torch.promote_types(logits_2d.dtype, torch.float32)
        logsumexp = torch.empty(num_rows, dtype=compute_dtype, device=logits_2d.device)
        label_logits = logits_2d.gather(-1, labels_1d.unsqueeze(-1)).squeeze(-1).to(compute_dtype)
        for start in range(0, num_rows, step):
            chunk = logits_2d[start : start + step].to(compute_dtype)
            logsumexp[start : start + step] = torch.logsumexp(chunk, dim=-1)
        ctx.save_for_backward(logits_2d, labels_1d, logsumexp)
        return label_logits - logsumexp

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        logits_2d, labels_1d, logsumexp = ctx.saved_tensors
        num_rows, vocab_size = logits_2d.shape
        step = _rows_per_chunk(vocab_size)
        grad_logits = torch.empty_like(logits_2d)
        grad_output = grad_output.to(logsumexp.dtype)
        for start in range(0, num_rows, step):
            end = start + step
            probs = torch.exp(logits_2d[start:end].to(logsumexp.dtype) - logsumexp[start:end].unsqueeze(-1))
            grad_chunk = -probs * grad_output[start:end].unsqueeze(-1)
            grad_chunk.scatter_add_(-1, labels_1d[start:end].unsqueeze(-1), grad_output[start:end].unsqueeze(-1))
            grad_logits[start:end] = grad_chunk.to(grad_logits.dtype)
        return grad_logits, None


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probability of each label under softmax(logits), without a full log_softmax copy of the logits.

    Args:
        logits: (..., vocab_size), any float dtype; computed in float32 (float64 stays float64) chunk by chunk.
        labels: (...) int64 token ids.

    Returns:
        (...) float32 (or float64) log-probabilities; differentiable with respect to `logits` (gradient in logits' dtype).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} must agree except the vocab dim"
        )
    vocab_size = logits.shape[-1]
    logits_2d = logits.reshape(-1, vocab_size)
    labels_1d = labels.reshape(-1).long()
    logprobs = _LogprobsFromLogits.apply(logits_2d, labels_1d)
    return logprobs.reshape(labels.shape)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Categorical entropy of softmax(logits): logsumexp(logits) - sum(softmax(logits) * logits).

    Args:
        logits: (..., vocab_size).

    Returns:
        (...) entropy per position, differentiable.
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.sum(probs * logits, dim=-1)


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """sum_v softmax(logits)_v^2 = exp(logsumexp(2 * logits) - 2 * logsumexp(logits)), per position, no gradient.

    Computed in float32 (float64 stays float64) row-chunk by row-chunk, so no temporary larger than
    `LOGPROB_CHUNK_ELEMENTS` values is made whatever the vocabulary size. The optimal-token-baseline estimators
    use it for the squared score norm 1 - 2 pi(y_t) + sum pi^2.

    Args:
        logits: (..., vocab_size).

    Returns:
        (...) float32 (or float64) values in [1/vocab_size, 1].
    """
    vocab_size = logits.shape[-1]
    logits_2d = logits.detach().reshape(-1, vocab_size)
    compute_dtype = torch.promote_types(logits_2d.dtype, torch.float32)
    out = torch.empty(logits_2d.shape[0], dtype=compute_dtype, device=logits_2d.device)
    step = _rows_per_chunk(vocab_size)
    for start in range(0, logits_2d.shape[0], step):
        chunk = logits_2d[start : start + step].to(compute_dtype)
        log_sum_squares = torch.logsumexp(2.0 * chunk, dim=-1) - 2.0 * torch.logsumexp(chunk, dim=-1)
        out[start : start + step] = torch.exp(log_sum_squares)
    return out.reshape(logits.shape[:-1])


def masked_sum(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """Sum of values * mask; values outside the mask count as 0 even when they are NaN or inf.

    Args:
        values, mask: same shape (e.g. (bs, response_length)).
        axis: dimension to reduce, or None for all.
    """
    valid_values = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    masked = valid_values * mask
    return masked.sum() if axis is None else masked.sum(dim=axis)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, axis: int | None = None) -> torch.Tensor:
    """masked_sum(values, mask) / (sum(mask) + 1e-8) over `axis` (all dims when None)."""
    mask_count = mask.sum() if axis is None else mask.sum(dim=axis)
    return masked_sum(values, mask, axis) / (mask_count + 1e-8)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of the masked values (scalar); with `unbiased` the Bessel factor n / (n - 1), n = sum(mask).

    Raises:
        ValueError: when `unbiased` and the mask selects 0 or 1 element.
    """
    mean = masked_mean(values, mask)
    variance = masked_mean((values - mean) ** 2, mask)
    if unbiased:
        mask_count = mask.sum()
        if mask_count == 0:
            raise ValueError("masked_var: the mask selects no element; at least 2 are needed for an unbiased variance")
        if mask_count == 1:
            raise ValueError("masked_var: the mask selects 1 element; at least 2 are needed for an unbiased variance")
        variance = variance * (mask_count / (mask_count - 1))
    return variance


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """(values - mean) * rsqrt(var + 1e-8) with masked mean and unbiased masked variance.

    With `shift_mean=False` the mean is added back (only the scale is normalised). Output has values' shape;
    positions outside the mask are transformed too (callers multiply by the mask when needed).
    """
    mean = masked_mean(values, mask)
    var = masked_var(values, mask)
    whitened = (values - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened


def clip_by_value(x: torch.Tensor, tensor_min: torch.Tensor, tensor_max: torch.Tensor) -> torch.Tensor:
    """Element-wise clamp of x into [tensor_min, tensor_max] where the bounds are tensors."""
    return torch.max(torch.min(x, tensor_max), tensor_min)


def get_response_mask(
    response_id: torch.Tensor, eos_token: int | Sequence[int] = 2, dtype: torch.dtype = torch.int64
) -> torch.Tensor:
    """1 on response tokens up to and including the first EOS, 0 after it.

    Args:
        response_id: (bs, response_length) generated token ids (right padded).
        eos_token: one id or a list of ids that end a response.

    Example: eos 1, response [5, 7, 1, 4, 1, 0] -> mask [1, 1, 1, 0, 0, 0].
    """
    eos_ids = torch.as_tensor(eos_token, device=response_id.device).reshape(-1)
    is_eos = torch.isin(response_id, eos_ids).int()
    eos_before = torch.cumsum(is_eos, dim=-1) - is_eos
    return eos_before.eq(0).to(dtype)


def compute_position_id_with_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids for a left-padded attention mask: cumsum(mask) - 1, clipped at 0.

    Args:
        mask: (bs, seq_len) attention mask of 0/1.
    """
    return torch.clip(torch.cumsum(mask, dim=-1) - 1, min=0)


def pad_sequence_to_length(
    tensors: torch.Tensor, max_seq_len: int, pad_token_id: int | float, left_pad: bool = False
) -> torch.Tensor:
    """Pad the last dim of `tensors` (bs, seq_len) with `pad_token_id` up to `max_seq_len`; longer input is returned as is."""
    missing = max_seq_len - tensors.shape[-1]
    if missing <= 0:
        return tensors
    pad = (missing, 0) if left_pad else (0, missing)
    return F.pad(tensors, pad, mode="constant", value=pad_token_id)


def pad_2d_list_to_length(
    response: Sequence[Sequence[int]], pad_token_id: int, max_length: int | None = None
) -> torch.Tensor:
    """Right-pad a list of token-id lists to one tensor (bs, max(longest, max_length))."""
    longest = max(len(row) for row in response)
    target = max(longest, max_length) if max_length is not None else longest
    padded = [list(row) + [pad_token_id] * (target - len(row)) for row in response]
    return torch.tensor(padded)


def tokenize_and_postprocess_data(
    prompt: str,
    tokenizer,
    max_length: int,
    pad_token_id: int,
    left_pad: bool = True,
    truncation: str = "error",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenise one prompt (no special tokens added) and pad or truncate it to `max_length`.

    Args:
        prompt: the text (already chat-templated when wanted).
        tokenizer: a Hugging Face tokenizer.
        max_length: length of the returned tensors.
        pad_token_id: id used for padding.
        left_pad: pad on the left (prompts for generation) or on the right.
        truncation: what to do when longer: "error" (raise), "left" (keep the last tokens), "right" (keep the
            first tokens), "middle" (keep max_length // 2 first and the rest from the end).

    Returns:
        input_ids, attention_mask: (1, max_length) each.
    """
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"truncation={truncation!r} is not supported; choose one of {list(TRUNCATION_MODES)}")
    encoded = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    input_ids = encoded["input_ids"]
    attention_mask = encoded["attention_mask"]
    if input_ids.ndim != 2:
        raise ValueError(f"expected the tokenizer to return (1, seq_len) ids, got shape {tuple(input_ids.shape)}")

    seq_len = input_ids.shape[-1]
    if seq_len < max_length:
        input_ids = pad_sequence_to_length(input_ids, max_length, pad_token_id, left_pad=left_pad)
        attention_mask = pad_sequence_to_length(attention_mask, max_length, 0, left_pad=left_pad)
    elif seq_len > max_length:
        if truncation == "left":
            input_ids, attention_mask = input_ids[:, -max_length:], attention_mask[:, -max_length:]
        elif truncation == "right":
            input_ids, attention_mask = input_ids[:, :max_length], attention_mask[:, :max_length]
        elif truncation == "middle":
            head = max_length // 2
            tail = max_length - head
            input_ids = torch.cat([input_ids[:, :head], input_ids[:, seq_len - tail :]], dim=-1)
            attention_mask = torch.cat([attention_mask[:, :head], attention_mask[:, seq_len - tail :]], dim=-1)
        else:
            raise ValueError(
                f"prompt has {seq_len} tokens, more than max_length={max_length}; shorten it, raise max_length, "
                f"or set truncation to one of 'left', 'right', 'middle'"
            )
    return input_ids, attention_mask


def prompt_groups(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int = 0) -> torch.Tensor:
    """(bs,) group id of every row: rows whose prompts are identical share an id, numbered 0, 1, ... in order
    of first appearance.

    The prompt is the first seq_len - response_length columns of `input_ids` / `attention_mask` (bs, seq_len);
    two prompts are identical when their masks and their ids under the mask are equal.
    Example: prompts [a, b, a, c] -> [0, 1, 0, 2].
    """
    prompt_len = input_ids.shape[1] - response_length
    mask = attention_mask[:, :prompt_len]
    key = torch.cat([input_ids[:, :prompt_len] * mask, mask], dim=1)
    _, inverse = torch.unique(key, dim=0, return_inverse=True)
    first_row = group_first_rows(inverse)
    rank = torch.empty_like(first_row)
    rank[torch.argsort(first_row)] = torch.arange(len(first_row), device=first_row.device)
    return rank[inverse]


def group_first_rows(groups: torch.Tensor) -> torch.Tensor:
    """(num_groups,) index of the first row of each group, for (bs,) group ids 0..num_groups-1."""
    rows = torch.arange(len(groups), device=groups.device)
    first = torch.full((int(groups.max()) + 1,), len(groups), dtype=torch.long, device=groups.device)
    return first.scatter_reduce(0, groups, rows, "amin")


# Model types whose attention is plain scaled dot-product over (optionally grouped) KV heads: no softcap, sinks,
# sliding window or attention bias that verl's own attention functions (the rollout's shared-prefix decode, the
# engine's prompt blocks) would have to reproduce.
_PLAIN_ATTENTION_MODELS = frozenset({"qwen2", "qwen3", "llama"})
# HF's sdpa, and the actor's packed-sequence sdpa (`verl.workers.engine.model_forward.VARLEN_SDPA`, HF's sdpa for
# every unpacked call), which a model keeps once it has run a packed forward (`use_remove_padding`)
SDPA_IMPLEMENTATIONS = frozenset({"sdpa", "verl_sdpa_varlen"})


def plain_sdpa_attention(config) -> bool:
    """Whether a model's attention is plain scaled dot-product: a plain-attention model type under sdpa
    (`SDPA_IMPLEMENTATIONS`), every layer full attention (no sliding window in use)."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return (
        getattr(config, "model_type", None) in _PLAIN_ATTENTION_MODELS
        and getattr(config, "_attn_implementation", None) in SDPA_IMPLEMENTATIONS
        and all(kind == "full_attention" for kind in layer_types)
        and not getattr(config, "use_sliding_window", False)
    )


@contextlib.contextmanager
def attention_implementation(module: torch.nn.Module, name: str | None) -> Iterator[None]:
    """Within the block the HF model `module` attends through the registered attention `name` (None: its own);
    its own implementation is back afterwards, also on an error."""
    config = module.config
    before = config._attn_implementation
    if name is not None:
        config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before


def cache_kwarg(module: torch.nn.Module) -> str:
    """The name under which a HF model's forward takes its KV cache: `cache` (recent transformers 5 releases) or
    `past_key_values` (earlier ones; the recent ones still take it, with a deprecation warning per call site)."""
    base = module.get_base_model() if hasattr(module, "get_base_model") else module  # a peft model's own model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def write_in_place(layer: Any, key_states: torch.Tensor, value_states: torch.Tensor):
    """Write a step's keys/values at position `layer.length` of the layer's preallocated `key_buffer` and
    `value_buffer` (`layer.capacity` positions) and return the written part of both: what a preallocated cache
    layer's `update` does (hf_rollout's per-row cache, verl.cpu.shared_prefix's response part)."""
    end = layer.length + key_states.shape[-2]
    if end > layer.capacity:
        raise RuntimeError(f"KV cache of {layer.capacity} positions is full (needs {end})")
    layer.key_buffer[:, :, layer.length : end] = key_states
    layer.value_buffer[:, :, layer.length : end] = value_states
    layer.length = end
    return layer.key_buffer[:, :, :end], layer.value_buffer[:, :, :end]
