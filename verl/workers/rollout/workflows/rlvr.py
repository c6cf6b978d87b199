"""The `rlvr` workflow: one completion per row, scored later by the trainer's reward function.

This is what the trainer did before workflows existed, expressed as a workflow: with the trainer's seed and
every row's episode started at once, the requests of a rank form one batched generate call with exactly
the rows, order and seed of `generate_sequences`, so the tokens (and `rollout_log_probs`) are identical.
Layer 5: must not import Ray.
"""

from __future__ import annotations

from verl.protocol import DataProto
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelRequest
from verl.workers.rollout.workflows.base import RolloutWorkflow, prompt_ids_of, single_turn_row


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn reinforcement learning with verifiable rewards (AReaL's `RLVRWorkflow`, one sample per row:
    the trainer repeats each prompt `rollout.n` times before generation)."""

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto:
        request = ModelRequest(input_ids=prompt_ids_of(data), gconfig=engine.default_gconfig())
        return single_turn_row(engine, data, await engine.agenerate(request))
