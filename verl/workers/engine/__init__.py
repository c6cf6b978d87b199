"""Training engines (verl 0.9.1's `verl.workers.engine`): one rank's model, optimizer and LR schedule behind
`train_batch` / `infer_batch` / `forward_backward_batch` with a caller's loss function, plus AReaL-lite's
`train_batch(data, loss_fn, loss_weight_fn)` over packed sequences. See `base.py` and `fsdp/transformer_impl.py`."""

from verl.workers.engine.base import BaseEngine, EngineRegistry
from verl.workers.engine.fsdp import FSDPEngine, FSDPEngineWithLMHead, FSDPEngineWithValueHead
from verl.workers.engine.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta

__all__ = [
    "BaseEngine",
    "EngineRegistry",
    "FSDPEngine",
    "FSDPEngineWithLMHead",
    "FSDPEngineWithValueHead",
    "FinetuneSpec",
    "SaveLoadMeta",
    "WeightUpdateMeta",
]
