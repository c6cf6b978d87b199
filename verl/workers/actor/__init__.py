"""Actors without Ray: `DataParallelPPOActor` computes response log-probs and runs the PPO policy update."""

from verl.workers.actor.dp_actor import DataParallelPPOActor

__all__ = ["DataParallelPPOActor"]
