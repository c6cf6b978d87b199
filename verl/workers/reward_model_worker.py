"""The reward model of one rank as a `Worker`: a frozen sequence classifier that scores prompt + response.

Owns `RewardModelWorker` (role `Role.RewardModel`, prefix "rm"; re-exported by `verl.workers.fsdp_workers`) and
`check_reward_model_config`. The head's output at the last attended token is placed on the last response token of
`rm_scores`. When the reward model's tokenizer or chat template differs from the policy's, each response is
decoded, appended to the row's `raw_prompt` and re-rendered with the reward model's template (verl's
`_switch_chat_template`). Config: `model_path`, `trust_remote_code`, `dtype`, `micro_batch_size_per_gpu` (verl's
legacy `model.*` layout too). Layer 7: must not import `fsdp_workers`.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from verl.protocol import DataProto
from verl.single_controller.base import Dispatch, Worker, register
from verl.utils.device import get_device_name
from verl.utils.tokenizer import hf_tokenizer
from verl.utils.torch_functional import compute_position_id_with_mask
from verl.workers.worker_config import require_dir_on_node

__all__ = ["RewardModelWorker", "check_reward_model_config"]

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}  # fmt: skip
_SCORE_HEADS = ("score", "classifier")  # the one-label head of HF's *ForSequenceClassification models


def _settings(config: Any) -> dict[str, Any]:
    """The worker's settings from `reward.reward_model` (or verl's legacy `reward_model` layout)."""
    model = config.get("model") or {}
    return {
        "model_path": config.get("model_path") or model.get("path"),
        "input_tokenizer": config.get("input_tokenizer") or model.get("input_tokenizer"),
        "trust_remote_code": bool(config.get("trust_remote_code") or model.get("trust_remote_code")),
        "dtype": str(config.get("dtype") or model.get("dtype") or "float32"),
        "micro_batch_size_per_gpu": config.get("micro_batch_size_per_gpu", 16),
    }


def check_reward_model_config(config: Any) -> None:
    """Refuse a `reward.reward_model` section the worker cannot run, before any worker starts (ValueError)."""
    settings = _settings(config)
    path = settings["model_path"]
    if not path or not os.path.isfile(os.path.join(str(path), "config.json")):
        raise ValueError(
            f"reward.reward_model.model_path={path!r} is not an HF model folder (no config.json); the reward "
            "model is an AutoModelForSequenceClassification with one label (nothing is downloaded)"
        )
    micro = settings["micro_batch_size_per_gpu"]
    if isinstance(micro, bool) or not isinstance(micro, int) or micro <= 0:
        raise ValueError(f"reward.reward_model.micro_batch_size_per_gpu={micro!r} must be a positive integer")
    if settings["dtype"] not in _DTYPES:
        raise ValueError(f"reward.reward_model.dtype={settings['dtype']!r}; allowed: {sorted(_DTYPES)}")


def same_tokens(a: Any, b: Any) -> bool:
    """Whether two tokenizers give ids the same meaning and format chats alike (then no re-encoding is needed)."""
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def last_attended(attention_mask: torch.Tensor) -> torch.Tensor:
    """(bs,) index of each row's last attended position; -1 for a row with none."""
    positions = torch.arange(1, attention_mask.shape[-1] + 1, device=attention_mask.device)
    return (attention_mask.bool() * positions).max(dim=-1).values - 1


def place_on_last_response_token(
    scores: torch.Tensor, attention_mask: torch.Tensor, response_length: int
) -> torch.Tensor:
    """(bs, response_length) float32 zeros with `scores` (bs,) on each row's last attended response token
    (column 0 for an empty response, as the reward managers do)."""
    last = last_attended(attention_mask[:, -response_length:]).clamp(min=0).cpu()
    rm_scores = torch.zeros(len(scores), response_length, dtype=torch.float32)
    rm_scores[torch.arange(len(scores)), last] = scores.float().cpu()
    return rm_scores


