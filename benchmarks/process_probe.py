"""Where a benchmark run's CPU time goes, phase by phase, read from outside the code being measured.

Owns `PhaseProbe`: wrapped around the trainer's phase timer (`marked_timer`) in the benchmark's child process,
it records for every phase the wall time and the CPU seconds (user + system) of the process doing the compute
(the Ray worker, or the driver itself with `trainer.single_process=true`), of the driver, of the rest of the
run's process tree (Ray's daemons) and of the whole machine (/proc/stat), plus the compute process's involuntary
context switches (how often the kernel took a core away from it), its minor page faults and how many of its
threads burned CPU.
`describe(pid)` gives what decides how fast a process can compute: its nice value, CPU affinity, thread count
and the OpenMP/MKL/torch variables of its environment.

So a slowdown under load can be told apart from a slower program: the same work done with the same CPU seconds
but more wall seconds is a scheduling matter (priority, competing processes); more CPU seconds for the same
work is the program (threads spinning, copies). A benchmark helper (benchmarks/ is not a package); imports
psutil and nothing of the trainer.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator

import psutil

ENV_KEYS = (
    "OMP_NUM_THREADS", "OMP_WAIT_POLICY", "MKL_NUM_THREADS", "KMP_AFFINITY", "KMP_BLOCKTIME", "GOMP_SPINCOUNT",
    "VERL_NUM_THREADS", "RAY_worker_niceness", "MALLOC_ARENA_MAX", "LD_PRELOAD",
)  # fmt: skip
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def machine_busy_seconds() -> float:
    """CPU seconds all cores of the machine have spent busy since boot (every process, ours or not)."""
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / _CLK_TCK  # user nice system idle iowait irq softirq steal


def cpu_seconds(proc: psutil.Process) -> float:
    """User + system CPU seconds of `proc` (0 once it has exited)."""
    try:
        times = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return times.user + times.system


def minor_faults(pid: int) -> float:
    """Minor page faults of process `pid` so far (fresh pages the kernel had to map: the cost of memory that the
    allocator gave back and takes again)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return float(fields[7])  # field 10 of proc(5), counted after the command name


def describe(pid: int) -> dict:
    """Nice value, CPU affinity, OS thread count and the threading/allocator variables of process `pid`."""
    proc = psutil.Process(pid)
    try:
        env = proc.environ()
    except psutil.Error:
        env = {}
    return {
        "pid": pid,
        "nice": proc.nice(),
        "affinity": proc.cpu_affinity(),
        "os_threads": proc.num_threads(),
        "env": {k: env[k] for k in ENV_KEYS if k in env},
    }


def _is_compute_worker(cmd: str) -> bool:
    """A Ray actor doing the run's work (not a daemon, not an idle pre-started worker)."""
    return "ray::" in cmd and "ray::IDLE" not in cmd and "Agent" not in cmd


