"""Merge the per-rank FSDP2 model shards of a checkpoint into one HF model folder (`save_pretrained` + tokenizer).

    python -m verl.model_merger [merge --backend fsdp] --local_dir <ckpt>/actor --target_dir <out>
        [--hf_model_path <base>] [--overwrite]

Reads `model_world_size_{W}_rank_{r}.pt` (dim-0 shards, concatenated in rank order); config and tokenizer come from
`--hf_model_path` or `<local_dir>/huggingface`. Writes to a temporary sibling and renames; bad input prints one
`error: ...` line and exits 1 without writing. No Ray.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys

import torch

__all__ = ["find_model_shards", "load_merged_state_dict", "merge_checkpoint", "merge_shards", "main"]

_SHARD_RE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")


class MergeError(Exception):
    """A problem with the inputs of a merge; the CLI prints it as one `error: ...` line."""


def find_model_shards(local_dir: str) -> list[str]:
    """Paths of `model_world_size_{W}_rank_{r}.pt` in `local_dir`, in rank order 0..W-1.

    Raises MergeError naming the folder when it is missing, holds no shard file, mixes world sizes, or lacks ranks.
    """
    if not os.path.isdir(local_dir):
        raise MergeError(f"checkpoint folder {local_dir!r} does not exist or is not a directory")
    found = {name: _SHARD_RE.match(name) for name in sorted(os.listdir(local_dir))}
    shards = {name: (int(m.group(1)), int(m.group(2))) for name, m in found.items() if m}
    if not shards:
        present = sorted(found) or "nothing"
        raise MergeError(
            f"no model_world_size_*_rank_*.pt files in {local_dir!r}; found: {present} "
            "(pass the folder FSDPCheckpointManager saved into, e.g. <ckpt>/actor)"
        )
    world_sizes = sorted({w for w, _ in shards.values()})
    if len(world_sizes) > 1:
        raise MergeError(f"model shards in {local_dir!r} mix world sizes {world_sizes}: {sorted(shards)}")
    world_size = world_sizes[0]
    ranks = {r for _, r in shards.values()}
    missing = sorted(set(range(world_size)) - ranks)
    extra = sorted(ranks - set(range(world_size)))
    if missing or extra:
        raise MergeError(
            f"model shards in {local_dir!r} for world size {world_size} lack ranks {missing}"
            f"{f' and have out-of-range ranks {extra}' if extra else ''}; found: {sorted(shards)}"
        )
    return [os.path.join(local_dir, f"model_world_size_{world_size}_rank_{r}.pt") for r in range(world_size)]


def merge_shards(shards: list[dict[str, torch.Tensor]], full_shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Full tensors from per-rank local shards.

    `shards[r]` is rank r's `{name: local tensor}`; `full_shapes` the model's `{name: full shape}`. A tensor whose
    rank pieces add up to the full shape along dim 0 is concatenated in rank order (FSDP2 `Shard(0)`, uneven
    chunks included); one that every rank holds whole (a replicated tensor) is taken from rank 0.
    """
    keys = set(shards[0])
    for rank, shard in enumerate(shards):
        if set(shard) != keys:
            diff = sorted(set(shard) ^ keys)
            raise MergeError(f"rank {rank} shard has different tensor names from rank 0: {diff[:5]}")
    missing, unexpected = sorted(set(full_shapes) - keys), sorted(keys - set(full_shapes))
    if missing or unexpected:
        raise MergeError(f"checkpoint does not match the model config: missing {missing}, unexpected {unexpected}")
    merged = {}
    for name in sorted(keys):
        pieces = [shard[name] for shard in shards]
        full = tuple(full_shapes[name])
        shapes = [tuple(p.shape) for p in pieces]
        if len(pieces) == 1:
            merged[name] = pieces[0]
        elif full and all(s[1:] == full[1:] for s in shapes) and sum(s[0] for s in shapes) == full[0]:
            merged[name] = torch.cat(pieces, dim=0)
        elif all(s == full for s in shapes):
            merged[name] = pieces[0]
        else:
            raise MergeError(f"cannot merge {name!r}: rank shapes {shapes} do not make the full shape {full}")
        if tuple(merged[name].shape) != full:
            raise MergeError(f"merged {name!r} has shape {tuple(merged[name].shape)}, the model expects {full}")
    return merged


def _config_dir(local_dir: str, hf_model_path: str | None) -> str:
    candidate = hf_model_path or os.path.join(local_dir, "huggingface")
    if not os.path.isfile(os.path.join(candidate, "config.json")):
        where = "--hf_model_path" if hf_model_path else "the checkpoint's huggingface/ folder"
        raise MergeError(
            f"no config.json in {candidate!r} ({where}); pass --hf_model_path <base model folder with config + tokenizer>"
        )
    return candidate


