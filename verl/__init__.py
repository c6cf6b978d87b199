"""verl-style reinforcement-learning trainer for language models (PPO, GRPO, RLOO, ReMax, REINFORCE++).

Runs on one CPU (gloo) or on a Ray cluster of GPUs (nccl, vLLM) with the same code. Layers and the
data flow of one step are described in DESIGN.md; the user-facing entry is `python -m verl.trainer.main_ppo`.
"""

__version__ = "0.1.0"

from verl.protocol import DataProto  # noqa: E402,F401
