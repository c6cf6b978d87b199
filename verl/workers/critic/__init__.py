"""Critics without Ray: `DataParallelPPOCritic` predicts response values and runs the value-function update."""

from verl.workers.critic.dp_critic import DataParallelPPOCritic

__all__ = ["DataParallelPPOCritic"]
