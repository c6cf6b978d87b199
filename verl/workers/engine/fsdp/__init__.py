"""The FSDP2 training engines (verl's import path `verl.workers.engine.fsdp`)."""

from verl.workers.engine.fsdp.transformer_impl import FSDPEngine, FSDPEngineWithLMHead, FSDPEngineWithValueHead

__all__ = ["FSDPEngine", "FSDPEngineWithLMHead", "FSDPEngineWithValueHead"]
