"""Tests of the CPU worker's thread policy (verl/cpu/threads.py): the thread count each worker call gets from the
cores the machine's other processes kept busy during the last call, the /proc readings it rests on, and the
`@register` wrapper and environment switch that apply it."""

import time

import pytest
import torch

from verl.cpu import adaptive_threads_from_env
from verl.cpu import threads as cpu_share
from verl.single_controller.base.decorator import Dispatch, register

TICKS = cpu_share._CLOCK_TICKS


class _Machine:
    """Fake clock and tick counters: each `advance` is `seconds` of wall time in which the machine's CPUs were busy
    for `busy_cores` cores' worth and this process for `own_cores`."""

    def __init__(self):
        self.now, self.busy, self.own = 100.0, 10_000, 1_000
        self.proc = True

    def advance(self, seconds, busy_cores, own_cores):
        self.now += seconds
        self.busy += round(busy_cores * seconds * TICKS)
        self.own += round(own_cores * seconds * TICKS)

    def policy(self, share):
        policy = cpu_share.ThreadPolicy(
            share,
            clock=lambda: self.now,
            busy=lambda cpus: self.busy if self.proc else None,
            own=lambda: self.own if self.proc else None,
        )
        policy.cpus = {0, 1}  # a 2-CPU machine, whatever this one has
        return policy


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    cpu_share.disable()


def test_each_call_gets_the_cores_the_others_left_free_during_the_last(restore_threads):
    machine = _Machine()
    policy = machine.policy(share=2)
    assert policy.start() == 2 and torch.get_num_threads() == 2  # the first call: the whole share
    machine.advance(1.0, busy_cores=2.0, own_cores=1.3)  # another process held 0.7 of a core while it ran
    policy.finish()
    assert policy.start() == 1 and torch.get_num_threads() == 1  # round(2 - 0.7) = 1
    machine.advance(2.0, busy_cores=1.95, own_cores=0.9)  # still 1.05 cores busy elsewhere
    policy.finish()
    assert policy.start() == 1
    machine.advance(1.0, busy_cores=1.9, own_cores=1.8)  # the other process ended (0.1 core: daemons)
    policy.finish()
    assert policy.start() == 2 and torch.get_num_threads() == 2
    machine.advance(0.1, busy_cores=2.0, own_cores=0.0)  # a call under MIN_WINDOW_S tells nothing
    policy.finish()
    assert policy.start() == 2
    machine.advance(1.0, busy_cores=2.0, own_cores=0.0)  # the others took both cores: still at least 1 thread
    policy.finish()
    assert policy.start() == 1


def test_nested_calls_are_measured_once_and_without_proc_the_count_stays(restore_threads):
    machine = _Machine()
    policy = machine.policy(share=2)
    policy.start()
    machine.advance(0.5, busy_cores=2.0, own_cores=1.0)
    assert policy.start() == 2  # a worker method calling another: the outer call's count
    machine.advance(0.5, busy_cores=2.0, own_cores=1.0)
    policy.finish()  # the inner call ends: nothing measured yet
    assert policy.threads == 2
    policy.finish()  # the outer call (1 s, 1 core elsewhere) ends
    assert policy.threads == 1
    machine.proc = False  # no /proc (not Linux): the count stays
    policy.start()
    machine.advance(1.0, busy_cores=0.0, own_cores=2.0)
    policy.finish()
    assert policy.threads == 1
    with pytest.raises(ValueError, match="at least 1 thread, got 0"):
        cpu_share.ThreadPolicy(0)


def test_proc_readings_count_this_processs_work():
    cpus = {0, 1} | set(range(64))
    own_before, busy_before = cpu_share.own_ticks(), cpu_share.machine_busy_ticks(cpus)
    if own_before is None or busy_before is None:
        pytest.skip("no /proc on this system")
    end = time.process_time() + 0.3
    while time.process_time() < end:  # 0.3 s of this process's CPU time
        pass
    own = cpu_share.own_ticks() - own_before
    busy = cpu_share.machine_busy_ticks(cpus) - busy_before
    assert 0.2 * TICKS <= own <= 0.6 * TICKS
    assert busy >= own - 2  # the machine's busy ticks include this process's (tick rounding aside)
    assert cpu_share.machine_busy_ticks(set()) == 0  # CPUs outside the set do not count


class _Worker:
    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def threads(self):
        return torch.get_num_threads()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def athreads(self):
        return torch.get_num_threads()


def test_registered_calls_run_with_the_policys_count_and_the_env_switch(monkeypatch, restore_threads):
    import asyncio

    from verl.utils import acceleration

    machine = _Machine()
    worker = _Worker()
    torch.set_num_threads(2)
    cpu_share._POLICY = policy = machine.policy(share=2)
    policy.threads = 1
    monkeypatch.setattr(acceleration, "_current", acceleration.GENERIC)  # what a GPU worker enters
    assert worker.threads() == 2  # a process without the CPU speed-ups: the policy is not applied
    monkeypatch.setattr(acceleration, "_current", acceleration.for_device("cpu"))  # what a CPU worker enters
    assert worker.threads() == 1  # the wrapper set it before the method ran
    assert asyncio.run(worker.athreads()) == 1  # async methods are left as they are (no pick, no measure)
    cpu_share.disable()
    torch.set_num_threads(2)
    assert worker.threads() == 2  # no policy: nothing changes

    monkeypatch.setenv("VERL_ADAPTIVE_THREADS", "1")
    assert isinstance(adaptive_threads_from_env(2), cpu_share.ThreadPolicy) and cpu_share._POLICY.share == 2
    monkeypatch.setenv("VERL_ADAPTIVE_THREADS", "0")
    assert adaptive_threads_from_env(2) is None and cpu_share._POLICY is None
    monkeypatch.setenv("VERL_ADAPTIVE_THREADS", "yes")
    with pytest.raises(ValueError, match="VERL_ADAPTIVE_THREADS must be 0 or 1, got 'yes'"):
        adaptive_threads_from_env(2)
