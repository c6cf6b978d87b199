"""Where a model comes from, as verl's config names it: its location and the HF config fields the config overrides.

Owns:
- `resolve_model_path(path, key)`: a local folder, or a Hugging Face hub id (`Qwen/Qwen2.5-7B-Instruct`) that must
  already be in the local Hugging Face cache (nothing is downloaded here) -> a local folder;
- `resolve_model_paths(config, keys)`: the model locations a run uses, rewritten in place before the workers
  start, so every process reads a folder;
- `override_model_config(hf_config, override_config, key)`: verl's `model.override_config` applied to the HF
  config a model is built from.
Layer 1: imports huggingface_hub only when a path is not a local folder; no torch, Ray or other verl code.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

from omegaconf import OmegaConf, open_dict

__all__ = ["override_model_config", "resolve_model_path", "resolve_model_paths"]


def resolve_model_path(path: str, key: str) -> str:
    """`path` itself when it is a local folder (`~` expanded), else the cached snapshot folder of the hub id `path`.

    Raises FileNotFoundError naming `key` and `path` when it is neither (a missing folder, an HDFS path, a hub id
    not in the local cache)."""
    local = os.path.expanduser(str(path))
    if os.path.isdir(local):
        return local
    if local.startswith(("/", ".", "hdfs://")):
        raise FileNotFoundError(
            f"{key}={path!r}: no such folder (an HF model folder, or a hub id in the local Hugging Face cache, is "
            "needed; nothing is downloaded here)"
        )
    from huggingface_hub import constants, snapshot_download

    try:
        return snapshot_download(repo_id=local, local_files_only=True)
    except Exception as err:  # not in the cache, or not a valid repo id
        raise FileNotFoundError(
            f"{key}={path!r} is neither a local folder nor a model in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); nothing is downloaded here: fetch it where there is internet "
            f"(`huggingface-cli download {local}`) or pass a folder ({type(err).__name__})"
        ) from err


def resolve_model_paths(config: Any, keys: Iterable[str]) -> None:
    """Set each of `keys` (dotted config paths; null ones skipped) to its `resolve_model_path`, in place: a hub id
    becomes its cached folder, a folder stays as it is. FileNotFoundError as `resolve_model_path`."""
    for key in keys:
        value = OmegaConf.select(config, key, default=None)
        if not value:
            continue
        resolved = resolve_model_path(value, key)
        if resolved != value:
            with open_dict(config):
                OmegaConf.update(config, key, resolved, merge=False)


def override_model_config(hf_config: Any, override_config: Any, key: str = "model.override_config") -> None:
    """Set the fields of `override_config` on `hf_config` in place, as verl does: its `model_config` entry when it has
    one, else the whole mapping; a mapping value updates the sub-config of that name (e.g. `text_config`), or
    replaces a plain dict field (e.g. `rope_scaling`). A field the HF config lacks is added, as verl does."""
    if OmegaConf.is_config(override_config):
        override_config = OmegaConf.to_container(override_config, resolve=True)
    if not override_config:
        return
    if not isinstance(override_config, dict):
        raise ValueError(f"{key}={override_config!r} must be a mapping of HF config fields")
    _set_fields(hf_config, override_config.get("model_config", override_config))


def _set_fields(target: Any, fields: dict) -> None:
    for name, value in fields.items():
        current = getattr(target, name, None)
        if isinstance(value, dict) and current is not None and hasattr(current, "to_dict"):  # a sub-config
            _set_fields(current, value)
        else:
            setattr(target, name, value)
