"""The `hf` rollout engine: HF `generate` on an un-sharded copy of the policy (CPU and GPU, the default).

Owns `HFRollout`. Weight sync (`model_update`): the engine holds its own plain (not FSDP-wrapped) copy of the
policy; after every actor update the worker gathers the actor's full state dict and calls `update_weights`,
which copies it in place. A separate copy (rather than generating with the FSDP2 module itself) keeps
generation free of collectives, so ranks may stop at different lengths and micro-batch counts, and its
log-probs equal the actor's on the same weights up to KV-cache rounding (~1e-6). The cost is one extra copy of
the weights per rank.

Layer 5: imports torch, transformers, verl.protocol and verl.utils; must not import Ray.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import GenerationConfig

from verl.protocol import DataProto
from verl.workers.rollout.base import (
    BaseRollout,
    SamplingSettings,
    build_rollout_output,
    generation_seed,
    pad_responses,
    resolve_sampling,
    resolve_token_ids,
)


class HFRollout(BaseRollout):
    """Generate with `module.generate`, micro-batched, reproducible by seed.

    module: a causal LM (HF `PreTrainedModel`) used only by this engine.
    config: the `actor_rollout_ref.rollout` section (`response_length`, `micro_batch_size`, `temperature`,
        `top_k`, `top_p`, `do_sample`, `val_kwargs`, `calculate_log_probs`, `seed`).
    tokenizer: used for default eos/pad ids when meta_info has none.
    """

    def __init__(self, module: nn.Module, config: Any, tokenizer: Any = None):
        self.module = module
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.get("response_length", 0) or 0)
        if self.response_length <= 0:
            raise ValueError(f"rollout.response_length must be a positive int, got {config.get('response_length')!r}")
        micro = config.get("micro_batch_size", None)
        if micro is not None and int(micro) <= 0:
            raise ValueError(f"rollout.micro_batch_size must be a positive int or null (= all), got {micro!r}")
        self.micro_batch_size = None if micro is None else int(micro)
        self._calls = 0

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Copy the actor's full state dict into the engine's module in place (tied weights stay tied).

        Every parameter must be in `state_dict` under its own name or a name it is tied to; unknown keys raise.
        """
        own = dict(self.module.named_parameters(remove_duplicate=False))
        own.update(dict(self.module.named_buffers(remove_duplicate=False)))
        unknown = sorted(set(state_dict) - set(own))
        if unknown:
            raise KeyError(f"state dict has keys the rollout model does not: {unknown[:5]} ({len(unknown)} in all)")
        loaded_ids = set()
        for name, value in state_dict.items():
            target = own[name]
            target.copy_(value.to(device=target.device, dtype=target.dtype))
            loaded_ids.add(id(target))
        missing = [n for n, p in self.module.named_parameters(remove_duplicate=False) if id(p) not in loaded_ids]
        if missing:
            raise KeyError(f"state dict misses rollout model parameters: {missing[:5]} ({len(missing)} in all)")

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Generate one response per row.

        prompts.batch: `input_ids`, `attention_mask`, `position_ids` (bs, prompt_len), left-padded.
        prompts.meta_info: `eos_token_id` (int or list), `pad_token_id`, `do_sample`, `validate`, `seed`
            (all optional). Rows are not repeated here: the trainer repeats prompts `rollout.n` times itself.
        Returns the fields of `build_rollout_output`; `rollout_log_probs` (bs, response_len) when
        `rollout.calculate_log_probs`: log_softmax(logits / temperature) of the sampled tokens, the actor's
        formula at the same temperature (top-k/top-p truncation is not reflected, as in the actor).
        """
        meta = prompts.meta_info
        sampling = resolve_sampling(self.config, meta)
        eos_token_id, pad_token_id = resolve_token_ids(
            meta, self.tokenizer, getattr(self.module, "generation_config", None)
        )
        want_log_probs = bool(self.config.get("calculate_log_probs", False))
        seed = generation_seed(self.config, meta, self._calls)
        self._calls += 1

        input_ids = prompts.batch["input_ids"]
        bs = input_ids.shape[0]
        order = _length_sorted_order(prompts.batch["attention_mask"])
        micro = self.micro_batch_size or bs
        responses = torch.empty((bs, self.response_length), dtype=torch.long)
        log_probs = torch.zeros((bs, self.response_length), dtype=torch.float32) if want_log_probs else None

        device = next(self.module.parameters()).device
        was_training = self.module.training
        self.module.eval()
        fork_devices = [device] if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=fork_devices):
                torch.manual_seed(seed)
                for start in range(0, bs, micro):
                    rows = order[start : start + micro]
                    ids, lps = self._generate_micro_batch(
                        prompts, rows, device, sampling, eos_token_id, pad_token_id, want_log_probs
                    )
                    responses[rows] = ids
                    if log_probs is not None:
                        log_probs[rows] = lps
        finally:
            self.module.train(was_training)
        return build_rollout_output(prompts, responses, eos_token_id, pad_token_id, log_probs)

    def _generate_micro_batch(
        self,
        prompts: DataProto,
        rows: torch.Tensor,
        device: torch.device,
        sampling: SamplingSettings,
        eos_token_id: int | list[int],
        pad_token_id: int,
        want_log_probs: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Generate for prompt rows `rows` after cutting their common left padding.

        Returns responses (len(rows), response_length) right-padded with `pad_token_id`, and their
        log-probs (same shape, 0 on padding) or None.
        """
        mask = prompts.batch["attention_mask"][rows]
        first = _first_non_pad_column(mask)
        ids = prompts.batch["input_ids"][rows, first:].to(device)
        mask = mask[:, first:].to(device)
        pos = prompts.batch["position_ids"][rows, first:].to(device)
        output = self.module.generate(
            input_ids=ids,
            attention_mask=mask,
            position_ids=pos,
            generation_config=_generation_config(
                sampling, self.response_length, eos_token_id, pad_token_id, output_logits=want_log_probs
            ),
        )
        generated = output.sequences[:, ids.shape[1] :].cpu()
        responses = pad_responses(list(generated), self.response_length, pad_token_id)
        if not want_log_probs:
            return responses, None
        logits = torch.stack(output.logits, dim=1).float().cpu()  # (mb, gen_len, vocab)
        token_lp = torch.log_softmax(logits / sampling.logprob_temperature, dim=-1)
        token_lp = token_lp.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
        log_probs = torch.zeros(responses.shape, dtype=torch.float32)
        n = min(token_lp.shape[1], self.response_length)
        log_probs[:, :n] = token_lp[:, :n]
        return responses, log_probs


