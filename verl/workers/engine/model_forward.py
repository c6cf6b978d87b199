"""The model forward of the log-prob, update and value passes, in three layouts with equal results.

Owns `response_outputs` (the model's output at the positions that predict each response token, flat (K, D), plus
its (bs, response_len) mask; `scatter_to_responses` puts results back) and `prompt_group_order`. Layouts: padded
(common left padding cut, `logits_to_keep`), packed (`use_remove_padding`: one (1, nnz) row with `cu_seq_lens`;
`sdpa` becomes `verl_sdpa_varlen`, run per sequence or by torch's varlen flash kernel) and shared prompt
(`share_prompt_prefix`: identical prompts run once, their KV cache copied to the rows; not with gradient
checkpointing). `head=HeadSpec(...)` swaps the LM head for per-token statistics computed a chunk at a time.
Layer 5: torch and the model only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verl.utils.torch_functional import (
    cache_kwarg,
    group_first_rows,
    prompt_groups,
)
from verl.workers.engine.head_stats import HeadSpec, head_token_stats

__all__ = [
    "HeadSpec",
    "accepts_logits_to_keep",
    "head_token_stats",
    "packed_logits",
    "prompt_group_order",
    "prompt_groups",
    "response_outputs",
    "scatter_to_responses",
]


class _HeadCall(nn.Module):
    """Stands in for a causal LM's output layer during one model call (`_swapped_head`). With no `labels` it returns
    the hidden states it is given (bs, k, H); with labels (bs, k) it returns `head_token_stats` of them (bs, k, C).
    `prefix` (bs, 1, H) goes in front of the hidden states less their last position (the shared-prompt layout: the
    prompt's last state predicts the first response token)."""

    def __init__(
        self, spec: HeadSpec | None = None, labels: torch.Tensor | None = None, prefix: torch.Tensor | None = None
    ):
        super().__init__()
        self.spec, self.labels, self.prefix = spec, labels, prefix
        self.target: tuple[nn.Module, ...] = ()  # the model's head, set by `_swapped_head` (not a child module)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.labels is None:  # a copy: an FSDP2 root warns when its output is a view
            return hidden.clone()
        if self.prefix is not None:
            hidden = torch.cat([self.prefix.to(hidden.dtype), hidden[:, :-1]], dim=1)
        stats = head_token_stats(
            hidden.reshape(-1, hidden.shape[-1]), self.target[0], self.labels.reshape(-1), self.spec
        )
        return stats.view(*self.labels.shape, -1).clone()


@contextlib.contextmanager
def _swapped_head(module: nn.Module, replacement: _HeadCall | None) -> Iterator[None]:
    """Put `replacement` where `module.get_output_embeddings()` sits (a peft model's inner LM too) for the block."""
    if replacement is None:
        yield
        return
    head = module.get_output_embeddings()
    owner = next((sub, name) for sub in module.modules() for name, child in sub.named_children() if child is head)
    replacement.target = (head,)
    setattr(owner[0], owner[1], replacement)
    try:
        yield
    finally:
        setattr(owner[0], owner[1], head)


def scatter_to_responses(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """(K,) values at the True positions of `where` (bs, response_len) -> (bs, response_len), 0 elsewhere."""
    out = torch.zeros(where.shape, dtype=values.dtype, device=values.device)
    out[where] = values
    return out


def prompt_group_order(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> torch.Tensor:
    """A row permutation that puts rows of the same prompt next to each other (groups in order of first
    appearance, rows in their order within a group)."""
    groups = prompt_groups(input_ids, attention_mask, response_length)
    return torch.sort(groups, stable=True).indices


def _common_left_pad(attention_mask: torch.Tensor) -> int:
    used = attention_mask.bool().any(dim=0).nonzero()
    return int(used[0]) if used.numel() else 0


def _call(module: nn.Module, is_lm: bool, keep: Any, head: _HeadCall | None = None, **inputs: Any) -> torch.Tensor:
    """module(**inputs).logits; a causal LM computes its head only at `keep` (HF `logits_to_keep`), and `head`, when
    given, replaces that head for the call (its output is what `.logits` holds)."""
    if is_lm:
        inputs["logits_to_keep"] = keep
    with _swapped_head(module, head):
        return module(**inputs).logits


def _padded(
    module: nn.Module, batch: Any, response_length: int, is_lm: bool, head: HeadSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    first = _common_left_pad(batch["attention_mask"])
    inputs = {
        "input_ids": batch["input_ids"][:, first:],
        "attention_mask": batch["attention_mask"][:, first:],
        "position_ids": batch["position_ids"][:, first:],
        "use_cache": False,
    }
    if head is not None:  # the head sees exactly the positions predicting the response tokens
        end = inputs["input_ids"].shape[1] - 1
        keep = torch.arange(end - response_length, end, device=inputs["input_ids"].device)
        out = _call(module, True, keep, _HeadCall(head, batch["input_ids"][:, -response_length:]), **inputs)
    else:
        out = _call(module, is_lm, response_length + 1, **inputs)[:, -response_length - 1 : -1]
    where = torch.ones(out.shape[:2], dtype=torch.bool, device=out.device)
    return out.reshape(-1, out.shape[-1]), where


VARLEN_SDPA = "verl_sdpa_varlen"


def _varlen_sdpa_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed sequence: one varlen flash call where `_flash_varlen_applies`, else SDPA
    per sequence. query (1, heads, nnz, dim), key/value (1, kv_heads, nnz, dim); the sequences are the spans of
    `cu_seq_lens_q`. Without it (a padded call) this is HF's sdpa attention, except that on CPU a masked call over
    grouped KV heads keeps them grouped (`_cpu_grouped_sdpa_applies`). Returns (1 or bs, q, heads, dim), as HF's
    attention functions do."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        if _cpu_grouped_sdpa_applies(query, key, attention_mask, kwargs):
            output = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True
            )
            return output.transpose(1, 2).contiguous(), None
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    if _flash_varlen_applies(query, dropout if module.training else 0.0):
        return _flash_varlen(query, key, value, bounds, kwargs.get("max_length_q"), scaling), None
    grouped = {}
    if query.device.type == "cpu":  # torch's CPU kernels take the kv heads grouped
        grouped["enable_gqa"] = True
    else:  # grouped-query attention: each kv head copied to the query heads that share it
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    bounds = bounds.tolist()
    outputs = [
        F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=scaling, dropout_p=dropout if module.training else 0.0, **grouped
        )
        for q, k, v in zip(*(_sequence_spans(states, bounds) for states in (query, key, value)))
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _sequence_spans(states: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    """The spans of `states` (1, heads, nnz, dim) between consecutive `bounds` along the token dimension. When the
    spans tile the whole row, one `split`, whose backward is one concatenation of the spans' gradients; a slice
    per span would give each span's gradient its own zero-filled (1, heads, nnz, dim) tensor, summed up."""
    if bounds[0] == 0 and bounds[-1] == states.shape[2]:
        return list(states.split([end - start for start, end in zip(bounds[:-1], bounds[1:])], dim=2))
    return [states[:, :, start:end] for start, end in zip(bounds[:-1], bounds[1:])]


def _cpu_grouped_sdpa_applies(
    query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> bool:
    """Whether a padded call is masked attention over grouped KV heads on CPU, where HF's sdpa copies each KV head to
    its query heads (`repeat_kv`, as CUDA's kernels need with a mask) and torch's CPU kernel takes mask and grouping
    together, without the copies (figures: benchmarks/README.md).
    A single query (decode) and calls without a mask keep HF's path (no copy there)."""
    plain = not (kwargs.get("position_bias") is not None or kwargs.get("softcap") or kwargs.get("output_attentions"))
    grouped = query.shape[1] != key.shape[1] and query.shape[2] > 1
    return plain and grouped and query.device.type == "cpu" and attention_mask is not None


@functools.cache
def _varlen_kernel() -> tuple[Any, frozenset[str]] | None:
    """torch's varlen flash attention (`torch.nn.attention.varlen.varlen_attn`, torch 2.10+) and its keyword names,
    looked up once; None in a torch without it."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _flash_varlen_applies(query: torch.Tensor, dropout: float) -> bool:
    """torch's flash-attention varlen kernel runs the packed call in one launch: on CUDA (compute capability 8+), in
    half precision, without dropout, in a torch that has `torch.nn.attention.varlen`. The per-sequence loop
    otherwise (CPU, float32): on CUDA that is one SDPA launch per sequence."""
    if query.device.type != "cuda" or query.dtype not in (torch.float16, torch.bfloat16) or dropout > 0:
        return False
    return torch.cuda.get_device_capability(query.device)[0] >= 8 and _varlen_kernel() is not None


def _flash_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    max_len: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """Causal attention within each packed sequence in one varlen flash call. query (1, heads, nnz, dim),
    key/value (1, kv_heads, nnz, dim), bounds (n + 1,) int32; returns (1, nnz, heads, dim)."""
    varlen_attn, options = _varlen_kernel()
    if max_len is None:
        max_len = int((bounds[1:] - bounds[:-1]).max())
    causal = {"window_size": (-1, 0)} if "window_size" in options else {"is_causal": True}  # torch 2.10: is_causal
    if query.shape[1] != key.shape[1]:  # grouped-query attention
        if "enable_gqa" in options:
            causal["enable_gqa"] = True
        else:
            repeat = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (nnz, heads, dim)
    out = varlen_attn(q, k, v, bounds, bounds, max_len, max_len, scale=scaling, **causal)
    return out.unsqueeze(0)


def _varlen_sdpa_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a packed call (the attention cuts the sequences itself); HF's sdpa mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_SDPA, _varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_SDPA, _varlen_sdpa_mask)


def _use_varlen_sdpa(module: nn.Module) -> None:
    """Switch an `sdpa` model to `verl_sdpa_varlen` (other implementations are left alone). The switch stays: a
    backward pass recomputing a checkpointed layer (gradient checkpointing) must see the same attention as the
    forward did, and `verl_sdpa_varlen` computes what HF's sdpa does for every call without `cu_seq_lens_q`."""
    config = getattr(module, "config", None)
    if config is not None and config._attn_implementation == "sdpa":
        config._attn_implementation = VARLEN_SDPA


def _packed_kwargs(bounds: torch.Tensor, max_len: int) -> dict[str, Any]:
    """The model's keyword arguments for one packed row: no mask, no cache, the sequences' boundaries and longest
    length (what `verl_sdpa_varlen` and flash-attention's varlen path read)."""
    return {
        "attention_mask": None,
        "use_cache": False,
        "cu_seq_lens_q": bounds,
        "cu_seq_lens_k": bounds,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


def _packed(
    module: nn.Module, batch: Any, response_length: int, is_lm: bool, head: HeadSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    valid = batch["attention_mask"].bool()
    packed_index = torch.cumsum(valid.flatten(), 0).view(valid.shape) - 1  # (bs, seq_len) slot in the packed row
    seq_len = valid.shape[1]
    cols = slice(seq_len - response_length - 1, seq_len - 1)  # the positions predicting response tokens
    where = valid[:, cols]
    keep = packed_index[:, cols][where]
    lengths = valid.sum(dim=1)
    bounds = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    max_len = int(lengths.max())
    head_call = None if head is None else _HeadCall(head, batch["input_ids"][:, -response_length:][where].unsqueeze(0))
    out = _call(
        module,
        is_lm,
        keep,
        head_call,
        input_ids=batch["input_ids"][valid].unsqueeze(0),
        position_ids=batch["position_ids"][valid].unsqueeze(0),
        **_packed_kwargs(bounds, max_len),
    )[0]
    return (out if is_lm else out[keep]), where


def packed_logits(
    module: nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's output (`.logits`) at every token of packed sequences, (nnz, D), or at the packed positions
    `keep` only, (len(keep), D).

    input_ids, position_ids: (nnz,) the sequences one after the other (no padding), each sequence's positions
    from 0; cu_seqlens: (n + 1,) int, the sequence boundaries (0, len_0, len_0 + len_1, ...); keep: (K,) int
    positions, passed to the model as `logits_to_keep` where its forward takes that (the LM head then runs on
    those positions alone). Attention stays inside each sequence (the packed layout above: flash-attention
    varlen on GPU, per-sequence SDPA on CPU).
    """
    bounds = cu_seqlens.to(device=input_ids.device, dtype=torch.int32)
    max_len = int((bounds[1:] - bounds[:-1]).max()) if bounds.numel() > 1 else 0
    _use_varlen_sdpa(module)
    head_trim = keep is not None and accepts_logits_to_keep(module)
    out = module(
        input_ids=input_ids.unsqueeze(0),
        position_ids=position_ids.unsqueeze(0),
        **({"logits_to_keep": keep} if head_trim else {}),
        **_packed_kwargs(bounds, max_len),
    ).logits[0]
    return out if keep is None or head_trim else out[keep]


def accepts_logits_to_keep(module: nn.Module) -> bool:
    """Whether the model's forward takes HF's `logits_to_keep` (a HF causal LM does)."""
    return "logits_to_keep" in inspect.signature(type(module).forward).parameters


def _group_size_in_order(groups: torch.Tensor) -> int | None:
    """n when the rows are the prompts in order, n rows each (the order `prompt_group_order` makes), else None."""
    num_groups = int(groups.max()) + 1
    n = groups.numel() // num_groups
    in_order = n * num_groups == groups.numel()
    if in_order and torch.equal(groups, torch.arange(num_groups, device=groups.device).repeat_interleave(n)):
        return n
    return None


def _copy_prompt_rows(cache: Any, groups: torch.Tensor, n: int | None) -> None:
    """Give every row (a differentiable copy of) its prompt's keys and values; `cache` holds one row per prompt.

    When the rows are the prompts in order, n rows each (`prompt_group_order` makes that order), each layer's copy
    is a broadcast of each prompt over its n rows, whose backward sums the n copies' gradients; else, as
    `batch_select_indices`, an index, whose backward is a scatter-add (the slower of the two on CPU). Both give the
    same values and gradients. n: `_group_size_in_order(groups)`."""
    layers = getattr(cache, "layers", None)  # transformers 5's cache layers; older caches keep the index
    if layers is None or n is None:
        cache.batch_select_indices(groups)
        return
    num_groups = groups.numel() // n
    for layer in layers:
        for name in ("keys", "values"):
            states = getattr(layer, name, None)
            if isinstance(states, torch.Tensor) and states.dim() > 0 and states.shape[0] == num_groups:
                rest = states.shape[1:]
                setattr(layer, name, states.unsqueeze(1).expand(num_groups, n, *rest).reshape(num_groups * n, *rest))


def _shared_prompt(
    module: nn.Module, batch: Any, response_length: int, is_lm: bool, groups: torch.Tensor, head: HeadSpec | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import DynamicCache

    input_ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    prompt_len = input_ids.shape[1] - response_length
    first_row = group_first_rows(groups)
    prompt_mask = mask[first_row, :prompt_len]
    first = _common_left_pad(prompt_mask)
    n = _group_size_in_order(groups)
    cache = DynamicCache()
    prompt_out = _call(
        module,
        is_lm,
        1,
        None if head is None else _HeadCall(),  # the prompt's last hidden state (G, 1, H)
        input_ids=input_ids[first_row, first:prompt_len],
        attention_mask=prompt_mask[:, first:],
        position_ids=pos[first_row, first:prompt_len],
        **{cache_kwarg(module): cache},
        use_cache=True,
    )[:, -1:]
    _copy_prompt_rows(cache, groups, n)
    head_call = None
    if head is not None:
        head_call = _HeadCall(head, input_ids[:, prompt_len:], prefix=prompt_out[groups])
    response_out = _call(
        module,
        is_lm,
        0,
        head_call,
        input_ids=input_ids[:, prompt_len:],
        attention_mask=torch.cat([prompt_mask[groups, first:], mask[:, prompt_len:]], dim=1),
        position_ids=pos[:, prompt_len:],
        **{cache_kwarg(module): cache},
        use_cache=True,
    )
    out = response_out if head is not None else torch.cat([prompt_out[groups], response_out[:, :-1]], dim=1)
    where = torch.ones(out.shape[:2], dtype=torch.bool, device=out.device)
    return out.reshape(-1, out.shape[-1]), where


def response_outputs(
    module: nn.Module,
    batch: Any,
    response_length: int,
    is_lm: bool = True,
    use_remove_padding: bool = False,
    share_prompt_prefix: bool = False,
    head: HeadSpec | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Model outputs at the positions predicting the response tokens, in the layout the flags pick.

    batch: `input_ids`, `attention_mask`, `position_ids` (bs, seq_len), the last `response_length` columns
        being the response. module: a HF model whose output has `.logits` (bs, seq, D); `is_lm` says it
        takes `logits_to_keep` (a causal LM; False for a value head).
    head: for a causal LM, compute `HeadSpec`'s per-token statistics of the response tokens (D = C columns) in
        vocabulary chunks instead of returning logits (D = vocab); see the module docstring.
    Returns (outputs (K, D), where (bs, response_length) bool): row k of outputs belongs to the k-th True
    position of `where` in row-major order. The shared-prompt layout is used when `share_prompt_prefix`
    (always two model calls, even when no prompt repeats: under FSDP every rank must run as many forwards);
    else packed with `use_remove_padding`; else padded.
    """
    if head is not None and not is_lm:
        raise ValueError("response_outputs(head=...) needs a causal LM (is_lm=True); a value model has no LM head")
    _use_varlen_sdpa(module)  # every layout: its padded calls keep CPU's grouped attention (`_varlen_sdpa_attention`)
    if share_prompt_prefix:
        groups = prompt_groups(batch["input_ids"], batch["attention_mask"], response_length)
        return _shared_prompt(module, batch, response_length, is_lm, groups, head)
    if use_remove_padding:
        return _packed(module, batch, response_length, is_lm, head)
    return _padded(module, batch, response_length, is_lm, head)
