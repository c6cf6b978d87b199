"""verl's `SingleTurnAgentLoop` ("single_turn_agent", `rollout.agent.default_agent_loop`'s default): one chat
completion per sample.

The prompt is the chat template over the sample's `raw_prompt` (with the generation prompt, cut on the left to
`rollout.prompt_length`); the model's tokens are the response (mask 1, cut to `rollout.response_length`);
`num_turns` is 2 and `extra_fields` carries the server's extra fields plus empty `turn_scores` and
`tool_rewards`, so that its rows have the same fields as the tool loop's.

Layer 1 (utilities): `verl.experimental.agent_loop.agent_loop` only; the server manager is passed in.
"""

from __future__ import annotations

from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register, timed

__all__ = ["SingleTurnAgentLoop"]


@register("single_turn_agent")
class SingleTurnAgentLoop(AgentLoopBase):
    """One generation per sample (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.prompt_length = self.rollout_config.prompt_length
        self.response_length = self.rollout_config.response_length

    async def run(self, sampling_params: dict[str, Any], priority: int = 0, **kwargs: Any) -> AgentLoopOutput:
        messages = list(kwargs["raw_prompt"])
        await self.process_multi_modal_info(messages)  # refuses image/video/audio parts
        prompt_ids = await self.ct_build_initial_tokens(messages)
        metrics: dict[str, Any] = {}
        with timed("generate_sequences", metrics):
            full_determinism = bool(self.rollout_config.get("full_determinism", False))
            output = await self.server_manager.generate(
                request_id=f"det-{int(priority)}" if full_determinism else uuid4().hex,
                prompt_ids=prompt_ids,
                sampling_params=sampling_params,
                image_data=None,
            )
        metrics["num_preempted"] = output.num_preempted if output.num_preempted is not None else -1
        merged, response_mask, response_logprobs = await self.ct_merge_assistant_token(
            prompt_ids, output.token_ids, [], [] if output.log_probs else None,
            assistant_logprobs=output.log_probs if output.log_probs else None,
        )  # fmt: skip
        n = len(response_mask)
        result = AgentLoopOutput(
            prompt_ids=merged.token_ids[: len(merged.token_ids) - n],
            response_ids=merged.token_ids[len(merged.token_ids) - n :][: self.response_length],
            response_mask=response_mask[: self.response_length],
            response_logprobs=response_logprobs[: self.response_length] if response_logprobs else None,
            multi_modal_data={},
            num_turns=2,
            metrics=metrics,
            extra_fields=dict(output.extra_fields),
        )
        result.extra_fields.update({"turn_scores": [], "tool_rewards": []})
        return result
