"""Errors of checkpoint I/O that the driver handles: `NonFiniteWeightsError` (also importable from
`verl.utils.checkpoint.fsdp_checkpoint_manager`, which raises it). A module of its own so that the driver can
catch it without importing the checkpoint manager's FSDP2 and torch.distributed.checkpoint stack."""


class NonFiniteWeightsError(ValueError):
    """The model holds NaN/inf weights; such a state is never saved as a checkpoint."""
