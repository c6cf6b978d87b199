"""verl's `verl.workers.rollout.replica` module path, for `TokenOutput` only.

Owns `TokenOutput`, what a verl server manager's `await generate(request_id=..., prompt_ids=...,
sampling_params=...)` returns to an agent loop (verl 0.9.1's fields). Here the server manager is the adapter of
the `agent_loop` workflow over the rank's `AsyncRolloutEngine`
(`verl.workers.rollout.workflows.agent_loop.EngineServerManager`); verl's rollout replicas and server modes
(`RolloutReplica`, `RolloutMode`) are not provided.

Layer 5 (the rollout package): imports only pydantic.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

__all__ = ["TokenOutput"]


class TokenOutput(BaseModel):
    """One generation for an agent loop.

    token_ids: the generated token ids; log_probs: one per token when the request asked for them
    (`sampling_params["logprobs"]`), else None; routed_experts: MoE routing (never set here); stop_reason:
    "completed" (eos or a stop), "length" (the token budget ran out), "aborted", or None when unknown;
    num_preempted: how often the server preempted the request (None here: it has no preemption);
    extra_fields: what the server adds (here the policy version as verl's `global_steps`,
    `min_global_steps`, `max_global_steps`).
    """

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any | None = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = {}
