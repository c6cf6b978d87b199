"""The `vllm` rollout engine: a colocated `vllm.LLM` that sleeps during training (GPU only).

Owns `VLLMRollout`. The engine is built from `model.path` with `enable_sleep_mode=True` and put to sleep
(level 1: weights to CPU, KV cache freed) right away; `generate_sequences` wakes it, generates and puts it
back to sleep, so the actor's FSDP2 training owns the GPU memory in between. After every actor update the
worker calls `update_weights(full_state_dict)`, which wakes only the weights and loads them with the vLLM
model's own `load_weights`.

vLLM is imported lazily: asking for this engine on a machine without CUDA or without vLLM fails at
construction with a message that names the problem and `actor_rollout_ref.rollout.name=hf`, the CPU engine.
The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so that weights can be loaded directly.

Layer 5: imports torch, verl.protocol, verl.utils and vllm; must not import Ray.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from verl.protocol import DataProto
from verl.workers.rollout.base import (
    BaseRollout,
    build_rollout_output,
    generation_seed,
    pad_responses,
    resolve_sampling,
    resolve_token_ids,
)

CPU_HINT = "use actor_rollout_ref.rollout.name=hf, the engine that runs on CPU and GPU"


def _import_vllm():
    if not torch.cuda.is_available():
        raise RuntimeError(f"rollout engine 'vllm' needs a CUDA GPU, and none is visible to this process; {CPU_HINT}")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        import vllm
    except ImportError as err:
        raise RuntimeError(
            f"rollout engine 'vllm' needs the vllm package, which is not installed ({err}); "
            f"install it with `pip install -e .[gpu]` or {CPU_HINT}"
        ) from err
    return vllm


class VLLMRollout(BaseRollout):
    """Generate with a colocated vLLM engine.

    model_path: HF directory of the policy (the same weights the actor starts from).
    config: the `actor_rollout_ref.rollout` section (`prompt_length`, `response_length`, `dtype`,
        `gpu_memory_utilization`, `tensor_model_parallel_size`, sampling knobs, `calculate_log_probs`, `seed`).
    tokenizer: used for default eos/pad ids when meta_info has none.
    """

    def __init__(self, model_path: str, config: Any, tokenizer: Any = None):
        vllm = _import_vllm()
        self._vllm = vllm
        self.config = config
        self.tokenizer = tokenizer
        self.response_length = int(config.response_length)
        max_len = int(config.prompt_length) + self.response_length
        dtype = str(config.get("dtype", "bfloat16"))
        self.engine = vllm.LLM(
            model=model_path,
            dtype=dtype,
            enable_sleep_mode=True,
            gpu_memory_utilization=float(config.get("gpu_memory_utilization", 0.5)),
            tensor_parallel_size=int(config.get("tensor_model_parallel_size", 1)),
            max_model_len=max_len,
            seed=int(config.get("seed", 0)),
            enforce_eager=bool(config.get("enforce_eager", True)),
            # log-probs after temperature scaling, the formula the actor uses (see HFRollout).
            logprobs_mode="processed_logprobs",
        )
        self.engine.sleep(level=1)
        self._calls = 0

    # ------------------------------------------------------------------ weights
    def _model(self):
        """The vLLM torch module of the in-process engine."""
        executor = self.engine.llm_engine.model_executor
        return executor.driver_worker.worker.model_runner.model

    def update_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Wake the weights only, load the actor's full state dict, and go back to sleep."""
        self.engine.wake_up(tags=["weights"])
        device = torch.device("cuda", torch.cuda.current_device())
        self._model().load_weights((name, t.to(device)) for name, t in state_dict.items())
        torch.cuda.synchronize()
        self.engine.sleep(level=1)

    # ------------------------------------------------------------------ generation
    @torch.no_grad()
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Same contract as `HFRollout.generate_sequences` (`rollout_log_probs` from vLLM's processed
        log-probs when `rollout.calculate_log_probs`)."""
        meta = prompts.meta_info
        sampling = resolve_sampling(self.config, meta)
        eos_token_id, pad_token_id = resolve_token_ids(meta, self.tokenizer)
        want_log_probs = bool(meta.get("calculate_log_probs", self.config.get("calculate_log_probs", False)))
        seed = generation_seed(self.config, meta, self._calls)
        self._calls += 1

        input_ids = prompts.batch["input_ids"].cpu()
        mask = prompts.batch["attention_mask"].cpu().bool()
        token_prompts = [{"prompt_token_ids": ids[m].tolist()} for ids, m in zip(input_ids, mask)]
        stop_ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        params = [
            self._vllm.SamplingParams(
                n=1,
                temperature=sampling.temperature if sampling.do_sample else 0.0,
                top_k=sampling.top_k,
                top_p=sampling.top_p,
                max_tokens=self.response_length,
                stop_token_ids=stop_ids,
                logprobs=0 if want_log_probs else None,
                seed=seed + i,
                detokenize=False,
            )
            for i in range(len(token_prompts))
        ]
        self.engine.wake_up()
        try:
            outputs = self.engine.generate(token_prompts, params, use_tqdm=False)
        finally:
            self.engine.sleep(level=1)

        generated = [torch.tensor(out.outputs[0].token_ids, dtype=torch.long) for out in outputs]
        responses = pad_responses(generated, self.response_length, pad_token_id)
        log_probs = None
        if want_log_probs:
            log_probs = torch.zeros(responses.shape, dtype=torch.float32)
            for i, out in enumerate(outputs):
                sample = out.outputs[0]
                values = [step[tok].logprob for tok, step in zip(sample.token_ids, sample.logprobs)]
                n = min(len(values), self.response_length)
                log_probs[i, :n] = torch.tensor(values[:n])
        device = prompts.batch["input_ids"].device
        return build_rollout_output(
            prompts,
            responses.to(device),
            eos_token_id,
            pad_token_id,
            None if log_probs is None else log_probs.to(device),
        )
