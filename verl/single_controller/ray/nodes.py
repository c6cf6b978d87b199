"""Which Ray node each rank of a worker group runs on (`bundle_nodes`, `describe_placement`), and telling a lost node
from a failed call: a `WorkerGroupFuture` checks its ranks' nodes every `NODE_CHECK_S`, and on a rank's death or a
collective's communication error (waiting up to `loss_wait_s()`) reports the node Ray marked dead.
Layer 6: Ray's public API only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

import ray

__all__ = [
    "NODE_CHECK_S",
    "bundle_nodes",
    "describe_lost",
    "describe_placement",
    "looks_like_lost_peer",
    "loss_wait_s",
    "lost_nodes",
    "never_started_cause",
    "wait_for_lost_nodes",
]

NODE_CHECK_S = 5.0  # how often a pending call checks the nodes of the ranks it waits for
LOSS_WAIT_ENV = "VERL_NODE_LOSS_WAIT_S"
DEFAULT_LOSS_WAIT_S = 60.0  # Ray's own health checks declare a node dead within ~30 s by default
# what a collective says when a peer process or its node went away
_PEER_LOSS_MARKS = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "gloo",
    "nccl",
    "socket closed",
    "connection refused",
)


def loss_wait_s() -> float:
    """How long a failed call waits for Ray to confirm a lost node (`VERL_NODE_LOSS_WAIT_S`, default 60)."""
    raw = os.environ.get(LOSS_WAIT_ENV)
    if raw is None:
        return DEFAULT_LOSS_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{LOSS_WAIT_ENV} must be a number of seconds, got {raw!r}") from None
    if value < 0:
        raise ValueError(f"{LOSS_WAIT_ENV} must be >= 0 seconds, got {raw!r}")
    return value


def bundle_nodes(placement_group, n_bundles: int) -> list[str | None]:
    """The Ray node id of each of the first `n_bundles` bundles of a (created) placement group."""
    table = ray.util.placement_group_table(placement_group)
    where = table.get("bundles_to_node_id") or {}
    return [where.get(i) for i in range(n_bundles)]


def _nodes() -> dict[str, dict]:
    return {node["NodeID"]: node for node in ray.nodes()}


def lost_nodes(node_ids: Sequence[str | None]) -> list[str]:
    """The ids among `node_ids` that Ray reports as not alive (or no longer knows), in first-seen order."""
    known = _nodes()
    lost: list[str] = []
    for node_id in node_ids:
        if node_id and node_id not in lost and not known.get(node_id, {}).get("Alive", False):
            lost.append(node_id)
    return lost


def wait_for_lost_nodes(node_ids: Sequence[str | None], wait_s: float, poll_s: float = 1.0) -> list[str]:
    """`lost_nodes(node_ids)`, polled for up to `wait_s` seconds until one is lost; [] if none was."""
    deadline = time.monotonic() + wait_s
    while True:
        lost = lost_nodes(node_ids)
        if lost or time.monotonic() >= deadline:
            return lost
        time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))


def looks_like_lost_peer(err: BaseException) -> bool:
    """Whether a rank's error reads like a collective whose peer went away (gloo/NCCL connection errors)."""
    text = str(err).lower()
    return any(mark in text for mark in _PEER_LOSS_MARKS)


def describe_lost(lost: Sequence[str], rank_nodes: Sequence[str | None], method: str, label: str) -> str:
    """One line naming each lost node (address and id) and the ranks of `label` that ran on it."""
    known = _nodes()
    parts = []
    for node_id in lost:
        address = known.get(node_id, {}).get("NodeManagerAddress", "?")
        ranks = [rank for rank, node in enumerate(rank_nodes) if node == node_id]
        parts.append(f"node {address} (Ray node {node_id[:8]}) with {label} rank(s) {ranks}")
    return f"lost {'; '.join(parts)} during '{method}'"


def describe_placement(rank_nodes: Sequence[str | None], label: str) -> str | None:
    """`<label>: node <address> (Ray node <id>) ranks [..]; ...` when the ranks span more than one node, else None."""
    if len({node for node in rank_nodes}) < 2:
        return None
    known = _nodes()
    parts = []
    for node_id in dict.fromkeys(rank_nodes):
        address = known.get(node_id, {}).get("NodeManagerAddress", "?") if node_id else "?"
        ranks = [rank for rank, node in enumerate(rank_nodes) if node == node_id]
        parts.append(f"node {address} (Ray node {(node_id or '?')[:8]}) ranks {ranks}")
    return f"{label}: {'; '.join(parts)}"


NEVER_STARTED = "cancelled before it started running"
_AUTH_MARKS = ("authorization header", "auth token", "authtoken", "authentication")


def never_started_cause(logs_dir: str | None = None) -> str | None:
    """Why Ray cancelled a worker before it ran, as far as this machine's Ray logs say: an authentication
    mismatch (the driver's core-worker log or a raylet log rejecting requests for a missing or wrong token) gets
    one explanation; None when the logs say nothing known. `logs_dir`: this session's log folder (default: the
    connected driver's)."""
    import glob

    if logs_dir is None:
        try:
            logs_dir = ray._private.worker.global_worker.node.get_logs_dir_path()  # read only, no public name
        except Exception:
            return None
    lines: list[str] = []
    own_log = glob.glob(os.path.join(logs_dir, f"python-core-driver-*_{os.getpid()}.log"))  # this driver's
    for path in own_log + glob.glob(os.path.join(logs_dir, "raylet*.out")):
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                lines += [line.strip() for line in f if any(m in line.lower() for m in _AUTH_MARKS)]
        except OSError:
            continue
    if not lines:
        return None
    mode = os.environ.get("RAY_AUTH_MODE", "unset")
    return (
        f"Ray authentication mismatch between this driver (RAY_AUTH_MODE={mode}) and the cluster's processes; "
        f"Ray's log says: {lines[-1][-160:]}. Start the driver with the cluster's authentication settings "
        "(RAY_AUTH_MODE, RAY_AUTH_TOKEN / RAY_AUTH_TOKEN_PATH) or the cluster with the driver's"
    )
