"""Backend-free parts of the single controller: the `Worker` base class and the `@register` decorator."""

from verl.single_controller.base.decorator import Dispatch, Execute, register
from verl.single_controller.base.worker import Worker

__all__ = ["Dispatch", "Execute", "Worker", "register"]
