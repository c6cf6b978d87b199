"""What Ray's mere presence costs a computing process: the same fixed matmul loop, on 2 threads (both cores of the
bench machine) and on 1 thread (the control), timed in a fresh process with no Ray on the machine ("alone"), beside
the daemons of a local cluster it is not connected to ("daemons", `ray start --head`), and after the trainer's own
`init_ray` with one idle actor in the same process ("ray.init", as a driver or a worker has Ray around it). The
three alternate for `--rounds` rounds; each process reports the median of 3 timed repeats. Prints every round and
the median ratio of each setting to "alone" (issue 20's Ray gap: benchmarks/README.md).

    python benchmarks/bench_ray_presence.py [--rounds 3] [--size 1024] [--reps 120]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SETTINGS = ("alone", "daemons", "ray.init")


class _Idle:
    """The session's one actor, started and then left idle."""

    def ping(self) -> int:
        return 1


def _child(setting: str, threads: int, size: int, reps: int) -> dict:
    """Run in the measuring process: the matmul loop's wall and CPU seconds (median of 3 repeats)."""
    import torch

    torch.set_num_threads(threads)
    if setting == "ray.init":
        import ray
        from omegaconf import OmegaConf

        from verl.trainer.main_ppo import init_ray, shutdown_ray

        init_ray(OmegaConf.create({"ray_kwargs": {"ray_init": {"num_cpus": 2}}}))
        idle = ray.remote(num_cpus=1)(_Idle).remote()
        ray.get(idle.ping.remote())
        time.sleep(2)  # the session's start-up work done
    a, b = torch.randn(size, size), torch.randn(size, size)
    loops = reps * threads // 2  # the same time per process whatever the thread count
    torch.mm(a, b)
    runs = []
    for _ in range(3):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        for _ in range(loops):
            torch.mm(a, b)
        runs.append((time.perf_counter() - wall0, time.process_time() - cpu0))
    if setting == "ray.init":
        shutdown_ray()
    return {"wall_s": statistics.median(r[0] for r in runs), "cpu_s": statistics.median(r[1] for r in runs)}


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(sys.executable), "ray")


def _ray_running() -> bool:
    """Whether a Ray daemon of any session runs on this machine (a raylet or a GCS server)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        if any(part.endswith(("/raylet", "/gcs_server")) for part in (proc.info["cmdline"] or [])[:1]):
            return True
    return False


def _measure(setting: str, threads: int, args) -> dict:
    """One fresh process under `setting`; the cluster started for "daemons" is stopped after it."""
    if setting == "daemons":
        subprocess.run(
            [_ray_cli(), "start", "--head", "--num-cpus=2", "--include-dashboard=false"],
            check=True,
            capture_output=True,
        )
        time.sleep(3)
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--_child",
        setting,
        "--_threads",
        str(threads),
        "--size",
        str(args.size),
        "--reps",
        str(args.reps),
    ]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}  # init_ray would join it
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    if setting == "daemons":
        subprocess.run([_ray_cli(), "stop", "--force"], capture_output=True)
    if out.returncode != 0:
        raise RuntimeError(f"{setting} ({threads} threads) failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="times the settings alternate (default 3)")
    parser.add_argument("--size", type=int, default=1024, help="square matmul size (default 1024)")
    parser.add_argument("--reps", type=int, default=120, help="matmuls per timed repeat on 2 threads (default 120)")
    parser.add_argument("--_child", choices=SETTINGS, help=argparse.SUPPRESS)
    parser.add_argument("--_threads", type=int, default=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name in ("rounds", "size", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if args._child:
        print(json.dumps(_child(args._child, args._threads, args.size, args.reps)))
        return
    if _ray_running():  # "alone" would not be alone, and `ray stop` after "daemons" would stop that cluster too
        sys.exit("a Ray cluster is running on this machine; stop it (`ray stop`) before this benchmark")
    ratios: dict[tuple[str, int], list[float]] = {}
    for rnd in range(1, args.rounds + 1):
        for threads in (2, 1):
            times = {setting: _measure(setting, threads, args) for setting in SETTINGS}
            base = times["alone"]["wall_s"]
            line = "  ".join(f"{s} {t['wall_s']:.3f} s (cpu {t['cpu_s']:.3f})" for s, t in times.items())
            print(f"round {rnd}, {threads} thread(s): {line}", flush=True)
            for setting in SETTINGS[1:]:
                ratios.setdefault((setting, threads), []).append(times[setting]["wall_s"] / base)
    print("\nmedian wall time against alone:")
    for (setting, threads), values in ratios.items():
        spread = ", ".join(f"{v:.3f}" for v in values)
        print(f"  {setting:9s} {threads} thread(s): {statistics.median(values):.3f}  ({spread})")


if __name__ == "__main__":
    main()
