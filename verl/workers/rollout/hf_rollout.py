"""The `hf` rollout engine: sampling with a HF model (CPU and GPU, the default).

Owns `HFRollout`. It holds either the actor's own FSDP2 module (gathered once per `generate_sequences`, no weight
sync) or its own plain copy updated by `verl.workers.weight_sync`. Generation is a KV-cache sampling loop with HF's
logits warpers: each distinct prompt is prefilled once and its cache shared by its rows, finished rows leave the
batch, and every row's random draws come up front from the call's seed (results do not depend on micro-batching).
Greedy equals `generate`. On CPU the `verl.cpu` speed-ups may replace parts of the loop.
Layer 5: must not import Ray.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from verl.protocol import DataProto
from verl.utils import acceleration, fsdp_utils
from verl.utils.torch_functional import cache_kwarg, group_first_rows, prompt_groups, write_in_place
from verl.workers.rollout.base import (
    BaseRollout,
    SamplingSettings,
    WeightSource,
    build_rollout_output,
    generation_seed,
    named_tensor_stream,
    resolve_sampling,
    resolve_token_ids,
)


class HFRollout(BaseRollout):
    """Generate with a KV-cache sampling loop over the module, micro-batched, reproducible by seed.

    module: a causal LM (HF `PreTrainedModel`) used only by this engine.
    config: the `actor_rollout_ref.rollout` section (`response_length`, `micro_batch_size`, `temperature`,
        `top_k`, `top_p`, `do_sample`, `val_kwargs`, `calculate_log_probs`, `seed`, `ignore_eos`).
    tokenizer: used for default eos/pad ids when meta_info has none.
    """

    accepts_sharded_module = True  # may generate with the actor's FSDP2 module itself (see the module docstring)

    def __init__(self, module: nn.Module, config: Any, tokenizer: Any = None):
        self.module = module
        self.sharded = any(isinstance(m, FSDPModule) for m in module.modules())
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.get("response_length", 0) or 0)
        if self.response_length <= 0:
            raise ValueError(f"rollout.response_length must be a positive int, got {config.get('response_length')!r}")
        micro = config.get("micro_batch_size", None)
        if micro is not None and int(micro) <= 0:
            raise ValueError(f"rollout.micro_batch_size must be a positive int or null (= all), got {micro!r}")
        self.micro_batch_size = None if micro is None else int(micro)
        self.ignore_eos = bool(config.get("ignore_eos", False))  # verl's key: run every row to response_length
        self.weight_dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)
        self.cache_kwarg = cache_kwarg(module)  # the forward's name for its KV cache argument
        self._calls = 0
        # decode steps without HF's module calls where the device's speed-ups offer it (verl.cpu.lean_decode on a
        # CPU); False: HF's forward
        self.lean_decode = True

    # ------------------------------------------------------------------ weights
    def in_place_module(self) -> nn.Module | None:
        """This engine's model, written in place by a full (non-LoRA) weight sync; None for a peft model (it takes
        only its adapters, through `update_weights`)."""
        if self.sharded:
            raise RuntimeError("this hf engine generates with the actor's own FSDP2 module: there is nothing to sync")
        return None if hasattr(self.module, "peft_config") else self.module

    @torch.no_grad()
    def update_weights(self, weights: WeightSource) -> None:
        """Copy the actor's weights into the engine's module in place (tied weights stay tied).

        `weights`: a full state dict, or a stream of `(name, tensor)` pairs or buckets (`named_tensor_stream`);
        each tensor is copied into its parameter (cast to its dtype and device) and dropped. Every parameter must
        arrive under its own name or a name it is tied to, except that a LoRA engine (a peft module) needs only its
        adapter (`lora_`) weights: its base weights never change. A name the model does not have raises KeyError
        after the stream has been read to its end (its gathers are collectives that every rank must finish).
        """
        own = dict(self.module.named_parameters(remove_duplicate=False))
        own.update(dict(self.module.named_buffers(remove_duplicate=False)))
        unknown: list[str] = []
        loaded_ids = set()
        for name, value in named_tensor_stream(weights):
            target = own.get(name)
            if target is None:
                unknown.append(name)
            else:
                target.copy_(value)
                loaded_ids.add(id(target))
            del value  # the sender's memory goes back before the next tensor is gathered
        if unknown:
            raise KeyError(f"state dict has keys the rollout model does not: {unknown[:5]} ({len(unknown)} in all)")
        lora = hasattr(self.module, "peft_config")
        missing = [
            n
            for n, p in self.module.named_parameters(remove_duplicate=False)
            if id(p) not in loaded_ids and (not lora or "lora_" in n)
        ]
        if missing:
            raise KeyError(f"state dict misses rollout model parameters: {missing[:5]} ({len(missing)} in all)")

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per row.

        prompts.batch: `input_ids`, `attention_mask`, `position_ids` (bs, prompt_len), left-padded.
        prompts.meta_info: `eos_token_id` (int or list), `pad_token_id`, `do_sample`, `validate`, `seed`,
            and per-call `temperature`/`top_p`/`top_k`/`calculate_log_probs` overrides (all optional). Rows are
            not repeated here: the trainer repeats prompts `rollout.n` times itself. With `rollout.ignore_eos`
            every row runs to `response_length` and all of it is in `response_mask` (verl's meaning).
        Returns the fields of `build_rollout_output`; `rollout_log_probs` (bs, response_len) when
        `rollout.calculate_log_probs`: log_softmax(logits / temperature) of the sampled tokens, the actor's
        formula at the same temperature (top-k/top-p truncation is not reflected, as in the actor).
        """
        meta = prompts.meta_info
        sampling = resolve_sampling(self.config, meta)
        eos_token_id, pad_token_id = resolve_token_ids(
            meta, self.tokenizer, getattr(self.module, "generation_config", None)
        )
        want_log_probs = bool(meta.get("calculate_log_probs", self.config.get("calculate_log_probs", False)))
        seed = generation_seed(self.config, meta, self._calls)
        self._calls += 1
        stop_ids = [] if self.ignore_eos else eos_token_id  # ignore_eos: all generated tokens are in the response

        input_ids = prompts.batch["input_ids"]
        bs = input_ids.shape[0]
        order = _length_sorted_order(prompts.batch["attention_mask"])
        micro = self.micro_batch_size or bs
        responses = torch.empty((bs, self.response_length), dtype=torch.long)
        log_probs = torch.zeros((bs, self.response_length), dtype=torch.float32) if want_log_probs else None
        # one uniform per row and position, drawn up front: a row's samples do not depend on the micro-batches,
        # or on when the other rows finish (and the global RNG is left alone)
        uniforms = None
        if sampling.do_sample:
            uniforms = torch.rand((bs, self.response_length), generator=torch.Generator().manual_seed(seed))

        device = next(self.module.parameters()).device
        was_training = self.module.training
        self.module.eval()
        try:
            # this device's speed-ups (verl.utils.acceleration; on a CPU verl.cpu: OpenBLAS for wide products, the
            # lean decode step, the shared-prompt cache, the fused sampler); none elsewhere
            accel = acceleration.for_device(device.type)
            with fsdp_utils.unsharded(self.module), accel.products(rows=min(micro, bs)):
                lean = None
                if self.lean_decode:  # HF's forward otherwise
                    positions = int(prompts.batch["position_ids"].max()) + self.response_length + 1
                    lean = accel.lean_decoder(self.module, positions)
                for start in range(0, bs, micro):
                    rows = order[start : start + micro]
                    ids, lps = self._generate_micro_batch(
                        prompts, rows, device, sampling, stop_ids, pad_token_id, want_log_probs, uniforms, lean, accel
                    )
                    responses[rows] = ids
                    if log_probs is not None:
                        log_probs[rows] = lps
        finally:
            self.module.train(was_training)
        return build_rollout_output(prompts, responses, stop_ids, pad_token_id, log_probs)

    def _generate_micro_batch(
        self,
        prompts: DataProto,
        rows: torch.Tensor,
        device: torch.device,
        sampling: SamplingSettings,
        eos_token_id: int | list[int],
        pad_token_id: int,
        want_log_probs: bool,
        uniforms: torch.Tensor | None,
        lean: Any | None,
        accel: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sample responses for prompt rows `rows`: prefill the distinct prompts once (common left padding cut),
        then decode. Rows sharing a prompt decode against its one copy of the prompt's keys and values where the
        device's speed-ups offer such a cache (`accel.shared_prefix_cache`).

        Returns (the rows' responses right-padded with `pad_token_id`, their log-probs log_softmax(logits / T)[token]
        with 0 on padding, or None).
        """
        groups = prompt_groups(prompts.batch["input_ids"][rows], prompts.batch["attention_mask"][rows], 0)
        state = self._prefill(prompts, rows, groups, device, uniforms, accel)
        with accel.decode_attention(self.module) if state.shared else contextlib.nullcontext():
            return self._decode(state, sampling, eos_token_id, pad_token_id, want_log_probs, lean, accel)

    def _prefill(
        self,
        prompts: DataProto,
        rows: torch.Tensor,
        groups: torch.Tensor,
        device: torch.device,
        uniforms: torch.Tensor | None,
        accel: Any,
    ) -> _Prefilled:
        """One forward over the distinct prompts of `rows` (their common left padding cut), its KV cache set up for
        decoding every row: where several rows share a prompt, the device's shared-prompt cache if it has one
        (`accel.shared_prefix_cache`), else a per-row copy of each prompt's cache.
        `groups`: the rows' prompt-group ids in the micro-batch (ascending in order of first appearance, gaps
        allowed); `uniforms`: the whole call's draws (bs, response_length), or None for greedy."""
        ids, mask, pos = (prompts.batch[key][rows] for key in ("input_ids", "attention_mask", "position_ids"))
        groups = torch.unique(groups, return_inverse=True)[1]  # renumbered 0..G-1, order kept
        first_row = group_first_rows(groups)
        start = _first_non_pad_column(mask[first_row])
        prompt_mask = mask[first_row, start:].to(device)
        cache = None
        if len(first_row) < len(groups):
            cache = accel.shared_prefix_cache(self.module.config, self.response_length)
        shared = cache is not None
        if not shared:
            cache = _kv_cache(self.module.config, ids.shape[1] - start + self.response_length)
        logits = self.module(
            input_ids=ids[first_row, start:].to(device),
            attention_mask=prompt_mask,
            position_ids=pos[first_row, start:].to(device),
            **{self.cache_kwarg: cache},
            use_cache=True,
            logits_to_keep=1,
        ).logits[:, -1]
        groups = groups.to(device)
        if shared:
            cache.start_decode(groups, prompt_mask)
        elif len(first_row) < len(groups):
            cache.batch_select_indices(groups)
        return _Prefilled(
            cache=cache,
            shared=shared,
            logits=logits[groups],
            attention=prompt_mask[groups],  # the 2-D mask of the per-row cache (unused by the shared one)
            next_pos=pos[first_row, -1].to(device)[groups] + 1,
            uniforms=None if uniforms is None else uniforms[rows].to(device),
        )

    def _decode(
        self,
        state: _Prefilled,
        sampling: SamplingSettings,
        eos_token_id: int | list[int],
        pad_token_id: int,
        want_log_probs: bool,
        lean: Any | None,
        accel: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The sampling loop of a prefilled micro-batch; a row that emits an eos leaves the batch and its cache. Each
        step runs `lean.step` when given, else the module's forward."""
        logits, attention, next_pos, cache = state.logits, state.attention, state.next_pos, state.cache
        device = logits.device
        rows = len(logits)
        live = torch.arange(rows, device=device)  # the rows still generating
        eos = torch.tensor(eos_token_id, device=device, dtype=torch.long).reshape(-1)
        warpers = _logits_warpers(sampling)
        responses = torch.full((rows, self.response_length), pad_token_id, dtype=torch.long, device=device)
        log_probs = torch.zeros(responses.shape, dtype=torch.float32, device=device) if want_log_probs else None
        decode_kwargs = {self.cache_kwarg: cache, "use_cache": True}
        if state.shared:
            decode_kwargs["shared_prefix"] = cache
        # one call per step for the sampling and its log-probs where the device offers it (verl.cpu: float32, no
        # top-k/top-p)
        fused_sampling = accel.token_sampler(sampling.top_k, sampling.top_p, logits)
        for t in range(self.response_length):
            draws = None if state.uniforms is None else state.uniforms[live, t]
            if fused_sampling is not None:
                tokens, token_lp = fused_sampling(logits, sampling.logprob_temperature, draws, log_probs is not None)
            else:
                tokens = _next_tokens(logits, warpers, draws)
                if log_probs is not None:
                    token_lp = torch.log_softmax(logits.float() / sampling.logprob_temperature, dim=-1)
                    token_lp = token_lp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            responses[live, t] = tokens
            if log_probs is not None:
                log_probs[live, t] = token_lp
            running = ~torch.isin(tokens, eos)
            if t == self.response_length - 1 or not running.any():
                break
            if not running.all():  # finished rows leave the batch and its KV cache
                keep = running.nonzero().flatten()
                live, tokens, attention, next_pos = live[keep], tokens[keep], attention[keep], next_pos[keep]
                cache.batch_select_indices(keep)
            if not state.shared:
                attention = torch.cat([attention, attention.new_ones(len(live), 1)], dim=1)
            if lean is not None:
                logits = lean.step(tokens, next_pos, cache, None if state.shared else attention)
            else:
                logits = self.module(
                    input_ids=tokens.unsqueeze(-1),
                    attention_mask=None if state.shared else attention,
                    position_ids=next_pos.unsqueeze(-1),
                    **decode_kwargs,
                ).logits[:, -1]
            next_pos = next_pos + 1
        return responses.cpu(), (log_probs.cpu() if log_probs is not None else None)


@dataclass
class _Prefilled:
    """A prefilled part of a micro-batch, ready for its sampling loop: the KV cache, the last prompt position's
    logits of every row, the per-row cache's 2-D attention mask, each row's next position id, and (sampling) each
    row's uniforms (rows, response_length)."""

    cache: Cache
    shared: bool
    logits: torch.Tensor
    attention: torch.Tensor
    next_pos: torch.Tensor
    uniforms: torch.Tensor | None = None


def _length_sorted_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """Row indices sorted by prompt length (longest first, stable), so a micro-batch pads little."""
    lengths = attention_mask.sum(dim=-1)
    return torch.sort(lengths, descending=True, stable=True).indices


def _first_non_pad_column(attention_mask: torch.Tensor) -> int:
    """Index of the first column where some row has a real token (the common left padding ends there)."""
    used = attention_mask.bool().any(dim=0).nonzero()
    return int(used[0]) if used.numel() else 0


class _PreallocatedLayer(DynamicLayer):
    """A KV-cache layer whose keys and values live in a buffer allocated once for `capacity` positions:
    a decode step writes its token in place and returns a view, where HF's DynamicLayer concatenates (copying
    the whole cache every step, O(length^2) over a response). Dropping rows copies the buffer once."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        bs, heads = key_states.shape[:2]
        self.key_buffer = key_states.new_empty(bs, heads, self.capacity, key_states.shape[-1])
        self.value_buffer = value_states.new_empty(bs, heads, self.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = write_in_place(self, key_states, value_states)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]
            self.keys, self.values = self.key_buffer[:, :, : self.length], self.value_buffer[:, :, : self.length]


def _kv_cache(config: Any, capacity: int) -> Cache:
    """A preallocated cache of `capacity` positions per layer for full-attention models; HF's DynamicCache
    for models with sliding-window or other layer types."""
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    if any(kind != "full_attention" for kind in layer_types):
        return DynamicCache(config=config)
    return Cache(layers=[_PreallocatedLayer(capacity) for _ in layer_types])


def _logits_warpers(sampling: SamplingSettings) -> LogitsProcessorList:
    """HF's sampling warpers in HF's order (temperature, top-k, top-p); empty for greedy."""
    warpers = LogitsProcessorList()
    if not sampling.do_sample:
        return warpers
    if sampling.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k != -1:
        warpers.append(TopKLogitsWarper(sampling.top_k))
    if sampling.top_p < 1.0:
        warpers.append(TopPLogitsWarper(sampling.top_p))
    return warpers


def _next_tokens(logits: torch.Tensor, warpers: LogitsProcessorList, draws: torch.Tensor | None) -> torch.Tensor:
    """(bs,) next token ids from (bs, vocab) logits: argmax when `draws` is None, else inverse-CDF sampling from
    softmax(warped logits) with one uniform in [0, 1) per row (`draws`, (bs,))."""
    if draws is None:
        return logits.argmax(dim=-1)
    probs = torch.softmax(warpers(None, logits.float()), dim=-1)
    # inverse-CDF sampling: one uniform per row (torch.multinomial draws one exponential per vocabulary entry)
    cdf = probs.cumsum(dim=-1)
    draw = draws.to(cdf.dtype).unsqueeze(-1) * cdf[:, -1:]
    return torch.searchsorted(cdf, draw, right=True).squeeze(-1).clamp(max=probs.shape[-1] - 1)
