"""Peak memory of a process tree, for the benchmark: RSS summed over processes, and PSS.

Owns `TreeMemory` (a sampling thread) and `process_kind` (driver / workers / Ray's daemons). Summing RSS over
processes counts every shared page (torch's libraries mapped by the driver and the worker, Ray's shared object
store) once per process that maps it; PSS (proportional set size, from /proc/<pid>/smaps_rollup) splits each
shared page among the processes that map it, so the sum of PSS over a tree is the physical memory the tree uses.
For a single process the two differ only by pages shared with processes outside the tree. Both are reported.
"""

from __future__ import annotations

import os
import threading

RAY_DAEMONS = (
    "gcs_server", "raylet", "dashboard", "DashboardAgent", "log_monitor", "monitor.py", "runtime_env",
    "RuntimeEnvAgent", "ray_client",
)  # fmt: skip


def process_kind(is_root: bool, cmd: str) -> str:
    """`driver` for the root, `ray daemons` for Ray's own processes and idle workers, else `workers`."""
    if is_root:
        return "driver"
    if "ray::IDLE" in cmd or any(d in cmd for d in RAY_DAEMONS) or "ray::" not in cmd:
        return "ray daemons"
    return "workers"


def process_name(cmd: str) -> str:
    """A short name for a command line: the Ray daemon it runs, `ray::<actor class>` for a Ray worker (its
    command line changes with the task it runs), else the program's file name. The raylet and GCS are named by
    their executable (the raylet's arguments hold the agents' command lines), the two agents by their script or
    process title (their arguments name the raylet)."""
    words = cmd.split()
    program = os.path.basename(words[0]) if words else ""
    if program in ("raylet", "gcs_server"):
        return program
    if "DashboardAgent" in cmd or "dashboard/agent.py" in cmd:
        return "dashboard_agent"
    if "RuntimeEnvAgent" in cmd or "runtime_env/agent/main.py" in cmd:
        return "runtime_env_agent"
    daemon = next((d for d in RAY_DAEMONS if d in cmd), None)
    if daemon:
        return daemon.removesuffix(".py")
    ray_word = next((w for w in words if w.startswith("ray::")), None)
    if ray_word:
        return ray_word.split(".")[0]
    return os.path.basename(words[0]) if words else "?"


def identity(is_root: bool, cmd: str, seen: tuple[str, str]) -> tuple[str, str]:
    """(kind, name) of a process whose command line now reads `cmd`, given the (kind, name) it was last given
    (`("", "")` or a kind with an empty name when first seen).

    The name follows the command line while it changes: a daemon caught between fork and exec still shows the
    driver's command line, and a Ray worker starts as `python default_worker.py`, becomes `ray::IDLE`, then an
    actor. Two things are kept: an actor stays a worker (kind "workers", its class name) for good, and a command
    line that has emptied (the process is exiting) changes nothing."""
    if not cmd:
        return seen
    kind = process_kind(is_root, cmd)
    if seen[0] == "workers" and kind != "workers" and seen[1]:
        return seen
    return kind, ("driver" if kind == "driver" else process_name(cmd))


class TreeMemory:
    """Samples the RSS of a process and all its descendants every `interval` s, and their PSS every
    `pss_every`-th sample; keeps the peaks.

    `peak_mb` / `peak_pss_mb`: the whole tree. `peak_work_mb`: the driver and the processes doing the work, i.e.
    the tree less Ray's own daemons (gcs_server, raylet, dashboard, log monitor) and idle pre-started workers.
    `peak_by_kind`: RSS per process kind, each at its own peak. `peak_by_process`: pid -> (kind, name, peak RSS MB)
    of every process seen, the name being its command line's first word (a Ray worker's `ray::<actor class>`).

    The sampler must not slow what it measures. RSS (/proc/<pid>/statm) is a counter read; listing the tree and
    reading command lines scan /proc, and PSS (/proc/<pid>/smaps_rollup) walks each process's page tables under
    its memory-map lock, which a worker faulting in new memory then waits on. So the tree is listed and its PSS
    read on every `pss_every`-th sample only (every 1 s by default; a process started in between is counted from
    then on), RSS on every one.
    """

    def __init__(self, pid: int, interval: float = 0.2, pss_every: int = 5):
        self.pid, self.interval, self.pss_every = pid, interval, max(1, pss_every)
        self.peak_mb = self.peak_work_mb = self.peak_pss_mb = 0.0
        self.peak_by_kind: dict[str, float] = {}
        self.peak_by_process: dict[int, tuple[str, str, float]] = {}  # pid -> (kind, name, peak RSS MB)
        self._procs: list = []  # the tree as last listed
        self._kinds: dict[int, str] = {}  # pid -> kind, from its command line when the tree was last listed
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _relist(self) -> bool:
        """List the tree again and re-read each process's command line (a Ray worker's changes as it becomes an
        actor); False once the root has exited."""
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return False
        self._procs, self._kinds = [], {}
        for proc in procs:
            try:
                cmd = " ".join(proc.cmdline())
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            kind = process_kind(proc.pid == self.pid, cmd)
            seen_kind, name, peak = self.peak_by_process.get(proc.pid, (kind, "", 0.0))
            seen_kind, name = identity(proc.pid == self.pid, cmd, (seen_kind, name))
            self.peak_by_process[proc.pid] = (seen_kind, name, peak)
            self._procs.append(proc)
            self._kinds[proc.pid] = kind
        return True

    def _sample(self, with_pss: bool) -> tuple[dict[str, float], float]:
        """RSS per kind over the listed tree, and its PSS total (0 when not read this time)."""
        import psutil

        by_kind: dict[str, float] = {}
        pss_total = 0.0
        for proc in self._procs:
            try:
                mem = proc.memory_full_info() if with_pss else proc.memory_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss = mem.rss / 2**20
            kind = self._kinds[proc.pid]
            by_kind[kind] = by_kind.get(kind, 0.0) + rss
            seen_kind, name, peak = self.peak_by_process[proc.pid]
            self.peak_by_process[proc.pid] = (seen_kind, name, max(peak, rss))
            if with_pss:
                pss_total += getattr(mem, "pss", mem.rss) / 2**20
        return by_kind, pss_total

    def _loop(self) -> None:
        count = 0
        while not self._stop.is_set():
            with_pss = count % self.pss_every == 0
            if with_pss and not self._relist():
                return
            by_kind, pss_total = self._sample(with_pss)
            total = sum(by_kind.values())
            work = by_kind.get("driver", 0.0) + by_kind.get("workers", 0.0)
            self.peak_mb, self.peak_work_mb = max(self.peak_mb, total), max(self.peak_work_mb, work)
            self.peak_pss_mb = max(self.peak_pss_mb, pss_total)
            for kind, rss in by_kind.items():
                self.peak_by_kind[kind] = max(self.peak_by_kind.get(kind, 0.0), rss)
            count += 1
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
