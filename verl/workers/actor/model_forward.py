"""The model forward of the log-prob, update and value passes, in three layouts with equal results.

Owns `response_outputs`: the model's output (`.logits`) at the positions that predict each response token, as
a flat (K, D) tensor plus the (bs, response_len) mask of which positions it holds. The caller turns it into
log-probs or values and scatters them back (`scatter_to_responses`). Layouts:

- padded (default): the (bs, seq_len) batch less its common left padding; the LM head runs only on the
  response positions (`logits_to_keep`).
- packed (`use_remove_padding`): the real tokens of all rows in one (1, nnz) row, each sequence's
  `position_ids` starting at 0, plus the sequence boundaries (`cu_seq_lens_q/k`, HF's varlen keywords).
  `flash_attention_2` (GPU) runs its varlen kernel on them. `sdpa` is switched, for this forward only, to
  `verl_sdpa_varlen`: causal SDPA run sequence by sequence, so no compute goes to padding or to the
  cross-sequence blocks a block-diagonal mask would still multiply (that mask costs O(nnz^2) per micro-batch,
  several times a padded forward on CPU). `eager` gets transformers' block-diagonal mask built from the
  position-id restarts. Positions after a response's end (masked) are not computed; their outputs are left
  out of K.
- shared prompt (`share_prompt_prefix`): rows whose prompts are identical (GRPO's n samples of one prompt)
  run that prompt once; the prompt's KV cache is copied to its rows and the responses run on it. Causal
  attention makes the prompt's states independent of the response, so this equals the full forward; autograd
  flows through the copies, so it serves the update pass too. Not with gradient checkpointing (HF drops the
  cache there).

Also `prompt_group_order`, which reorders rows so that identical prompts sit together in micro-batches.
Layer 5: torch and the model only, no Ray.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from verl.utils.torch_functional import group_first_rows, prompt_groups

__all__ = ["prompt_group_order", "prompt_groups", "response_outputs", "scatter_to_responses"]


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


def _call(module: nn.Module, is_lm: bool, keep: Any, **inputs: Any) -> torch.Tensor:
    """module(**inputs).logits; a causal LM computes its head only at `keep` (HF `logits_to_keep`)."""
    if is_lm:
        inputs["logits_to_keep"] = keep
    return module(**inputs).logits


def _padded(module: nn.Module, batch: Any, response_length: int, is_lm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    first = _common_left_pad(batch["attention_mask"])
    out = _call(
        module,
        is_lm,
        response_length + 1,
        input_ids=batch["input_ids"][:, first:],
        attention_mask=batch["attention_mask"][:, first:],
        position_ids=batch["position_ids"][:, first:],
        use_cache=False,
    )
    out = out[:, -response_length - 1 : -1]
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
    """Causal SDPA per packed sequence. query (1, heads, nnz, dim), key/value (1, kv_heads, nnz, dim); the
    sequences are the spans of `cu_seq_lens_q`. Without it (a padded call) this is HF's sdpa attention.
    Returns (1, nnz, heads, dim), as HF's attention functions do."""
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs
        )
    repeat = query.shape[1] // key.shape[1]  # grouped-query attention: share each kv head
    key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    bounds = bounds.tolist()
    outputs = [
        F.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            is_causal=True,
            scale=scaling,
            dropout_p=dropout if module.training else 0.0,
        )
        for start, end in zip(bounds[:-1], bounds[1:])
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def _varlen_sdpa_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> torch.Tensor | None:
    """No mask for a packed call (the attention cuts the sequences itself); HF's sdpa mask otherwise."""
    if attention_mask is None:
        return None
    return sdpa_mask(*args, attention_mask=attention_mask, **kwargs)


AttentionInterface.register(VARLEN_SDPA, _varlen_sdpa_attention)
AttentionMaskInterface.register(VARLEN_SDPA, _varlen_sdpa_mask)


