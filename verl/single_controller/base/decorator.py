"""`@register`: how a Worker method called on a whole worker group splits its arguments across the ranks (dispatch),
which ranks run it (execute) and how the per-rank results are merged (collect). verl's API.

Owns `Dispatch` and `Execute` (`DynamicEnum`s), verl's dispatch/collect functions (`DISPATCH_MODE_FN_REGISTRY`),
the nd helpers (`make_nd_compute_dataproto_dispatch_fn`) and `dispatch_calls` / `collect_outputs`, which the worker
groups run every call through. DP_COMPUTE_PROTO pads a DataProto whose length is not a multiple of the world size
(`pad_dataproto_to_divisor`), marks the padding rows in `meta_info[PADDING_ROWS_KEY]` and removes them from the
concatenated output. Knows nothing about Ray; must not import trainer or worker code.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial, wraps
from typing import Any

from tensordict import TensorDict

from verl.protocol import (
    PADDING_ROWS_KEY,
    DataProto,
    DataProtoFuture,
    _padding_size_key,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from verl.utils import acceleration
from verl.utils import tensordict_utils as tu
from verl.utils.py_functional import DynamicEnum

# The attribute under which `register` stores its settings on a function (the name verl uses).
MAGIC_ATTR = "attrs_3141562937"


class Dispatch(DynamicEnum):
    """How the arguments of a group call are split across ranks and the outputs merged (see module doc)."""

    _registry: dict = {}
    _next_value = 0


class Execute(DynamicEnum):
    """Which ranks run a group call: all of them, or rank 0 only."""

    _registry: dict = {}
    _next_value = 0


def init_predefined_dispatch_mode() -> None:
    for name in ("RANK_ZERO", "ONE_TO_ALL", "ALL_TO_ALL", "DP_COMPUTE", "DP_COMPUTE_PROTO"):
        Dispatch.register(name)
    for name in ("DP_COMPUTE_PROTO_WITH_FUNC", "DP_COMPUTE_METRIC", "DIRECT_ROLLOUT_METHOD"):
        Dispatch.register(name)


def init_predefined_execute_mode() -> None:
    Execute.register("ALL")
    Execute.register("RANK_ZERO")


init_predefined_dispatch_mode()
init_predefined_execute_mode()


@dataclass(frozen=True)
class RegisterAttrs:
    """The settings `register` stores on a Worker method (a verl-style dict under MAGIC_ATTR)."""

    dispatch_mode: Any  # a Dispatch member or a {"dispatch_fn", "collect_fn"} dict
    execute_mode: Execute
    blocking: bool


@dataclass
class RankCalls:
    """One group call split into per-rank calls: rank i is called with `args[i]`, `kwargs[i]`.

    `pad_size` is the number of padding rows appended to the batch (0 otherwise), `padded_len` the padded batch
    length (None when nothing was padded); `collect_fn` is a custom mode's verl-style collect function.
    """

    args: list[tuple]
    kwargs: list[dict[str, Any]]
    pad_size: int = 0
    padded_len: int | None = None
    collect_fn: Callable | None = field(default=None, compare=False)
    worker_group: Any = field(default=None, compare=False)


# ---------------------------------------------------------------------------------------------- register
def _check_dispatch_mode(dispatch_mode: Any) -> None:
    if isinstance(dispatch_mode, dict):
        missing = [key for key in ("dispatch_fn", "collect_fn") if key not in dispatch_mode]
        if missing:
            raise TypeError(f"a dict dispatch_mode needs the keys dispatch_fn and collect_fn; missing {missing}")
    elif not isinstance(dispatch_mode, Dispatch):
        raise TypeError(
            f"dispatch_mode must be a Dispatch member or a dict of dispatch_fn/collect_fn, got {dispatch_mode!r}; "
            f"allowed: {Dispatch.names()}"
        )


def _check_execute_mode(execute_mode: Any) -> None:
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}; allowed: {Execute.names()}")


def _materialize_futures(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """DataProtoFuture arguments replaced by their values (run inside the worker)."""
    args = tuple(arg.get() if isinstance(arg, DataProtoFuture) else arg for arg in args)
    kwargs = {k: v.get() if isinstance(v, DataProtoFuture) else v for k, v in kwargs.items()}
    return args, kwargs


def register(
    dispatch_mode: Any = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
    materialize_futures: bool = True,
) -> Callable[[Callable], Callable]:
    """Mark a Worker method as callable on the whole worker group.

    Returns a wrapper of the method (async if the method is) that first fetches any `DataProtoFuture` argument
    (`materialize_futures`), carrying the settings under MAGIC_ATTR; it can still be called locally. A plain
    (not async) method runs inside the process's device speed-ups' `call()` (`verl.utils.acceleration`: on a CPU
    worker, with as many torch threads as the machine's other processes leave cores free). With
    `blocking=False` the group method returns a future whose `.get()` gives the collected result.
    """
    _check_dispatch_mode(dispatch_mode)
    _check_execute_mode(execute_mode)
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, got {blocking!r}")

    def decorator(func: Callable) -> Callable:
        @wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            if materialize_futures:
                args, kwargs = _materialize_futures(*args, **kwargs)
            with acceleration.current().call():  # a CPU worker's thread count follows the machine's load (verl.cpu)
                return func(*args, **kwargs)

        @wraps(func)
        async def async_inner(*args: Any, **kwargs: Any) -> Any:
            if materialize_futures:
                args, kwargs = _materialize_futures(*args, **kwargs)
            return await func(*args, **kwargs)

        wrapper = async_inner if inspect.iscoroutinefunction(func) else inner
        setattr(
            wrapper, MAGIC_ATTR, {"dispatch_mode": dispatch_mode, "execute_mode": execute_mode, "blocking": blocking}
        )
        return wrapper

    return decorator


def get_register_attrs(func: Any) -> RegisterAttrs | None:
    """The `register` settings of `func`, or None when it was not registered."""
    attrs = getattr(func, MAGIC_ATTR, None)
    if not isinstance(attrs, dict) or "dispatch_mode" not in attrs:
        return None
    return RegisterAttrs(attrs["dispatch_mode"], attrs.get("execute_mode", Execute.ALL), attrs.get("blocking", True))


def registered_methods(cls: type) -> dict[str, RegisterAttrs]:
    """`{name: register settings}` of the `@register`ed methods of `cls` (inherited ones included)."""
    methods = {}
    for name in dir(cls):
        if name.startswith("__"):
            continue
        attrs = get_register_attrs(getattr(cls, name, None))
        if attrs is not None:
            methods[name] = attrs
    return methods


def runs_on_rank_zero_only(attrs: RegisterAttrs) -> bool:
    """True when only rank 0 runs the method (`Dispatch.RANK_ZERO` or `Execute.RANK_ZERO`)."""
    return attrs.dispatch_mode is Dispatch.RANK_ZERO or attrs.execute_mode is Execute.RANK_ZERO


# ------------------------------------------------------------------------------------- verl dispatch fns
def _named(args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    return [(f"positional argument {i}", a) for i, a in enumerate(args)] + [
        (f"keyword argument {k!r}", v) for k, v in kwargs.items()
    ]


def dispatch_one_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Every rank gets the same arguments."""
    n = worker_group.world_size
    return tuple([arg] * n for arg in args), {k: [v] * n for k, v in kwargs.items()}


def dispatch_all_to_all(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """The arguments are already one list per argument with an item per rank (checked as for DP_COMPUTE)."""
    return dispatch_dp_compute(worker_group, *args, **kwargs)


def dispatch_dp_compute(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """Every argument must be a list/tuple of `world_size` items; rank i gets item i of each."""
    n = worker_group.world_size
    for name, value in _named(args, kwargs):
        if not isinstance(value, (list, tuple)) or len(value) != n:
            seen = (
                f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else repr(value)
            )
            raise ValueError(
                f"{name} must be a list with one item per rank ({n} items) for this dispatch mode, got {seen}"
            )
    return args, kwargs


def collect_all_to_all(worker_group: Any, output: list) -> list:
    return output


def collect_dp_compute(worker_group: Any, output: list) -> list:
    return output


def dummy_direct_rollout_call(worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError("Direct rollout call is forbidden.")


def _chunk(value: Any, chunks: int) -> list:
    if isinstance(value, TensorDict):
        return [tu.contiguous(part) for part in tu.chunk_tensordict(value, chunks)]
    return value.chunk(chunks=chunks)


def _split_batches(world_size: int, args: tuple, kwargs: dict, pad: bool) -> tuple[list, dict]:
    """Chunk every batch argument (DataProto, TensorDict, DataProtoFuture) into `world_size` parts; with `pad`,
    DataProtos are first padded to a multiple of the world size and the pad size is returned under
    `_padding_size_key` (verl's convention), each padded chunk marking its padding rows in meta_info."""
    # a future that is collected in the driver (a worker group's own future) is resolved first, then padded
    args = tuple(a.get() if getattr(a, "collect_in_driver", False) else a for a in args)
    kwargs = {k: v.get() if getattr(v, "collect_in_driver", False) else v for k, v in kwargs.items()}
    lengths = set()
    for name, value in _named(args, kwargs):
        if not isinstance(value, (DataProto, TensorDict, DataProtoFuture)):
            raise TypeError(
                f"this dispatch mode needs DataProto (or TensorDict / DataProtoFuture) arguments, {name} is a "
                f"{type(value).__name__}"
            )
        if isinstance(value, DataProto):
            lengths.add(len(value))
    if len(lengths) > 1:
        raise ValueError(f"DataProto arguments must have one length, got lengths {sorted(lengths)}")
    pad_size = 0

    def split(value: Any) -> list:
        nonlocal pad_size
        if not (pad and isinstance(value, DataProto)):
            return _chunk(value, world_size)
        padded, pad_size = pad_dataproto_to_divisor(value, world_size)
        parts = padded.chunk(world_size)
        first_pad_row = len(value)
        for i, part in enumerate(parts):  # padding rows are the last rows of the last chunks
            start = i * len(part)
            part.meta_info[PADDING_ROWS_KEY] = max(0, min(len(part), start + len(part) - first_pad_row))
        return parts

    split_args = [split(arg) for arg in args]
    split_kwargs = {key: split(val) for key, val in kwargs.items()}
    if pad_size:
        split_kwargs[_padding_size_key] = pad_size
    return split_args, split_kwargs


def dispatch_dp_compute_data_proto(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[list, dict]:
    """Pad (DataProto) and chunk every batch argument; rank i gets chunk i (see module doc)."""
    return _split_batches(worker_group.world_size, args, kwargs, pad=True)


def dispatch_dp_compute_data_proto_with_func(worker_group: Any, *args: Any, **kwargs: Any) -> tuple[list, dict]:
    """The first argument (a function) goes to every rank; the others are chunked without padding."""
    if not args or not callable(args[0]):
        raise TypeError("DP_COMPUTE_PROTO_WITH_FUNC needs a function as its first argument")
    split_args, split_kwargs = _split_batches(worker_group.world_size, args[1:], kwargs, pad=False)
    return [[args[0]] * worker_group.world_size] + split_args, split_kwargs


def _concat(outputs: list) -> Any:
    if isinstance(outputs[0], TensorDict):
        return tu.concat_tensordict(outputs)
    return type(outputs[0]).concat(outputs)


def collect_dp_compute_data_proto(worker_group: Any, output: list) -> Any:
    """Concatenate DataProto / TensorDict outputs in rank order; other outputs stay a list."""
    is_batch = [isinstance(out, (DataProto, TensorDict)) for out in output]
    if not any(is_batch):
        return list(output)
    if not all(is_batch):
        raise TypeError(f"some ranks returned a DataProto and some did not: {[type(out).__name__ for out in output]}")
    for out in output:
        if isinstance(out, DataProto):
            out.meta_info.pop(PADDING_ROWS_KEY, None)
    return _concat(output)


def dispatch_nd_compute(
    dp_rank_mapping: list[int], dp_size: int, worker_group: Any, *args: Any, **kwargs: Any
) -> tuple:
    """Each argument is a list of `dp_size` items; worker i gets item `dp_rank_mapping[i]`."""
    for name, value in _named(args, kwargs):
        if not isinstance(value, (list, tuple)) or len(value) != dp_size:
            raise ValueError(f"{name} must be a list of {dp_size} items (one per data-parallel rank), got {value!r}")
    ranks = range(worker_group.world_size)
    all_args = tuple([arg[dp_rank_mapping[i]] for i in ranks] for arg in args)
    all_kwargs = {k: [v[dp_rank_mapping[i]] for i in ranks] for k, v in kwargs.items()}
    return all_args, all_kwargs


def collect_nd_compute(collect_mask: list[bool], worker_group: Any, output: list) -> list:
    """The outputs of the workers whose `collect_mask` is True, in rank order."""
    if len(output) != worker_group.world_size:
        raise ValueError(f"expected {worker_group.world_size} outputs, got {len(output)}")
    return [out for out, keep in zip(output, collect_mask) if keep]


def dispatch_nd_compute_dataproto(
    dp_rank_mapping: list[int], dp_size: int, worker_group: Any, *args: Any, **kwargs: Any
) -> tuple:
    split_args, split_kwargs = _split_batches(dp_size, args, kwargs, pad=False)
    return dispatch_nd_compute(dp_rank_mapping, dp_size, worker_group, *split_args, **split_kwargs)


def collect_nd_compute_dataproto(collect_mask: list[bool], worker_group: Any, output: list) -> Any:
    outputs = collect_nd_compute(collect_mask, worker_group, output)
    return collect_dp_compute_data_proto(worker_group, outputs)


def dispatch_lazy_compute_data_proto(mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any) -> tuple:
    """nd dispatch by the dp rank each worker registered for `mesh_name` (queried once, then cached)."""
    if mesh_name not in worker_group._dispatch_info:
        worker_group._dispatch_info[mesh_name] = worker_group._query_dispatch_info(mesh_name)
    dp_rank_mapping = worker_group._dispatch_info[mesh_name]
    return dispatch_nd_compute_dataproto(dp_rank_mapping, max(dp_rank_mapping) + 1, worker_group, *args, **kwargs)


def collect_lazy_compute_data_proto(mesh_name: str, worker_group: Any, *args: Any, **kwargs: Any) -> Any:
    if mesh_name not in worker_group._collect_info:
        worker_group._collect_info[mesh_name] = worker_group._query_collect_info(mesh_name)
    return collect_nd_compute_dataproto(worker_group._collect_info[mesh_name], worker_group, *args, **kwargs)


def make_nd_compute_dataproto_dispatch_fn(mesh_name: str) -> dict[str, Callable]:
    """A dispatch mode that sends chunk d of a batch to every worker registered as data-parallel rank d of
    `mesh_name` (`Worker._register_dispatch_collect_info`) and collects from the workers marked `is_collect`."""
    return {
        "dispatch_fn": partial(dispatch_lazy_compute_data_proto, mesh_name),
        "collect_fn": partial(collect_lazy_compute_data_proto, mesh_name),
    }


DISPATCH_MODE_FN_REGISTRY: dict[Any, dict[str, Callable]] = {
    Dispatch.ONE_TO_ALL: {"dispatch_fn": dispatch_one_to_all, "collect_fn": collect_all_to_all},
    Dispatch.ALL_TO_ALL: {"dispatch_fn": dispatch_all_to_all, "collect_fn": collect_all_to_all},
    Dispatch.DP_COMPUTE: {"dispatch_fn": dispatch_dp_compute, "collect_fn": collect_dp_compute},
    Dispatch.DP_COMPUTE_PROTO: {
        "dispatch_fn": dispatch_dp_compute_data_proto,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_PROTO_WITH_FUNC: {
        "dispatch_fn": dispatch_dp_compute_data_proto_with_func,
        "collect_fn": collect_dp_compute_data_proto,
    },
    Dispatch.DP_COMPUTE_METRIC: {"dispatch_fn": dispatch_dp_compute_data_proto, "collect_fn": collect_dp_compute},
    Dispatch.DIRECT_ROLLOUT_METHOD: {"dispatch_fn": dummy_direct_rollout_call, "collect_fn": dummy_direct_rollout_call},
}


def get_predefined_dispatch_fn(dispatch_mode: Dispatch) -> dict[str, Callable]:
    return DISPATCH_MODE_FN_REGISTRY[dispatch_mode]


def register_dispatch_mode(dispatch_mode_name: str, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Add a Dispatch member `dispatch_mode_name` with verl-style dispatch and collect functions."""
    dispatch_mode = Dispatch.register(dispatch_mode_name)
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def update_dispatch_mode(dispatch_mode: Dispatch, dispatch_fn: Callable, collect_fn: Callable) -> None:
    """Replace the functions of an existing dispatch mode."""
    _check_dispatch_mode(dispatch_mode)
    if dispatch_mode not in DISPATCH_MODE_FN_REGISTRY:
        raise ValueError(f"dispatch_mode {dispatch_mode} not found")
    DISPATCH_MODE_FN_REGISTRY[dispatch_mode] = {"dispatch_fn": dispatch_fn, "collect_fn": collect_fn}


def get_predefined_execute_fn(execute_mode: Execute) -> dict[str, str]:
    """The worker-group method name that runs `execute_mode` (verl's `execute_all` / `execute_rank_zero`)."""
    return {
        Execute.ALL: {"execute_fn_name": "execute_all"},
        Execute.RANK_ZERO: {"execute_fn_name": "execute_rank_zero"},
    }[execute_mode]


# ------------------------------------------------------------------------- what the worker groups call
class _GroupSize:
    """Stands in for a worker group where only its size is known (direct calls of `dispatch_calls`)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


def _mode_fns(mode: Any) -> dict[str, Callable]:
    if mode is Dispatch.RANK_ZERO:  # rank 0 gets the arguments as they are (the group runs only rank 0)
        return DISPATCH_MODE_FN_REGISTRY[Dispatch.ONE_TO_ALL]
    fns = mode if isinstance(mode, dict) else DISPATCH_MODE_FN_REGISTRY.get(mode)
    if fns is None:
        raise ValueError(f"unknown dispatch mode {mode!r}; allowed: {Dispatch.names()} or a dict")
    return fns


def dispatch_calls(
    mode: Any, world_size: int, args: tuple, kwargs: dict[str, Any], worker_group: Any = None
) -> RankCalls:
    """Split one group call into `world_size` per-rank calls according to `mode` (a Dispatch or a dict)."""
    group = worker_group if worker_group is not None else _GroupSize(world_size)
    fns = _mode_fns(mode)
    split_args, split_kwargs = fns["dispatch_fn"](group, *args, **kwargs)
    split_kwargs = dict(split_kwargs)
    pad_size = split_kwargs.pop(_padding_size_key, 0)
    lengths = [len(v) for v in (*args, *kwargs.values()) if isinstance(v, DataProto)]
    padded_len = lengths[0] + pad_size if lengths and not isinstance(mode, dict) else None
    return RankCalls(
        args=[tuple(arg[rank] for arg in split_args) for rank in range(world_size)],
        kwargs=[{key: val[rank] for key, val in split_kwargs.items()} for rank in range(world_size)],
        pad_size=pad_size,
        padded_len=padded_len,
        collect_fn=fns["collect_fn"],
        worker_group=group,
    )


def collect_outputs(mode: Any, outputs: list[Any], calls: RankCalls) -> Any:
    """Merge the outputs of all ranks (rank order) of a call run on every rank; drop padding rows."""
    collect_fn = calls.collect_fn or _mode_fns(mode)["collect_fn"]
    merged = collect_fn(calls.worker_group or _GroupSize(len(outputs)), list(outputs))
    if calls.pad_size and isinstance(merged, DataProto) and len(merged) > 0:
        if len(merged) != calls.padded_len:
            raise ValueError(
                f"Dispatch.DP_COMPUTE_PROTO padded the input to {calls.padded_len} rows ({calls.pad_size} padding "
                f"rows) but the ranks returned {len(merged)} rows in all; a DataProto output must have one row per "
                "input row (or none, e.g. metrics only in meta_info)"
            )
        merged = unpad_dataproto(merged, calls.pad_size)
    return merged