class PhaseProbe:
    """Per-phase wall and CPU accounting of the process tree rooted at this process (see the module doc).

    `phase(name)` is a context manager; nested phases (the step around its parts) are all recorded.
    `steps` is one dict per finished step (`end_step()`): phase -> figures, each phase's figures summed when a
    phase runs more than once in a step.
    """

    def __init__(self) -> None:
        self.root = psutil.Process()
        self.steps: list[dict[str, dict[str, float]]] = []
        self._current: dict[str, dict[str, float]] = {}
        self._worker: psutil.Process | None = None
        self._tree: list[psutil.Process] | None = None
        self.compute_info: dict | None = None

    def _refresh_tree(self) -> list[psutil.Process]:
        """The process tree, listed once per step: listing it walks every process of the machine (/proc/*/stat),
        ~1 ms here, and each phase takes two snapshots, on the path being measured (in one process, inside the
        step; with Ray, between the driver's calls). The Ray worker is looked up in it until found."""
        self._tree = [self.root] + self.root.children(recursive=True)
        if self._worker is None:
            for proc in self._tree[1:]:
                try:
                    if _is_compute_worker(" ".join(proc.cmdline())):
                        self._worker = proc
                        break
                except psutil.Error:
                    continue
        return self._tree

    def compute_process(self) -> psutil.Process:
        """The Ray worker once it exists, else this process (single-process mode)."""
        if self._tree is None:
            self._refresh_tree()
        return self._worker or self.root

    def _snapshot(self) -> dict[str, float]:
        compute = self.compute_process()
        tree = self._tree
        tree_cpu = sum(cpu_seconds(p) for p in tree)
        compute_cpu = cpu_seconds(compute)
        root_cpu = cpu_seconds(self.root)
        try:
            ctx = compute.num_ctx_switches().involuntary
            threads = {t.id: t.user_time + t.system_time for t in compute.threads()}
        except psutil.Error:
            ctx, threads = 0, {}
        return {
            "wall": time.perf_counter(),
            "machine": machine_busy_seconds(),
            "tree": tree_cpu,
            "compute": compute_cpu,
            "driver": root_cpu if compute.pid != self.root.pid else 0.0,
            "ctx": float(ctx),
            "faults": minor_faults(compute.pid),
            "threads": threads,
            "rss_driver_mb": self.root.memory_info().rss / 2**20,
        }

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        before = self._snapshot()
        try:
            yield
        finally:
            after = self._snapshot()
            wall = after["wall"] - before["wall"]
            busy_threads = sum(
                1 for tid, t in after["threads"].items() if t - before["threads"].get(tid, 0.0) > 0.1 * wall
            )
            figures = {
                "wall_s": wall,
                "compute_cpu_s": after["compute"] - before["compute"],
                "driver_cpu_s": after["driver"] - before["driver"],
                "rest_of_tree_cpu_s": (after["tree"] - before["tree"])
                - (after["compute"] - before["compute"])
                - (after["driver"] - before["driver"]),
                "other_processes_cpu_s": max(
                    0.0, (after["machine"] - before["machine"]) - (after["tree"] - before["tree"])
                ),
                "involuntary_ctx_switches": after["ctx"] - before["ctx"],
                "minor_faults": after["faults"] - before["faults"],
                "busy_threads": float(busy_threads),
                "driver_rss_mb": after["rss_driver_mb"],
            }
            previous = self._current.get(name)
            if previous is not None:  # a phase run twice in one step: sum (the busy-thread count: the larger)
                figures = {
                    k: (max if k in ("busy_threads", "driver_rss_mb") else sum)((v, previous[k]))
                    for k, v in figures.items()
                }
            self._current[name] = figures
            compute_pid = self.compute_process().pid
            if self.compute_info is None or self.compute_info["pid"] != compute_pid:
                self.compute_info = describe(compute_pid)

    def end_step(self) -> None:
        """Close the current step's record (called once per step, after its last phase), with the CPU seconds
        each process of the tree has used so far (`cpu_by_process`, by short name: driver, worker, daemons); the
        tree is listed again for the next step."""
        self._refresh_tree()
        if self._current:
            self._current["cpu_by_process"] = self.cpu_by_process()
            self.steps.append(self._current)
        self._current = {}

    def cpu_by_process(self) -> dict[str, float]:
        """Cumulative CPU seconds of every process of the tree (as last listed), summed by short name."""
        out: dict[str, float] = {}
        for proc in self._tree if self._tree is not None else self._refresh_tree():
            try:
                cmd = proc.cmdline()
            except psutil.Error:
                continue
            name = "driver" if proc.pid == self.root.pid else short_name(cmd)
            out[name] = out.get(name, 0.0) + cpu_seconds(proc)
        return out


def short_name(cmd: list[str]) -> str:
    """`ray::<Class>` of a Ray worker, else the file name of the program or script (gcs_server, raylet, ...)."""
    ray_word = next((w for w in cmd if w.startswith("ray::")), None)
    if ray_word:
        return ray_word.split(".")[0]
    script = next((w for w in cmd[1:] if w.endswith(".py")), None)
    return os.path.basename(script or (cmd[0] if cmd else "?"))
