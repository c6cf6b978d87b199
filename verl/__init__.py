"""verl-style reinforcement-learning trainer for language models (PPO, GRPO, RLOO, ReMax, REINFORCE++).

Runs on one CPU (gloo) or on a Ray cluster of GPUs (nccl, vLLM) with the same code. Layers and the
data flow of one step are described in docs/architecture.md (#layers, #one-training-step); the user-facing entry is `python -m verl.trainer.main_ppo`.
"""

__version__ = "0.1.0"

from verl.utils.tensordict_import import import_tensordict  # noqa: E402

import_tensordict()  # before anything imports tensordict: its torch.compile marks wait for torch._dynamo

from verl.protocol import DataProto  # noqa: E402,F401
