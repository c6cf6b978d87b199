"""One config object for a training engine: `engine_sections(...)` gives the four sections `FSDPEngine` takes.

Reads verl's sections (`model`, `optim`, `fsdp_config`, `checkpoint`, or an `actor` holding them) or AReaL's
`TrainEngineConfig` (`path`, `dtype`, `optimizer`, `fsdp`, LoRA keys, ... translated to verl's keys; no AReaL
defaults), or a mix. An unknown key, a value set twice or a section given both ways is a ValueError naming it.
Layer 1-like: omegaconf only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from omegaconf import DictConfig, OmegaConf

__all__ = ["engine_sections", "is_engine_config"]

SECTIONS = ("model", "optim", "fsdp_config", "checkpoint", "actor")
# AReaL's top-level keys: (section, verl key) they land in; None = not read
AREAL_KEYS = {
    "path": ("model", "path"),
    "attn_impl": ("model", "attn_implementation"),
    "gradient_checkpointing": ("model", "enable_gradient_checkpointing"),
    "use_lora": ("model", None),  # lora_rank is kept only when use_lora is true
    "lora_rank": ("model", "lora_rank"),
    "lora_alpha": ("model", "lora_alpha"),
    "target_modules": ("model", "target_modules"),
    "dtype": ("fsdp_config", "model_dtype"),
    "experiment_name": (None, None),
    "trial_name": (None, None),
}
AREAL_OPTIMIZER = {
    "lr": "lr", "weight_decay": "weight_decay", "eps": "eps", "min_lr_ratio": "min_lr_ratio",
    "lr_scheduler_type": "lr_scheduler_type", "warmup_steps_proportion": "lr_warmup_steps_ratio",
    "gradient_clipping": "clip_grad", "beta1": None, "beta2": None, "type": None, "offload": None,
}  # fmt: skip
AREAL_FSDP = {"wrap_policy": "wrap_policy", "offload_params": "param_offload"}
# keys that only a whole config has (never a verl `model` section)
_MARKERS = {*SECTIONS, "optimizer", "fsdp", *AREAL_KEYS} - {"path", "lora_rank", "lora_alpha", "target_modules"}


def _plain(config: Any, where: str, keep_none: bool = False) -> dict[str, Any]:
    """`config` as a plain dict (DictConfig, dataclass or mapping), None values left out unless `keep_none`."""
    if isinstance(config, DictConfig):
        config = OmegaConf.to_container(config, resolve=True)
    elif dataclasses.is_dataclass(config) and not isinstance(config, type):
        config = dataclasses.asdict(config)
    if not isinstance(config, Mapping):
        raise TypeError(f"{where} must be a DictConfig, dataclass or mapping, got {type(config).__name__}")
    return {str(key): value for key, value in config.items() if keep_none or value is not None}


def is_engine_config(config: Any) -> bool:
    """Whether `config` is a whole engine config rather than a verl `model` section: a dataclass, or a mapping with
    a section (`optim`, `optimizer`, `fsdp_config`, ...) or an AReaL-only key (`gradient_checkpointing`, `dtype`...)."""
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        return True
    return isinstance(config, Mapping | DictConfig) and any(str(key) in _MARKERS for key in config)


def _put(out: dict[str, dict], section: str, key: str, value: Any, source: str) -> None:
    if key in out[section] and out[section][key] != value:
        raise ValueError(f"engine config sets {section}.{key} twice ({source} and {section}.{key}); give it once")
    out[section][key] = value


def _translate(values: dict[str, Any], names: dict[str, str | None], where: str) -> dict[str, Any]:
    """`values` under verl's names by `names`; a key outside `names` raises ValueError."""
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"engine config {where} has unknown keys {unknown}; allowed: {sorted(names)}")
    return {names[key]: value for key, value in values.items() if names[key] is not None}


def _areal_optimizer(values: dict[str, Any], out: dict[str, dict]) -> None:
    if str(values.get("type", "adam")).lower() not in ("adam", "adamw"):
        raise ValueError(f"engine config optimizer.type={values['type']!r}; allowed: adam (AdamW)")
    for key, value in _translate(values, AREAL_OPTIMIZER, "optimizer").items():
        _put(out, "optim", key, value, f"optimizer.{key}")
    if "beta1" in values or "beta2" in values:
        _put(out, "optim", "betas", [values.get("beta1", 0.9), values.get("beta2", 0.999)], "optimizer.beta*")
    if "offload" in values:
        _put(out, "fsdp_config", "optimizer_offload", bool(values["offload"]), "optimizer.offload")


def engine_sections(config: Any, *sections: Any) -> tuple[Any, Any, Any, Any]:
    """The (model, fsdp_config, optim, checkpoint) sections an engine gets: `sections` as given (FSDPEngine's four
    positional arguments), or those of one whole `config` (given alone, or as the only section when
    `is_engine_config`); see the module docstring."""
    sections = (*sections, None, None, None, None)[:4]
    if config is None and all(s is None for s in sections[1:]) and is_engine_config(sections[0]):
        config, sections = sections[0], (None,) * 4  # FSDPEngine(cfg): one whole config, positionally
    if config is None:
        return sections
    if any(s is not None for s in sections):
        raise TypeError("give the engine config=... alone, or its sections (model_config, engine_config, ...)")
    values = _plain(config, "engine config")
    unknown = sorted(set(values) - {*SECTIONS, "optimizer", "fsdp", *AREAL_KEYS})
    if unknown:
        raise ValueError(
            f"engine config has unknown keys/sections {unknown}; allowed sections: {[*SECTIONS, 'optimizer', 'fsdp']}, "
            f"AReaL keys: {sorted(AREAL_KEYS)}"
        )
    actor = _plain(values.pop("actor", {}), "engine config actor")
    out: dict[str, dict] = {}
    for name in SECTIONS[:-1]:
        if name in values and name in actor:
            raise ValueError(f"engine config has both {name} and actor.{name}; give it once")
        out[name] = _plain(values.get(name, actor.get(name, {})), f"engine config {name}", keep_none=True)
    if "optimizer" in values:
        if "optim" in values or "optim" in actor:
            raise ValueError("engine config has both optim (verl's keys) and optimizer (AReaL's keys); give one")
        _areal_optimizer(_plain(values["optimizer"], "engine config optimizer"), out)
    for key, value in _translate(_plain(values.get("fsdp", {}), "engine config fsdp"), AREAL_FSDP, "fsdp").items():
        _put(out, "fsdp_config", key, value, f"fsdp.{key}")
    for key, (section, target) in AREAL_KEYS.items():
        if key in values and target is not None:
            _put(out, section, target, values[key], key)
    if "use_lora" in values and not values["use_lora"]:
        out["model"]["lora_rank"] = 0
    return out["model"], out["fsdp_config"], out["optim"], out["checkpoint"]