def _length_sorted_order(attention_mask: torch.Tensor) -> torch.Tensor:
    """Row indices sorted by prompt length (longest first, stable), so a micro-batch pads little."""
    lengths = attention_mask.sum(dim=-1)
    return torch.sort(lengths, descending=True, stable=True).indices


def _first_non_pad_column(attention_mask: torch.Tensor) -> int:
    """Index of the first column where some row has a real token (the common left padding ends there)."""
    used = attention_mask.bool().any(dim=0).nonzero()
    return int(used[0]) if used.numel() else 0


def _generation_config(
    sampling: SamplingSettings,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    output_logits: bool,
) -> GenerationConfig:
    """A GenerationConfig that pins every knob changing the token distribution, so values from the model's
    own generation_config.json (e.g. a repetition penalty) cannot creep in."""
    common = dict(
        return_dict_in_generate=True,
        output_logits=output_logits,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        num_beams=1,
        num_return_sequences=1,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        typical_p=1.0,
        use_cache=True,
    )
    if not sampling.do_sample:
        return GenerationConfig(do_sample=False, temperature=1.0, top_k=50, top_p=1.0, **common)
    return GenerationConfig(
        do_sample=True,
        temperature=sampling.temperature,
        top_k=0 if sampling.top_k == -1 else sampling.top_k,  # HF: 0 = no top-k
        top_p=sampling.top_p,
        **common,
    )
