"""`verl.utils.ray_utils`: Ray's NOSET switches, putting many objects at once in order, this thread's event loop,
and an async function called from sync code, from a coroutine and from sync code under a running loop."""

import asyncio
import threading

import pytest

from verl.utils.ray_utils import auto_await, get_event_loop, parallel_put, ray_noset_visible_devices


def test_noset_visible_devices_reads_any_of_rays_switches(monkeypatch):
    assert ray_noset_visible_devices({}) is False
    assert ray_noset_visible_devices({"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": ""}) is False  # empty: unset
    assert ray_noset_visible_devices({"RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES": "1"}) is True
    assert ray_noset_visible_devices({"CUDA_VISIBLE_DEVICES": "0"}) is False
    monkeypatch.setenv("RAY_EXPERIMENTAL_NOSET_ROCR_VISIBLE_DEVICES", "1")
    assert ray_noset_visible_devices() is True  # the process's environment by default


@pytest.mark.ray
def test_parallel_put_keeps_the_order_and_refuses_nothing_to_put(ray_session):
    data = [{"i": i, "payload": list(range(i))} for i in range(40)]  # more items than threads
    refs = parallel_put(data, max_workers=3)
    assert all(isinstance(ref, ray_session.ObjectRef) for ref in refs)
    assert ray_session.get(refs) == data
    assert ray_session.get(parallel_put(["only"])) == ["only"]
    with pytest.raises(AssertionError, match="data_list must not be empty"):
        parallel_put([])
    with pytest.raises(ValueError, match="max_workers must be a positive int or None, got 0"):
        parallel_put([1], max_workers=0)


def test_get_event_loop_makes_one_for_a_thread_without_and_keeps_it():
    seen = {}

    def in_thread():
        loop = get_event_loop()
        seen["same"] = get_event_loop() is loop
        seen["result"] = loop.run_until_complete(asyncio.sleep(0, result=7))
        loop.close()

    thread = threading.Thread(target=in_thread)
    thread.start()
    thread.join()
    assert seen == {"same": True, "result": 7}


@auto_await
async def _double(x):
    await asyncio.sleep(0)
    return 2 * x


@auto_await
def _not_async(x):
    return x + 1


def test_auto_await_runs_without_a_loop_and_hands_the_coroutine_to_an_awaiting_caller():
    assert _double(4) == 8  # no running loop: run to the end here
    assert _not_async(4) == 5  # a plain function's result as is

    async def caller():
        pending = _double(5)
        assert asyncio.iscoroutine(pending)  # a coroutine caller gets the coroutine, to await
        return await pending

    assert asyncio.run(caller()) == 10


def test_auto_await_from_sync_code_under_a_running_loop_runs_on_another_thread():
    def sync_helper():  # a plain function called by a coroutine, so this thread's loop is running
        return _double(6)

    async def main():
        return sync_helper()

    assert asyncio.run(main()) == 12
