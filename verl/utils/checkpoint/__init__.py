"""Checkpoint I/O for training state (model, optimizer, LR scheduler, RNG): `FSDPCheckpointManager`, built on
verl's `checkpoint_manager.BaseCheckpointManager` (what to save and load, LoRA-only state dicts, retention).

The manager (FSDP2, torch.distributed.checkpoint) is imported on first use of the name, so that importing
`verl.utils.checkpoint.errors` from the driver does not load it."""

__all__ = ["FSDPCheckpointManager"]


def __getattr__(name: str):
    if name == "FSDPCheckpointManager":
        from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

        return FSDPCheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
