"""Weight buckets for SGLang's `update_weights_from_tensor`, with fused parameter groups kept whole.

Owns `DEEPSEEK_V4_FUSION_GROUPS` (the name suffixes SGLang's DeepSeek-V4 loader fuses into one parameter, e.g.
`wq_a` + `wkv` -> `wqkv_a`: it concatenates both halves inside one `load_weights` call, so a bucket boundary between
them breaks the load), `named_tensor_buckets` (a stream of `(name, tensor)` pairs as buckets of at most
`bucket_bytes`, the members of a fusion group held back until the group is whole and then placed in one bucket) and
verl's async form of it, `get_named_tensor_buckets`. Grouping is opt-in: with no `fusion_groups` the pairs are only
cut by size. Layer 5: torch only.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator

import torch

__all__ = ["DEEPSEEK_V4_FUSION_GROUPS", "get_named_tensor_buckets", "named_tensor_buckets"]

Bucket = list[tuple[str, torch.Tensor]]
FusionGroups = tuple[tuple[str, ...], ...]

_DEEPSEEK_V4_FUSION_MEMBERS = (
    ("wq_a.weight", "wkv.weight"),
    ("wq_a.scale", "wkv.scale"),
    ("wq_a.weight_scale_inv", "wkv.weight_scale_inv"),
    ("compressor.wkv.weight", "compressor.wgate.weight"),
    ("indexer.compressor.wkv.weight", "indexer.compressor.wgate.weight"),
)
DEEPSEEK_V4_FUSION_GROUPS: FusionGroups = tuple(
    tuple(f".{attention}.{member}" for member in members)
    for attention in ("self_attn", "attn")
    for members in _DEEPSEEK_V4_FUSION_MEMBERS
)


def _fusion_key(name: str, groups: FusionGroups) -> tuple[str, int, int] | None:
    """(name without the member suffix, group index, group size) of a fusion-group member, else None."""
    matches = [
        (index, suffix, len(group)) for index, group in enumerate(groups) for suffix in group if name.endswith(suffix)
    ]
    if len(matches) > 1:
        raise ValueError(f"{name!r} matches more than one fusion group: {matches}")
    if not matches:
        return None
    index, suffix, size = matches[0]
    return name[: -len(suffix)], index, size


class _Packer:
    """The bucketing state: `add` returns the bucket an entry closed (or None), `finish` the last one."""

    def __init__(self, bucket_bytes: int, fusion_groups: FusionGroups):
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be greater than 0, got {bucket_bytes}")
        self.bucket_bytes, self.fusion_groups = bucket_bytes, fusion_groups
        self.bucket: Bucket = []
        self.size = 0
        self.staged: dict[tuple[str, int], list[tuple[str, torch.Tensor, int]]] = {}

    def add(self, name: str, tensor: torch.Tensor) -> Bucket | None:
        # a view would keep its whole base alive (and ship it) while it waits in a bucket: keep a compact copy
        entry = (name, tensor.clone() if tensor._base is not None else tensor, tensor.element_size() * tensor.numel())
        key = _fusion_key(name, self.fusion_groups)
        if key is None:
            run = [entry]
        else:
            prefix, index, members = key
            slot = self.staged.setdefault((prefix, index), [])
            slot.append(entry)
            if len(slot) < members:
                return None
            run = self.staged.pop((prefix, index))
        run_size = sum(size for _, _, size in run)
        closed = None
        if self.bucket and self.size + run_size > self.bucket_bytes:  # cut before the run, never inside it
            closed, self.bucket, self.size = self.bucket, [], 0
        self.bucket.extend((n, t) for n, t, _ in run)
        self.size += run_size
        return closed

    def finish(self) -> Bucket | None:
        if self.staged:
            raise ValueError(f"fused parameter groups never completed in this sync: {sorted(self.staged)}")
        return self.bucket or None


def named_tensor_buckets(
    weights: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int, fusion_groups: FusionGroups = ()
) -> Iterator[Bucket]:
    """`(name, tensor)` pairs as buckets of at most `bucket_bytes` (a larger tensor or fusion group travels alone),
    every fusion group's members in one bucket. ValueError at the end when a group was not complete."""
    packer = _Packer(bucket_bytes, fusion_groups)
    for name, tensor in weights:
        if (closed := packer.add(name, tensor)) is not None:
            yield closed
    if (last := packer.finish()) is not None:
        yield last


async def get_named_tensor_buckets(
    iterable: Iterable[tuple[str, torch.Tensor]] | AsyncIterable[tuple[str, torch.Tensor]],
    bucket_bytes: int,
    fusion_groups: FusionGroups = (),
) -> AsyncIterator[Bucket]:
    """`named_tensor_buckets` over a sync or async stream of pairs, as an async generator (verl's signature)."""
    packer = _Packer(bucket_bytes, fusion_groups)
    async for name, tensor in _as_async(iterable):
        if (closed := packer.add(name, tensor)) is not None:
            yield closed
    if (last := packer.finish()) is not None:
        yield last


async def _as_async(iterable: Iterable | AsyncIterable) -> AsyncIterator:
    if isinstance(iterable, AsyncIterable):
        async for item in iterable:
            yield item
    else:
        for item in iterable:
            yield item
