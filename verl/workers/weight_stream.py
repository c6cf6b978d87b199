"""Async mode's weight transfer between two worker groups, one bucket at a time (no full-model copy anywhere).

`BucketExporter.next_bucket()` (actor side, a collective) gathers the next bucket of at most
`update_weights_bucket_megabytes` and returns it on rank 0 as CPU tensors (`[]` once the stream is over);
`BucketLoader` (rollout side) feeds `put(bucket)` into the engine's `update_weights(stream)` on a thread (`begin`,
`finish` re-raises the engine's error). The driver moves one bucket at a time. Layer 5 helper: no Ray.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from verl.workers.weight_sync import SyncMode, actor_weight_buckets

__all__ = ["BucketExporter", "BucketLoader"]

_END = object()


class BucketExporter:
    """The actor's weights (`mode`: full, adapters or merged; see `verl.workers.weight_sync`) as CPU buckets of at
    most `bucket_bytes`, kept by the rank where `keep` (rank 0)."""

    def __init__(self, module: nn.Module, mode: SyncMode, bucket_bytes: int, keep: bool):
        self.module, self.mode, self.bucket_bytes, self.keep = module, mode, int(bucket_bytes), keep
        self._stream: Iterator[list] | None = None

    def next_bucket(self) -> list[tuple[str, torch.Tensor]] | None:
        """The next bucket (where `keep`; None elsewhere), `[]` on every rank at the end of the stream. Collective."""
        if self._stream is None:
            self._stream = iter(actor_weight_buckets(self.module, self.bucket_bytes, None, self.mode))
        bucket = next(self._stream, None)
        if bucket is None:
            self._stream = None
            return []
        if not self.keep:
            return None
        return [(name, tensor.to("cpu", copy=True)) for name, tensor in bucket]


class BucketLoader:
    """Feeds buckets handed over one call at a time to `rollout.update_weights(stream)` running on a thread."""

    def __init__(self, rollout: Any):
        self.rollout = rollout
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._ended = False

    def begin(self) -> None:
        if self._thread is not None:
            raise RuntimeError("a weight stream is already open on this rollout worker; finish() it first")
        self._error, self._ended = None, False
        self._thread = threading.Thread(target=self._load, name="verl-weight-stream", daemon=True)
        self._thread.start()

    def _stream(self) -> Iterator[list]:
        while True:
            bucket = self._queue.get()
            if bucket is _END:
                self._ended = True
                self._queue.task_done()
                return
            yield bucket
            del bucket
            self._queue.task_done()  # the engine asked for the next bucket: this one is loaded

    def _load(self) -> None:
        try:
            self.rollout.update_weights(self._stream())
        except BaseException as err:  # re-raised by put/finish on the worker's own thread
            self._error = err
            while not self._ended:  # let the producer go: drain what is left, up to the end marker
                self._ended = self._queue.get() is _END
                self._queue.task_done()

    def put(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
        """Hand one bucket to the engine; returns when it is loaded."""
        if self._thread is None:
            raise RuntimeError("put() before begin(): no weight stream is open")
        self._queue.put(list(bucket))
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks and self._error is None:
                self._queue.all_tasks_done.wait(timeout=0.1)

    def finish(self) -> None:
        """End the stream; raises what the engine raised while loading."""
        if self._thread is None:
            raise RuntimeError("finish() before begin(): no weight stream is open")
        self._queue.put(_END)
        self._thread.join()
        self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error