@contextlib.contextmanager
def _varlen_attention(module: nn.Module) -> Iterator[None]:
    """Switch an `sdpa` model to `verl_sdpa_varlen` (other implementations are left alone). The switch stays: a
    backward pass recomputing a checkpointed layer (gradient checkpointing) must see the same attention as the
    forward did, and `verl_sdpa_varlen` is HF's sdpa for every call without `cu_seq_lens_q`."""
    config = getattr(module, "config", None)
    if config is not None and config._attn_implementation == "sdpa":
        config._attn_implementation = VARLEN_SDPA
    yield


def _packed(module: nn.Module, batch: Any, response_length: int, is_lm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    valid = batch["attention_mask"].bool()
    packed_index = torch.cumsum(valid.flatten(), 0).view(valid.shape) - 1  # (bs, seq_len) slot in the packed row
    seq_len = valid.shape[1]
    cols = slice(seq_len - response_length - 1, seq_len - 1)  # the positions predicting response tokens
    where = valid[:, cols]
    keep = packed_index[:, cols][where]
    lengths = valid.sum(dim=1)
    bounds = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
    max_len = int(lengths.max())
    with _varlen_attention(module):
        out = _call(
            module,
            is_lm,
            keep,
            input_ids=batch["input_ids"][valid].unsqueeze(0),
            position_ids=batch["position_ids"][valid].unsqueeze(0),
            attention_mask=None,
            use_cache=False,
            cu_seq_lens_q=bounds,
            cu_seq_lens_k=bounds,
            max_length_q=max_len,
            max_length_k=max_len,
        )[0]
    return (out if is_lm else out[keep]), where


def _shared_prompt(
    module: nn.Module, batch: Any, response_length: int, is_lm: bool, groups: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import DynamicCache

    input_ids, mask, pos = batch["input_ids"], batch["attention_mask"], batch["position_ids"]
    prompt_len = input_ids.shape[1] - response_length
    first_row = group_first_rows(groups)
    prompt_mask = mask[first_row, :prompt_len]
    first = _common_left_pad(prompt_mask)
    cache = DynamicCache()
    prompt_out = _call(
        module,
        is_lm,
        1,
        input_ids=input_ids[first_row, first:prompt_len],
        attention_mask=prompt_mask[:, first:],
        position_ids=pos[first_row, first:prompt_len],
        past_key_values=cache,
        use_cache=True,
    )[:, -1:]
    cache.batch_select_indices(groups)  # each row gets (a differentiable copy of) its prompt's keys and values
    response_out = _call(
        module,
        is_lm,
        0,
        input_ids=input_ids[:, prompt_len:],
        attention_mask=torch.cat([prompt_mask[groups, first:], mask[:, prompt_len:]], dim=1),
        position_ids=pos[:, prompt_len:],
        past_key_values=cache,
        use_cache=True,
    )
    out = torch.cat([prompt_out[groups], response_out[:, :-1]], dim=1)
    where = torch.ones(out.shape[:2], dtype=torch.bool, device=out.device)
    return out.reshape(-1, out.shape[-1]), where


def response_outputs(
    module: nn.Module,
    batch: Any,
    response_length: int,
    is_lm: bool = True,
    use_remove_padding: bool = False,
    share_prompt_prefix: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Model outputs at the positions predicting the response tokens, in the layout the flags pick.

    batch: `input_ids`, `attention_mask`, `position_ids` (bs, seq_len), the last `response_length` columns
        being the response. module: a HF model whose output has `.logits` (bs, seq, D); `is_lm` says it
        takes `logits_to_keep` (a causal LM; False for a value head).
    Returns (outputs (K, D), where (bs, response_length) bool): row k of outputs belongs to the k-th True
    position of `where` in row-major order. The shared-prompt layout is used when `share_prompt_prefix`
    (always two model calls, even when no prompt repeats: under FSDP every rank must run as many forwards);
    else packed with `use_remove_padding`; else padded.
    """
    if share_prompt_prefix:
        groups = prompt_groups(batch["input_ids"], batch["attention_mask"], response_length)
        return _shared_prompt(module, batch, response_length, is_lm, groups)
    if use_remove_padding:
        return _packed(module, batch, response_length, is_lm)
    return _padded(module, batch, response_length, is_lm)
