"""Checkpoint I/O for training state (model, optimizer, LR scheduler, RNG): `FSDPCheckpointManager`."""

from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

__all__ = ["FSDPCheckpointManager"]