def _meta_model(config) -> torch.nn.Module:
    """A weightless (meta-device) model of the class named in `config.architectures`, else AutoModelForCausalLM's."""
    import transformers

    classes = [getattr(transformers, name, None) for name in getattr(config, "architectures", None) or []]
    cls = next((c for c in classes if c is not None), None)
    with torch.device("meta"):
        return cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)


def load_merged_state_dict(local_dir: str, config) -> dict[str, torch.Tensor]:
    """`{name: full tensor}` of the checkpoint in `local_dir`, checked against a model built from `config`."""
    paths = find_model_shards(local_dir)
    full_shapes = {name: t.shape for name, t in _meta_model(config).state_dict().items()}
    return merge_shards([_load_shard(p) for p in paths], full_shapes)


def _load_shard(path: str) -> dict[str, torch.Tensor]:
    """One rank's shard file; MergeError naming it when it is not a readable torch file of tensors."""
    try:
        shard = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated/corrupt file raises RuntimeError, UnpicklingError, EOFError, ...
        raise MergeError(f"cannot read shard {path!r} ({type(err).__name__}: {str(err).splitlines()[0]})") from err
    if not isinstance(shard, dict) or not all(isinstance(v, torch.Tensor) for v in shard.values()):
        raise MergeError(f"shard {path!r} holds a {type(shard).__name__}, not a dict of tensors")
    return shard


def _check_target(target_dir: str, overwrite: bool) -> None:
    if os.path.isfile(target_dir):
        raise MergeError(f"target {target_dir!r} is a file; give a folder path")
    if os.path.isdir(target_dir) and os.listdir(target_dir) and not overwrite:
        raise MergeError(f"target folder {target_dir!r} is not empty; pass --overwrite to replace it")


_NOT_COPIED = ("config.json", "generation_config.json", "model.safetensors.index.json", "pytorch_model.bin.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack")


def _copy_tokenizer_files(config_dir: str, out_dir: str) -> None:
    """Copy the tokenizer (and any other non-weight, non-config file) verbatim, so it reloads exactly as saved."""
    for name in sorted(os.listdir(config_dir)):
        src = os.path.join(config_dir, name)
        if os.path.isfile(src) and name not in _NOT_COPIED and not name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(src, os.path.join(out_dir, name))


def _write_model(tmp_dir: str, config_dir: str, config, state_dict: dict[str, torch.Tensor]) -> None:
    from transformers import GenerationConfig

    model = _meta_model(config)
    model.load_state_dict(state_dict, assign=True, strict=True)
    model.tie_weights()
    if os.path.isfile(os.path.join(config_dir, "generation_config.json")):
        model.generation_config = GenerationConfig.from_pretrained(config_dir)
    model.save_pretrained(tmp_dir, state_dict=state_dict)
    _copy_tokenizer_files(config_dir, tmp_dir)


def merge_checkpoint(local_dir: str, target_dir: str, hf_model_path: str | None = None, overwrite: bool = False) -> str:
    """Write the merged HF model + tokenizer of the FSDP checkpoint `local_dir` to `target_dir`; returns it.

    Every check runs before anything is written; the folder appears under `target_dir` only when complete.
    """
    from transformers import AutoConfig

    target_dir = os.path.abspath(target_dir)
    _check_target(target_dir, overwrite)
    find_model_shards(local_dir)  # fail on the shard layout before reading any config
    config_dir = _config_dir(local_dir, hf_model_path)
    config = AutoConfig.from_pretrained(config_dir)
    state_dict = load_merged_state_dict(local_dir, config)

    tmp_dir = f"{target_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    try:
        _write_model(tmp_dir, config_dir, config, state_dict)
        if os.path.exists(target_dir):
            old_dir = f"{target_dir}.old-{os.getpid()}"
            os.rename(target_dir, old_dir)
            os.rename(tmp_dir, target_dir)
            shutil.rmtree(old_dir)
        else:
            os.rename(tmp_dir, target_dir)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)
    return target_dir


def _parse_args(argv: list[str]) -> argparse.Namespace:
    if argv and argv[0] == "merge":  # verl's subcommand form
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        prog="python -m verl.model_merger", description="Merge FSDP checkpoint shards into a HF model folder."
    )
    parser.add_argument("--backend", default="fsdp", choices=["fsdp"], help="checkpoint format (only fsdp)")
    parser.add_argument("--local_dir", required=True, help="folder with model_world_size_*_rank_*.pt")
    parser.add_argument("--target_dir", required=True, help="output folder for save_pretrained")
    parser.add_argument(
        "--hf_model_path", default=None, help="folder with config + tokenizer (default: local_dir/huggingface)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty target_dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(sys.argv[1:] if argv is None else argv)
    try:
        out = merge_checkpoint(args.local_dir, args.target_dir, args.hf_model_path, args.overwrite)
    except (MergeError, OSError, ValueError) as err:
        print(f"error: {' '.join(str(err).split())}", file=sys.stderr)
        return 1
    print(f"merged {args.local_dir} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