class RewardModelWorker(Worker):
    """A frozen one-label sequence classifier scoring whole sequences; see the module docstring.

    config: `reward.reward_model` (with `device` and `input_tokenizer` added by the trainer). Call `init_model`
    (all ranks) before `compute_rm_score`.
    """

    def __init__(self, config: Any):
        super().__init__()
        if isinstance(config, DictConfig):
            config = OmegaConf.to_container(config, resolve=True)
        self.config = OmegaConf.create(dict(config))
        check_reward_model_config(self.config)
        self.settings = _settings(self.config)
        self.device_name = get_device_name(self.config.get("device", "auto"))
        self.micro_batch_size = int(self.settings["micro_batch_size_per_gpu"])
        self.reward_module: nn.Module | None = None
        self.tokenizer = None  # the reward model's
        self.input_tokenizer = None  # the policy's, only when it differs (then inputs are re-encoded)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load the tokenizers and the classifier (its trained head must be in the checkpoint), then FSDP2."""
        from transformers import AutoModelForSequenceClassification

        from verl.utils import fsdp_utils  # FSDP2: imported in the worker, not by the driver (the class's importer)

        path, trust = self.settings["model_path"], self.settings["trust_remote_code"]
        require_dir_on_node(path, "reward_model.model.path", self.rank, absolute_only=True)
        fsdp_utils.init_distributed()
        self.tokenizer = hf_tokenizer(path, trust_remote_code=trust)
        if self.settings["input_tokenizer"]:
            policy_tokenizer = hf_tokenizer(self.settings["input_tokenizer"], trust_remote_code=trust)
            self.input_tokenizer = None if same_tokens(policy_tokenizer, self.tokenizer) else policy_tokenizer
        module, info = AutoModelForSequenceClassification.from_pretrained(
            path,
            num_labels=1,
            dtype=_DTYPES[self.settings["dtype"]],
            attn_implementation="sdpa",
            trust_remote_code=trust,
            output_loading_info=True,
        )
        untrained = [k for k in info.get("missing_keys", []) if k.split(".")[0] in _SCORE_HEADS]
        if untrained:
            raise ValueError(
                f"reward.reward_model.model_path={path!r} holds no trained classification head (missing "
                f"{sorted(untrained)}): it is not a reward model (a causal LM gets a random head here)"
            )
        if module.config.pad_token_id is None:  # HF refuses batches > 1 without one; its pooling is not used
            module.config.pad_token_id = self.tokenizer.pad_token_id
        self.score_head = _score_head(module)
        module.requires_grad_(False)
        self.reward_module = fsdp_utils.apply_fsdp2(module).eval()

    # ------------------------------------------------------------------ inputs
    def _switch_chat_template(self, data: DataProto) -> dict[str, torch.Tensor]:
        """Re-encode every row for the reward model: its chat template over `raw_prompt` + the decoded response."""
        if "raw_prompt" not in data.non_tensor_batch:
            raise ValueError(
                "the reward model's tokenizer differs from the policy's, so each row's chat is re-rendered with the "
                "reward model's template; that needs the un-tokenised prompt: set data.return_raw_chat=true"
            )
        source, target = self.input_tokenizer, self.tokenizer
        responses = data.batch["responses"]
        lengths = data.batch["attention_mask"][:, -responses.shape[-1] :].sum(-1).tolist()
        rows = []
        for i, length in enumerate(lengths):
            response = source.decode(responses[i, : int(length)].tolist())
            if source.eos_token:
                response = response.replace(source.eos_token, "")
            chat = [*list(data.non_tensor_batch["raw_prompt"][i]), {"role": "assistant", "content": response}]
            text = target.apply_chat_template(chat, add_generation_prompt=False, tokenize=False)
            rows.append(target(text, add_special_tokens=False)["input_ids"])
        width = max(len(ids) for ids in rows)
        input_ids = torch.full((len(rows), width), target.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, ids in enumerate(rows):  # right-padded: the last valid token is the last attended one
            input_ids[i, : len(ids)], attention_mask[i, : len(ids)] = torch.tensor(ids), 1
        position_ids = compute_position_id_with_mask(attention_mask)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}

    @torch.no_grad()
    def _forward_micro_batch(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        """(bs,) the head's output at each sequence's last attended token (read with a forward hook)."""
        captured = {}
        handle = self.score_head.register_forward_hook(lambda _m, _i, out: captured.__setitem__("scores", out))
        try:
            self.reward_module(**inputs, use_cache=False)
        finally:
            handle.remove()
        if captured["scores"].dim() == 2:  # a head that pools itself (e.g. an encoder's classifier on [CLS])
            return captured["scores"][:, 0].float()
        token_scores = captured["scores"][..., 0].float()  # (bs, seq_len)
        last = last_attended(inputs["attention_mask"]).clamp(min=0)
        return token_scores[torch.arange(token_scores.shape[0], device=last.device), last]

    # ------------------------------------------------------------------ the group method
    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores` (bs, response_length): the reward model's score on the last response token, 0 elsewhere.

        Reads `input_ids`, `attention_mask`, `position_ids`, `responses` (and `raw_prompt` when re-encoding),
        `micro_batch_size_per_gpu` rows per forward. Returned on CPU.
        """
        if self.reward_module is None:
            raise RuntimeError("RewardModelWorker.compute_rm_score called before init_model")
        if self.input_tokenizer is not None:
            inputs = self._switch_chat_template(data)
        else:
            inputs = {key: data.batch[key] for key in ("input_ids", "attention_mask", "position_ids")}
        device = next(self.reward_module.parameters()).device
        scores = []
        for start in range(0, len(data), self.micro_batch_size):
            micro = {key: value[start : start + self.micro_batch_size].to(device) for key, value in inputs.items()}
            scores.append(self._forward_micro_batch(micro).cpu())
        response_length = data.batch["responses"].shape[-1]
        rm_scores = place_on_last_response_token(torch.cat(scores), data.batch["attention_mask"], response_length)
        return DataProto.from_dict(tensors={"rm_scores": rm_scores})


def _score_head(module: nn.Module) -> nn.Module:
    for name in _SCORE_HEADS:
        head = getattr(module, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(module).__name__} has no `score` or `classifier` head to read token scores from")
