"""The worker extension the `vllm` engine hands to vLLM (`LLM(worker_extension_cls=...)`), and the name check it uses.

vLLM imports `VLLMWorkerExtension` by its qualified name (`WORKER_EXTENSION_CLS`) inside its worker and adds it to
the worker's base classes, so `LLM.collective_rpc(LOAD_WEIGHTS_METHOD, args=(bucket,))` runs `verl_load_weights`
on every worker (vLLM's documented pattern for RL weight updates: `worker_extension_cls` + `collective_rpc`). The
method feeds a bucket of `(HF name, tensor)` pairs to the vLLM model's own `load_weights(weights=...)`, which maps
HF checkpoint names onto vLLM's fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj, tied lm_head skipped).
The model is the one `Worker.get_model()` returns, the same module vLLM's public `LLM.apply_model` runs on (without
the CUDA-graph wrapper of `worker.model_runner.model`).

Also owns `peft_name_problem`: vLLM loads HF checkpoint names only, so a peft-named tensor (`base_model.model.`,
`.base_layer.`, `lora_A`/`lora_B`) is refused with a message saying LoRA must arrive merged.

Must stay importable without vLLM (it is imported by vLLM, never the other way round): imports torch only. Must not
import Ray or the rest of verl. Only the one method: vLLM refuses an extension whose attributes clash with the
worker's.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["LOAD_WEIGHTS_METHOD", "WORKER_EXTENSION_CLS", "VLLMWorkerExtension", "peft_name_problem"]

WORKER_EXTENSION_CLS = "verl.workers.rollout.vllm_worker_extension.VLLMWorkerExtension"
LOAD_WEIGHTS_METHOD = "verl_load_weights"
_PEFT_MARKS = ("base_model.model.", ".base_layer.", "lora_A", "lora_B", "lora_embedding_", "lora_magnitude_vector")


def peft_name_problem(name: str) -> str | None:
    """Why `name` is not a plain HF checkpoint name vLLM can load (a peft wrapper or adapter name), or None."""
    for mark in _PEFT_MARKS:
        if mark in name:
            return (
                f"weight {name!r} has the peft name part {mark!r}; the vllm engine loads plain HF names only, so LoRA "
                "adapters must be merged into the base weights before they are sent (verl.workers.weight_sync mode "
                "'merged', what the worker uses for engines built from model.path)"
            )
    return None


class VLLMWorkerExtension:
    """Mixed into vLLM's GPU worker by `worker_extension_cls`; called through `LLM.collective_rpc`."""

    def verl_load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load one bucket of `(HF name, tensor)` pairs with the vLLM model's `load_weights`, each tensor moved to
        the model's device first, and wait for the copies; returns how many tensors were loaded. ValueError on a
        peft name (before loading anything of the bucket)."""
        bucket = list(weights)
        for name, _ in bucket:
            problem = peft_name_problem(name)
            if problem is not None:
                raise ValueError(problem)
        model = self.get_model()  # provided by vLLM's worker class
        device = next(model.parameters()).device
        model.load_weights(weights=((name, tensor.to(device, non_blocking=True)) for name, tensor in bucket))
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # the bucket may be freed once this returns
        return len(bucket)
