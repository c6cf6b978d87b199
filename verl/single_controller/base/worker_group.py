"""`WorkerGroup`: what every worker group does the same way, whatever runs its workers.

Owns exposing a Worker class's `@register`ed methods as methods of the group (`group.name(...)` calls
`_call`, then waits for the result unless the method is registered with `blocking=False`), `spawn`, one
handle per fused role of a `create_colocated_worker_cls` class, and `fuse`, those handles as `group.<role>`. Subclasses (`RayWorkerGroup`: Ray actors;
`LocalWorkerGroup`: the worker inside the driver) say how a call runs (`_call`, returning an object with
`.get()`) and which of their fields a role handle shares (`_share_with`). Knows nothing about Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from verl.single_controller.base.decorator import RegisterAttrs, registered_methods


class WorkerGroup:
    """Base of the worker groups; see the module doc. Subclasses set `role` (None for the whole group) and
    `_user_cls` (the Worker class whose methods the group exposes), call `_bind_methods`, and define
    `_call(name, worker_method, attrs, args, kwargs)` and `_share_with(handle)`."""

    role: str | None = None
    _user_cls: type

    def _bind_methods(self, user_cls: type, method_prefix: str) -> None:
        """Expose each registered method `name` of `user_cls` as `self.name`, calling the workers'
        `method_prefix + name`."""
        self._dispatch_info: dict[str, list[int]] = {}  # nd dispatch: mesh -> dp rank of each worker (verl)
        self._collect_info: dict[str, list[bool]] = {}  # nd collect: mesh -> whether each worker is collected
        for name, attrs in registered_methods(user_cls).items():
            if hasattr(type(self), name):
                raise ValueError(f"{user_cls.__name__}.{name} clashes with the worker group attribute of that name")
            setattr(self, name, self._make_group_method(name, method_prefix + name, attrs))

    def _make_group_method(self, name: str, worker_method: str, attrs: RegisterAttrs) -> Callable:
        def group_method(*args: Any, **kwargs: Any) -> Any:
            future = self._call(name, worker_method, attrs, args, kwargs)
            return future.get() if attrs.blocking else future

        group_method.__name__ = name
        group_method.__qualname__ = f"{type(self).__name__}.{name}"
        return group_method

    def spawn(self, prefix_set: Iterable[str]) -> dict[str, WorkerGroup]:
        """One group handle per fused role, sharing this group's workers: `handles[role].method(...)` calls
        the role's own `method` in the fused workers."""
        roles: dict[str, type] | None = getattr(self._user_cls, "fused_roles", None)
        if roles is None:
            raise ValueError(
                f"spawn needs a group of a class made by create_colocated_worker_cls, got {self._user_cls.__name__}"
            )
        handles = {}
        for role in prefix_set:
            if role not in roles:
                raise ValueError(f"unknown role {role!r}; this group's fused roles are {sorted(roles)}")
            handle = object.__new__(type(self))
            self._share_with(handle)
            handle.role = role
            handle._user_cls = roles[role]
            handle._bind_methods(roles[role], method_prefix=f"{role}_")
            handles[role] = handle
        return handles

    def fuse(self, prefix_set: Iterable[str]) -> None:
        """`spawn`'s role handles set as attributes of this group: `group.actor.add(...)` (verl's fused group)."""
        for role, handle in self.spawn(prefix_set).items():
            if not isinstance(getattr(self, role, handle), WorkerGroup):
                raise ValueError(f"role {role!r} clashes with the worker group attribute of that name")
            setattr(self, role, handle)
