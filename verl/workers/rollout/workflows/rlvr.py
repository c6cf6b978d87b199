"""The `rlvr` workflow: one completion per row, scored later by the trainer's reward function.

This is what the trainer did before workflows existed, expressed as a workflow: with the trainer's seed and
every row's episode started at once, the requests of a rank form one batched generate call with exactly
the rows, order and seed of `generate_sequences`, so the tokens (and `rollout_log_probs`) are identical. When
they would share that one call anyway (the trainer's case), `run_batch` makes it and builds the rows at once.
Layer 5: must not import Ray.
"""

from __future__ import annotations

from verl.protocol import DataProto
from verl.workers.rollout.async_engine import AsyncRolloutEngine, ModelRequest
from verl.workers.rollout.workflows.base import RolloutWorkflow, prompt_ids_of, single_turn_row, single_turn_rows


class RLVRWorkflow(RolloutWorkflow):
    """Single-turn reinforcement learning with verifiable rewards (AReaL's `RLVRWorkflow`, one sample per row:
    the trainer repeats each prompt `rollout.n` times before generation)."""

    async def arun_episode(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto:
        request = ModelRequest(input_ids=prompt_ids_of(data), gconfig=engine.default_gconfig())
        return single_turn_row(engine, data, await engine.agenerate(request))

    def run_batch(self, engine: AsyncRolloutEngine, data: DataProto) -> DataProto | None:
        """Every row's episode in one go: the same requests in one generate call, the rows built together (no
        coroutine, request future and one-row DataProto per row, whose cost grows with the rows). None
        when a subclass changes the episode or declares extra fields: its `arun_episode` runs row by row (checked)."""
        if type(self).arun_episode is not RLVRWorkflow.arun_episode or self.extra_output_keys:
            return None
        gconfig = engine.default_gconfig()
        ids, mask = data.batch["input_ids"], data.batch["attention_mask"].bool()
        requests = [ModelRequest(input_ids=row[keep].tolist(), gconfig=gconfig) for row, keep in zip(ids, mask)]
        return single_turn_rows(engine, data, engine.generate_all(requests))
