"""Fused workers built in this process (no Ray): each role is built with its own arguments, is reachable as
`self.<role>` and through `_fuw_execute`, sees the other roles, and keeps its dispatch settings under the
prefixed name; bad role names and a bad `_fuw_execute` name are refused."""

import asyncio

import pytest

from verl.single_controller.base import Dispatch, Execute, Worker, register
from verl.single_controller.base.decorator import get_register_attrs
from verl.single_controller.ray import (
    RayClassWithInitArgs,
    create_colocated_worker_cls,
    create_colocated_worker_cls_fused,
    create_colocated_worker_raw_cls,
)


class Scaler(Worker):
    def __init__(self, factor, bias=0):
        super().__init__()
        self.factor, self.bias = factor, bias

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def scale(self, x):
        return self.factor * x + self.bias

    @register(dispatch_mode=Dispatch.DP_COMPUTE, execute_mode=Execute.RANK_ZERO, blocking=False)
    def later(self, x):
        return x

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    async def scale_async(self, x):
        await asyncio.sleep(0)
        return self.factor * x

    def plain(self, x):
        return ("plain", x)


class Shifter(Worker):
    @register(dispatch_mode=Dispatch.ALL_TO_ALL)
    def shift_scaled(self, x):
        return self.fused_worker_dict["scaler"].scale(x) - 1


def _class_dict():
    return {"scaler": RayClassWithInitArgs(Scaler, 3, bias=1), "shifter": RayClassWithInitArgs(Shifter)}


def test_a_fused_worker_builds_each_role_and_the_roles_see_each_other(clean_env):
    fused_cls = create_colocated_worker_raw_cls(_class_dict())
    assert fused_cls.__name__ == "FusedWorker_scaler_shifter" and fused_cls.is_fused_worker
    assert fused_cls.raw_cls_dict == {"scaler": Scaler, "shifter": Shifter}
    worker = fused_cls()
    assert isinstance(worker.scaler, Scaler) and (worker.scaler.factor, worker.scaler.bias) == (3, 1)
    assert worker.fused_worker_dict == {"scaler": worker.scaler, "shifter": worker.shifter}
    assert worker.shifter.fused_worker_dict is worker.fused_worker_dict
    assert worker.get_fused_worker_by_name("shifter") is worker.shifter and worker.get_fused_worker_by_name("x") is None
    assert worker.shifter.shift_scaled(2) == 3 * 2 + 1 - 1  # one role calls another
    assert worker.scaler_scale(2) == 7 and worker.shifter_shift_scaled(2) == 6  # the prefixed names
    assert asyncio.run(worker.scaler_scale_async(5)) == 15  # an async role method stays async
    assert worker._fuw_execute("scaler_fwmn_plain", 4) == ("plain", 4)  # any method, registered or not
    assert worker._fuw_execute("shifter_fwmn_shift_scaled", x=1) == 3
    with pytest.raises(ValueError, match=r"roles? of \['scaler', 'shifter'\], got 'critic_fwmn_plain'"):
        worker._fuw_execute("critic_fwmn_plain", 1)
    with pytest.raises(ValueError, match="got 'scaler_plain'"):
        worker._fuw_execute("scaler_plain", 1)


def test_the_prefixed_methods_keep_their_dispatch_settings():
    fused_cls = create_colocated_worker_raw_cls(_class_dict())
    later = get_register_attrs(fused_cls.scaler_later)
    assert (later.dispatch_mode, later.execute_mode, later.blocking) == (Dispatch.DP_COMPUTE, Execute.RANK_ZERO, False)
    assert get_register_attrs(fused_cls.shifter_shift_scaled).dispatch_mode is Dispatch.ALL_TO_ALL
    assert not hasattr(fused_cls, "scaler_plain")  # only registered methods are forwarded by name


def test_the_ready_made_class_is_marked_fused_and_merges_the_roles_options():
    class_dict = _class_dict()
    class_dict["scaler"].update_options({"runtime_env": {"env_vars": {"A": "1"}}, "max_concurrency": 2})
    class_dict["shifter"].update_options({"runtime_env": {"env_vars": {"B": "2"}}})
    fused = create_colocated_worker_cls(class_dict)
    assert fused.fused_worker_used and fused.user_cls.is_fused_worker and (fused.args, fused.kwargs) == ((), {})
    assert fused.options == {"runtime_env": {"env_vars": {"A": "1", "B": "2"}}, "max_concurrency": 2}
    assert create_colocated_worker_cls_fused is create_colocated_worker_cls
    assert RayClassWithInitArgs(Scaler, 1).fused_worker_used is False
    class_dict["shifter"].update_options({"runtime_env": {"env_vars": {"A": "3"}}})
    with pytest.raises(ValueError, match="role 'shifter' sets env var A='3', another role '1'"):
        create_colocated_worker_cls(class_dict)


@pytest.mark.parametrize(
    ("class_dict", "error", "message"),
    [
        ({}, ValueError, "at least one role, got an empty class_dict"),
        ({"critic-1": RayClassWithInitArgs(Shifter)}, ValueError, "role names must be Python identifiers"),
        ({"a_fwmn_b": RayClassWithInitArgs(Shifter)}, ValueError, "without '_fwmn_', got 'a_fwmn_b'"),
        ({"rank": RayClassWithInitArgs(Shifter)}, ValueError, "role 'rank' clashes with the Worker attribute"),
        ({"critic": Shifter}, TypeError, r"class_dict\['critic'\] must be a RayClassWithInitArgs, got type"),
        ({"critic": RayClassWithInitArgs(dict)}, TypeError, "must hold a subclass of verl Worker"),
    ],
)
def test_bad_roles_are_refused(class_dict, error, message):
    with pytest.raises(error, match=message):
        create_colocated_worker_raw_cls(class_dict)
