"""Environments for rollouts (verifiers-style) and the tools they run.

- `verl.envs.tools`: `@tool` registration of typed Python functions, `<tool_call>` parsing and execution;
- `verl.envs.openai_client`: `OpenAIClient`, the in-process OpenAI-compatible client over a rollout engine
  that records token ids and log-probs for training;
- `verl.envs.environment`: `Environment` (`rollout(client, prompt, answer, sampling_args)`), `Rubric`
  (weighted reward functions), `SingleTurnEnv`, `MultiTurnEnv`, `ToolEnv`;
- `verl.envs.gsm8k`: `GSM8KEnv`, a concrete environment.

Layer 5 (beside the rollout engines): must not import Ray or the trainer.
"""

from verl.envs.environment import Environment, EnvResult, MultiTurnEnv, Rubric, SingleTurnEnv, ToolEnv
from verl.envs.openai_client import OpenAIClient, Trajectory
from verl.envs.tools import DEFAULT_REGISTRY, ToolRegistry, tool

__all__ = [
    "DEFAULT_REGISTRY",
    "EnvResult",
    "Environment",
    "MultiTurnEnv",
    "OpenAIClient",
    "Rubric",
    "SingleTurnEnv",
    "ToolEnv",
    "ToolRegistry",
    "Trajectory",
    "tool",
]
