"""Backend-free parts of the single controller: the `Worker` base class, the `@register` decorator and the
`WorkerGroup` base of the Ray and in-process worker groups."""

from verl.single_controller.base.decorator import Dispatch, Execute, register
from verl.single_controller.base.worker import Worker
from verl.single_controller.base.worker_group import WorkerGroup

__all__ = ["Dispatch", "Execute", "Worker", "WorkerGroup", "register"]
