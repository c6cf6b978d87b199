"""`@register`: how a Worker method called on a whole worker group splits its arguments across the ranks
(dispatch), which ranks run it (execute) and how the per-rank results are merged (collect).

Owns the `Dispatch` and `Execute` modes and the pure functions that turn one driver-side call into one
call per rank and back. Knows nothing about Ray (see `verl/single_controller/ray/base.py`); must not
import trainer or worker code.

Dispatch modes (verl's names):
- `ONE_TO_ALL`: every rank gets the same arguments; the result is the list of the ranks' outputs.
- `ALL_TO_ALL`, `DP_COMPUTE`: every argument is a list (or tuple) with one item per rank; rank i gets
  item i; the result is the list of the ranks' outputs.
- `RANK_ZERO`: only rank 0 runs the method; the result is its output (not a list).
- `DP_COMPUTE_PROTO`: every argument is a `DataProto` of the same length N; each is padded to a multiple of
  the world size (`pad_dataproto_to_divisor`, copies of its first rows appended) and cut into `world_size`
  equal chunks, rank i gets chunk i. DataProto outputs are concatenated in rank order (`DataProto.concat`)
  and the padding rows removed, so the result has the N input rows in input order. Outputs of any other
  type (e.g. a metrics dict) come back as the list of the ranks' outputs.

Execute modes: `Execute.ALL` runs the method on every rank; `Execute.RANK_ZERO` runs it on rank 0 only
with rank 0's share of the dispatched arguments and returns rank 0's output as is.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Any

from verl.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

# The attribute under which `register` stores its settings on a function (the name verl uses).
MAGIC_ATTR = "attrs_3141562937"


class Dispatch(Enum):
    """How the arguments of a group call are split across ranks and the outputs merged (see module doc)."""

    ONE_TO_ALL = "ONE_TO_ALL"
    ALL_TO_ALL = "ALL_TO_ALL"
    RANK_ZERO = "RANK_ZERO"
    DP_COMPUTE = "DP_COMPUTE"
    DP_COMPUTE_PROTO = "DP_COMPUTE_PROTO"


class Execute(Enum):
    """Which ranks run a group call: all of them, or rank 0 only."""

    ALL = "ALL"
    RANK_ZERO = "RANK_ZERO"


@dataclass(frozen=True)
class RegisterAttrs:
    """The settings `register` stores on a Worker method."""

    dispatch_mode: Dispatch
    execute_mode: Execute
    blocking: bool


@dataclass
class RankCalls:
    """One group call split into per-rank calls: rank i is called with `args[i]`, `kwargs[i]`.

    `pad_size` is the number of padding rows `DP_COMPUTE_PROTO` appended (0 otherwise), `padded_len` the
    padded batch length (None when nothing was padded).
    """

    args: list[tuple]
    kwargs: list[dict[str, Any]]
    pad_size: int = 0
    padded_len: int | None = None


def register(
    dispatch_mode: Dispatch = Dispatch.ALL_TO_ALL,
    execute_mode: Execute = Execute.ALL,
    blocking: bool = True,
) -> Callable[[Callable], Callable]:
    """Mark a Worker method as callable on the whole worker group.

    The method itself is returned unchanged (it can still be called locally); the worker group reads the
    settings to expose `group.<method>(...)`. With `blocking=False` the group method returns a future whose
    `.get()` gives the collected result, so the driver can start calls on several groups before waiting.
    """
    if not isinstance(dispatch_mode, Dispatch):
        raise TypeError(f"dispatch_mode must be a Dispatch member, got {dispatch_mode!r}; allowed: {list(Dispatch)}")
    if not isinstance(execute_mode, Execute):
        raise TypeError(f"execute_mode must be an Execute member, got {execute_mode!r}; allowed: {list(Execute)}")
    if not isinstance(blocking, bool):
        raise TypeError(f"blocking must be a bool, got {blocking!r}")
    attrs = RegisterAttrs(dispatch_mode=dispatch_mode, execute_mode=execute_mode, blocking=blocking)

    def decorator(func: Callable) -> Callable:
        setattr(func, MAGIC_ATTR, attrs)
        return func

    return decorator


def get_register_attrs(func: Any) -> RegisterAttrs | None:
    """The `register` settings of `func`, or None when it was not registered."""
    attrs = getattr(func, MAGIC_ATTR, None)
    return attrs if isinstance(attrs, RegisterAttrs) else None


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


# ---------------------------------------------------------------------------------------------- dispatch
def dispatch_one_to_all(world_size: int, args: tuple, kwargs: dict[str, Any]) -> RankCalls:
    """Every rank gets the same arguments."""
    return RankCalls(args=[tuple(args)] * world_size, kwargs=[dict(kwargs)] * world_size)


def dispatch_per_rank_lists(world_size: int, args: tuple, kwargs: dict[str, Any]) -> RankCalls:
    """Every argument is a list/tuple of `world_size` items; rank i gets item i of each."""
    named = [(f"positional argument {i}", arg) for i, arg in enumerate(args)]
    named += [(f"keyword argument {key!r}", val) for key, val in kwargs.items()]
    for name, value in named:
        if not isinstance(value, (list, tuple)) or len(value) != world_size:
            seen = (
                f"a {type(value).__name__} of length {len(value)}" if isinstance(value, (list, tuple)) else repr(value)
            )
            raise ValueError(
                f"{name} must be a list with one item per rank ({world_size} items) for this dispatch mode, got {seen}"
            )
    return RankCalls(
        args=[tuple(arg[rank] for arg in args) for rank in range(world_size)],
        kwargs=[{key: val[rank] for key, val in kwargs.items()} for rank in range(world_size)],
    )


def dispatch_dp_compute_data_proto(world_size: int, args: tuple, kwargs: dict[str, Any]) -> RankCalls:
    """Pad every DataProto argument to a multiple of `world_size` rows and give rank i chunk i of each."""
    named = [(f"positional argument {i}", arg) for i, arg in enumerate(args)]
    named += [(f"keyword argument {key!r}", val) for key, val in kwargs.items()]
    lengths = set()
    for name, value in named:
        if not isinstance(value, DataProto):
            raise TypeError(f"Dispatch.DP_COMPUTE_PROTO needs DataProto arguments, {name} is a {type(value).__name__}")
        lengths.add(len(value))
    if len(lengths) > 1:
        raise ValueError(
            f"Dispatch.DP_COMPUTE_PROTO needs DataProto arguments of one length, got lengths {sorted(lengths)}"
        )

    pad_size, padded_len = 0, None

    def split(data: DataProto) -> list[DataProto]:
        nonlocal pad_size, padded_len
        padded, pad_size = pad_dataproto_to_divisor(data, world_size)
        padded_len = len(padded)
        return padded.chunk(world_size)

    split_args = [split(arg) for arg in args]
    split_kwargs = {key: split(val) for key, val in kwargs.items()}
    return RankCalls(
        args=[tuple(chunks[rank] for chunks in split_args) for rank in range(world_size)],
        kwargs=[{key: chunks[rank] for key, chunks in split_kwargs.items()} for rank in range(world_size)],
        pad_size=pad_size,
        padded_len=padded_len,
    )


def dispatch_calls(mode: Dispatch, world_size: int, args: tuple, kwargs: dict[str, Any]) -> RankCalls:
    """Split one group call into `world_size` per-rank calls according to `mode`."""
    if mode in (Dispatch.ONE_TO_ALL, Dispatch.RANK_ZERO):
        return dispatch_one_to_all(world_size, args, kwargs)
    if mode in (Dispatch.ALL_TO_ALL, Dispatch.DP_COMPUTE):
        return dispatch_per_rank_lists(world_size, args, kwargs)
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return dispatch_dp_compute_data_proto(world_size, args, kwargs)
    raise ValueError(f"unknown dispatch mode {mode!r}; allowed: {list(Dispatch)}")


# ----------------------------------------------------------------------------------------------- collect
def collect_dp_compute_data_proto(outputs: list[Any], pad_size: int, padded_len: int | None) -> Any:
    """Concatenate DataProto outputs in rank order and drop the padding rows; other outputs stay a list."""
    is_proto = [isinstance(out, DataProto) for out in outputs]
    if not any(is_proto):
        return list(outputs)
    if not all(is_proto):
        raise TypeError(
            "Dispatch.DP_COMPUTE_PROTO: some ranks returned a DataProto and some did not: "
            f"{[type(out).__name__ for out in outputs]}"
        )
    merged = DataProto.concat(outputs)
    if pad_size == 0 or len(merged) == 0:
        return merged
    if len(merged) != padded_len:
        raise ValueError(
            f"Dispatch.DP_COMPUTE_PROTO padded the input to {padded_len} rows ({pad_size} padding rows) but the "
            f"ranks returned {len(merged)} rows in all; a DataProto output must have one row per input row "
            "(or none, e.g. metrics only in meta_info)"
        )
    return unpad_dataproto(merged, pad_size)


def collect_outputs(mode: Dispatch, outputs: list[Any], calls: RankCalls) -> Any:
    """Merge the outputs of all ranks (rank order) of a call run on every rank."""
    if mode is Dispatch.DP_COMPUTE_PROTO:
        return collect_dp_compute_data_proto(outputs, calls.pad_size, calls.padded_len)
    return list(outputs)
