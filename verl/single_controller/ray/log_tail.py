"""Worker output in the driver's console for a local Ray session, without Ray's log monitor: `WorkerLogTail` tails
the session's worker and raylet/GCS error files in a driver thread and prints `(ActorName pid=N) line` as Ray does,
skipping Ray's marker lines. Layer 6: standard library only.
"""

from __future__ import annotations

import glob
import os
import re
import sys
import threading

MARKERS = (":job_id:", ":actor_name:", ":task_name:")
_WORKER_FILE = re.compile(r"worker-[0-9a-f]+-([0-9a-f]+)-(\d+)\.(out|err)$")


class _TailedFile:
    """One log file: how far it was read, the unfinished last line, and how its lines are prefixed."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = b""
        name = os.path.basename(path)
        match = _WORKER_FILE.match(name)
        self.is_err = name.endswith(".err")
        self.pid = match.group(2) if match else None
        self.source = None if match else name.split("_")[0].split(".")[0]  # "raylet", "gcs": Ray's own processes
        self.actor_name: str | None = None
        self.task_name: str | None = None

    def prefix(self) -> str:
        if self.source is not None:
            return f"({self.source}) "
        name = self.actor_name or self.task_name
        return f"({name} pid={self.pid}) " if name else f"(pid={self.pid}) "

    def read_lines(self) -> list[str]:
        """New complete lines since the last call (a file that shrank was rotated or truncated: read it anew)."""
        try:
            size = os.path.getsize(self.path)
            if size < self.offset:
                self.offset, self.partial = 0, b""
            if size == self.offset:
                return []
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError:  # removed between the listing and the read
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [line.decode("utf-8", "replace").rstrip("\r") for line in lines]

    def flush_partial(self) -> list[str]:
        """The last line of a file whose writer has ended without a newline."""
        line, self.partial = self.partial, b""
        return [line.decode("utf-8", "replace").rstrip("\r")] if line else []


class WorkerLogTail:
    """Tail `logs_dir`'s worker, raylet and GCS error files in a daemon thread; print new lines with Ray's
    prefixes to this process's stdout (`.out` files) and stderr (`.err` files). `stop()` prints what is left."""

    def __init__(self, logs_dir: str, interval_s: float = 1.0):
        self.logs_dir = logs_dir
        self.interval_s = interval_s
        self._files: dict[str, _TailedFile] = {}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="verl-worker-log-tail", daemon=True)

    def start(self) -> WorkerLogTail:
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread after one last read of every file, so nothing a worker wrote before is lost."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.poll(final=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.poll()

    def _paths(self) -> list[str]:
        patterns = ("worker-*.out", "worker-*.err", "raylet*.err", "gcs_server*.err")
        return sorted(p for pattern in patterns for p in glob.glob(os.path.join(self.logs_dir, pattern)))

    def poll(self, final: bool = False) -> None:
        """Read every file once and print its new lines (the thread calls this every `interval_s`)."""
        with self._lock:
            for path in self._paths():
                tailed = self._files.setdefault(path, _TailedFile(path))
                lines = tailed.read_lines() + (tailed.flush_partial() if final else [])
                self._print(tailed, lines)

    @staticmethod
    def _print(tailed: _TailedFile, lines: list[str]) -> None:
        out = []
        for line in lines:
            if line.startswith(":actor_name:"):
                tailed.actor_name, tailed.task_name = line[len(":actor_name:") :], None
            elif line.startswith(":task_name:"):
                tailed.task_name = line[len(":task_name:") :]
            elif not line.startswith(MARKERS):
                out.append(tailed.prefix() + line)
        if out:
            stream = sys.stderr if tailed.is_err else sys.stdout
            print("\n".join(out), file=stream, flush=True)
