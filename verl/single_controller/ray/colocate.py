"""Fused (colocated) workers: several roles (actor, critic, ...) as one Worker class, so one process per rank.

Owns `create_colocated_worker_raw_cls` (the fused Worker class itself, which may be subclassed to add methods
that use several roles), `create_colocated_worker_cls` (that class ready for a worker group, the roles' Ray
options merged) and verl's alias `create_colocated_worker_cls_fused`. A fused worker holds one instance per role
in `fused_worker_dict` (also reachable as `self.<role>`); every role instance sees the same dict, so roles can call
each other. Each registered method `m` of a role becomes `{role}_{m}` on the fused class with the same dispatch
settings, and `_fuw_execute("{role}_fwmn_{m}", ...)` calls any method of a role (verl's convention). A group of
the fused class gives one handle per role with `spawn(roles)`, or sets them as `group.<role>` with `fuse(roles)`.
Must not import trainer or worker (layer 7) code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from verl.single_controller.base.decorator import register, registered_methods
from verl.single_controller.base.worker import Worker
from verl.single_controller.ray.resource_pool import RayClassWithInitArgs

# Separates the role from the method name in `_fuw_execute`'s first argument (verl's "fused worker method name").
FUSED_METHOD_SEP = "_fwmn_"


def _forward_to_role(role: str, name: str, target: Callable) -> Callable:
    """A fused-class method `{role}_{name}` calling the role instance's `name` (async when `target` is)."""
    if inspect.iscoroutinefunction(target):

        async def method(self: Worker, *args: Any, **kwargs: Any) -> Any:
            return await getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    else:

        def method(self: Worker, *args: Any, **kwargs: Any) -> Any:
            return getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    method.__name__ = f"{role}_{name}"
    return method


def _check_roles(class_dict: dict[str, RayClassWithInitArgs]) -> dict[str, type]:
    """`{role: plain Worker class}`; bad role names or classes raise, naming the role."""
    if not class_dict:
        raise ValueError("fusing workers needs at least one role, got an empty class_dict")
    roles = {}
    for role, cls_with_init in class_dict.items():
        if not isinstance(role, str) or not role.isidentifier() or FUSED_METHOD_SEP in role:
            raise ValueError(
                f"role names must be Python identifiers (they prefix method names) without {FUSED_METHOD_SEP!r}, "
                f"got {role!r}"
            )
        if hasattr(Worker, role):
            raise ValueError(f"role {role!r} clashes with the Worker attribute of that name; rename the role")
        if not isinstance(cls_with_init, RayClassWithInitArgs):
            raise TypeError(f"class_dict[{role!r}] must be a RayClassWithInitArgs, got {type(cls_with_init).__name__}")
        user_cls = cls_with_init.user_cls
        if not (isinstance(user_cls, type) and issubclass(user_cls, Worker)):
            raise TypeError(f"class_dict[{role!r}] must hold a subclass of verl Worker, got {user_cls!r}")
        roles[role] = user_cls
    return roles


def create_colocated_worker_raw_cls(class_dict: dict[str, RayClassWithInitArgs]) -> type:
    """The fused Worker class of the roles `{role: RayClassWithInitArgs}` (see the module doc). Its `__init__`
    takes no arguments: each role is built with the arguments of its RayClassWithInitArgs (its Ray options are
    not used here; `create_colocated_worker_cls` merges them). Class attributes: `raw_cls_dict` (`{role: class}`),
    `is_fused_worker` (True)."""
    roles = _check_roles(class_dict)
    init_args = {role: (cls_with_init.args, cls_with_init.kwargs) for role, cls_with_init in class_dict.items()}

    class FusedWorker(Worker):
        raw_cls_dict = dict(roles)
        fused_roles = raw_cls_dict  # the name the worker groups look for (`WorkerGroup.spawn`)
        is_fused_worker = True
        role_init_args = init_args

        def __init__(self) -> None:
            # not super(): Ray may ship this function by value with a copy of this class, which a subclass
            # imported in the worker does not derive from
            Worker.__init__(self)
            for role, (args, kwargs) in self.role_init_args.items():
                self.fused_worker_dict[role] = self.raw_cls_dict[role](*args, **kwargs)
                setattr(self, role, self.fused_worker_dict[role])
            for worker in self.fused_worker_dict.values():  # every role sees the others
                worker.fused_worker_dict = self.fused_worker_dict

        def _fuw_execute(self, method_name: str, *args: Any, **kwargs: Any) -> Any:
            """Call `method` of `role`, named `"{role}_fwmn_{method}"` (verl's fused-worker call)."""
            role, sep, name = method_name.partition(FUSED_METHOD_SEP)
            if not sep or role not in self.fused_worker_dict:
                raise ValueError(
                    f"_fuw_execute needs '<role>{FUSED_METHOD_SEP}<method>' with a role of "
                    f"{sorted(self.fused_worker_dict)}, got {method_name!r}"
                )
            return getattr(self.fused_worker_dict[role], name)(*args, **kwargs)

    for role, user_cls in roles.items():
        for name, attrs in registered_methods(user_cls).items():
            method = _forward_to_role(role, name, getattr(user_cls, name))
            method = register(attrs.dispatch_mode, attrs.execute_mode, attrs.blocking)(method)
            setattr(FusedWorker, method.__name__, method)
    FusedWorker.__name__ = FusedWorker.__qualname__ = "FusedWorker_" + "_".join(roles)
    return FusedWorker


def _merge_options(class_dict: dict[str, RayClassWithInitArgs]) -> dict[str, Any]:
    """The roles' Ray options as one dict (runtime_env env_vars merged); conflicting values raise."""
    merged: dict[str, Any] = {}
    env_vars: dict[str, str] = {}
    for role, cls_with_init in class_dict.items():
        for key, value in cls_with_init.options.items():
            if key == "runtime_env":
                value = dict(value)
                for var, var_value in (value.pop("env_vars", None) or {}).items():
                    if env_vars.setdefault(var, var_value) != var_value:
                        raise ValueError(
                            f"role {role!r} sets env var {var}={var_value!r}, another role {env_vars[var]!r}"
                        )
            if key in merged and merged[key] != value:
                raise ValueError(f"role {role!r} sets Ray option {key}={value!r}, another role {merged[key]!r}")
            merged[key] = value
    if env_vars:
        merged["runtime_env"] = {**merged.get("runtime_env", {}), "env_vars": env_vars}
    return merged


def create_colocated_worker_cls(class_dict: dict[str, RayClassWithInitArgs]) -> RayClassWithInitArgs:
    """The fused class of `class_dict`'s roles (`create_colocated_worker_raw_cls`) with the roles' Ray options
    merged, marked `fused_worker_used`: `RayWorkerGroup(pool, fused).spawn(prefix_set=class_dict.keys())` gives
    a handle per role with the role's own method names. All roles of a rank share its process and so its device,
    its environment and one torch.distributed process group."""
    fused = RayClassWithInitArgs(create_colocated_worker_raw_cls(class_dict))
    fused.update_options(_merge_options(class_dict))
    fused.fused_worker_used = True
    return fused


# verl 0.9.1 has two ways of fusing (a class with prefixed methods, and one called through `_fuw_execute`); the
# class made here does both, so the two names are one function.
create_colocated_worker_cls_fused = create_colocated_worker_cls
