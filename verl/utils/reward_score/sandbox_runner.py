"""The sandbox's in-process side: a supervisor that runs each test in a fresh, limited child interpreter.

Run by `sandbox.py` as a plain script (`python -I sandbox_runner.py supervise`), never imported by the
package at run time: it uses only the standard library so that it starts in milliseconds and needs no
verl, torch or site customisation. Two roles:

- `supervise`: reads the JSON spec (code, tests, limits) from stdin, keeps expected outputs in memory
  only, runs every test in a child (`child` role) with a wall-time limit, kills everything the child left
  behind, and writes one JSON line of per-test statuses to stdout. When it is pid 1 of a fresh pid
  namespace (the caller wraps it in `unshare --net --pid --fork --kill-child`), `kill(-1, SIGKILL)` ends
  every other process of the namespace, detached or not. Otherwise it is a child subreaper
  (PR_SET_CHILD_SUBREAPER) and kills, by scanning /proc, its descendants and the child's session.
- `child`: sets rlimits (RLIMIT_AS, RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_CORE), installs an audit
  hook, then executes the solution (and, for an assert test, the assert block followed by a per-test
  random nonce on stdout that the supervisor checks, so exiting early never passes).

The audit hook (best effort, in the child's own interpreter) refuses: socket creation, ctypes symbol
lookups and raw memory access (importing ctypes stays possible: numpy does), sending
signals, process creation (fork/exec/spawn/system/subprocess, unless the spec allows processes),
symlinks/hard links, writes (open for writing, remove, rename, mkdir, rmdir, chmod, chown, truncate,
utime, mknod) to paths outside the test's temp dir, and reads of files outside the temp dir, the
interpreter's own library folders (`sys.prefix`, `sys.path`, ...) and a few harmless system files (`READABLE_FILES`):
in particular no other process's /proc entries, so a program cannot read the supervisor's memory (where the
expected outputs are) or the host's files. A determined program can defeat an in-process hook;
the kernel-side limits (namespaces, rlimits, process-tree kill) are what the caller relies on.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import signal
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
KILL_DEADLINE_S = 3.0
STDERR_TAIL_CHARS = 600
# Modules whose functions create processes or call C without an audit event; never loaded in a child
# before its hook (the supervisor imports subprocess and ctypes only inside its own functions).
UNSAFE_MODULES = ("subprocess", "_posixsubprocess", "ctypes", "_ctypes")
# Files outside the temp dir and the interpreter's folders that a program may read.
READABLE_FILES = (
    "/dev/null",
    "/dev/zero",
    "/dev/urandom",
    "/dev/random",
    "/etc/localtime",
    "/proc/cpuinfo",
    "/proc/meminfo",
    "/proc/net/dev",
    "/proc/self/net/dev",
    "/proc/self/stat",
    "/proc/self/statm",
    "/proc/self/status",
)
READABLE_DIRS = ("/usr/share/zoneinfo",)


def _readable_roots() -> tuple[str, ...]:
    """The interpreter's own folders (stdlib, site-packages): imports read from them."""
    candidates = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path, *READABLE_DIRS]
    roots = {os.path.realpath(p) for p in candidates if isinstance(p, str) and p and os.path.isdir(p)}
    return tuple(sorted(root for root in roots if root != "/"))


# ----------------------------------------------------------------------------- child side
def _set_limits(memory_mb: int, cpu_s: int, fsize_bytes: int, nproc: int) -> None:
    limits = [
        (resource.RLIMIT_AS, memory_mb * 1024 * 1024),
        (resource.RLIMIT_CPU, cpu_s),
        (resource.RLIMIT_FSIZE, fsize_bytes),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_NPROC, nproc),
    ]
    for kind, value in limits:
        _, hard = resource.getrlimit(kind)
        if hard != resource.RLIM_INFINITY:
            value = min(value, hard)
        resource.setrlimit(kind, (value, value))


def _install_audit_hook(work_dir: str, block_processes: bool) -> None:
    """Refuse network, ctypes, signals, (optionally) processes and writes outside `work_dir`.

    Everything the hook needs is bound as a default argument so that patching modules or builtins from
    the solution does not change it; setting the hook's own attributes is refused too.
    """
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC
    process_events = frozenset(
        {"os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen"}
    )
    path_events = frozenset(
        {"os.remove", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.truncate", "os.utime", "os.mknod"}
    )
    always_blocked = frozenset(
        {"socket.__new__", "socket.connect", "socket.bind", "os.kill", "os.killpg", "signal.pthread_kill"}
        | {"os.symlink", "os.link", "os.pidfd_open", "resource.setrlimit", "resource.prlimit"}
    )
    # `_posixsubprocess.fork_exec` raises no audit event of its own: refuse the module when processes are
    blocked_imports = frozenset({"_posixsubprocess"} if block_processes else set())

    def normalise(path, _cwd=os.getcwd, _isinstance=isinstance, _str=str, _bytes=bytes):
        """The absolute, `..`-free form of `path` (None for anything but a str/bytes path)."""
        if _isinstance(path, _bytes):
            path = path.decode("utf-8", "surrogateescape")
        if not _isinstance(path, _str):
            return None
        if not path.startswith("/"):
            path = _cwd() + "/" + path
        parts: list = []
        for part in path.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        return "/" + "/".join(parts)

    def inside(path, _normalise=normalise, _root=work_dir) -> bool:
        normalised = _normalise(path)
        if normalised is None:
            return False
        return normalised == _root or normalised.startswith(_root + "/") or normalised == "/dev/null"

    def readable(
        path, _normalise=normalise, _inside=inside, _roots=_readable_roots(), _files=frozenset(READABLE_FILES)
    ) -> bool:
        if _inside(path):
            return True
        normalised = _normalise(path)
        if normalised is None:
            return False
        return normalised in _files or any(normalised == r or normalised.startswith(r + "/") for r in _roots)

    def hook(
        event,
        args,
        _inside=inside,
        _readable=readable,
        _helpers=(inside, readable, normalise),
        _always=always_blocked,
        _process=process_events if block_processes else frozenset(),
        _paths=path_events,
        _imports=blocked_imports,
        _write_flags=write_flags,
        _isinstance=isinstance,
        _str=str,
        _int=int,
        _error=PermissionError,
    ):
        if event in _always or event in _process:
            raise _error(f"sandbox: {event} is not allowed")
        # ctypes may be imported (numpy does: dlopen(None)), but not used to reach C functions or memory
        if event.startswith("ctypes.") and not (event == "ctypes.dlopen" and args[0] is None):
            raise _error(f"sandbox: {event} is not allowed")
        if event == "import" and args[0] in _imports:
            raise _error(f"sandbox: importing {args[0]} is not allowed")
        if event == "object.__setattr__" and (args[0] is hook or any(args[0] is f for f in _helpers)):
            raise _error("sandbox: the audit hook cannot be changed")
        if event == "open":
            path, mode, flags = args
            if _isinstance(path, _int):  # re-opening an inherited descriptor, e.g. open(1, "w")
                return
            if _isinstance(mode, _str):
                writes = "w" in mode or "a" in mode or "x" in mode or "+" in mode
            else:  # os.open: a relative path might be relative to a dir_fd the event does not show
                writes = bool(flags & _write_flags)
                if writes and not (_isinstance(path, _str) and path.startswith("/")) and path != b"/dev/null":
                    raise _error("sandbox: os.open for writing needs an absolute path inside the temp dir")
            if writes and not _inside(path):
                raise _error(f"sandbox: writing {path!r} outside the temp dir is not allowed")
            if not writes and not _readable(path):
                raise _error(f"sandbox: reading {path!r} outside the temp dir is not allowed")
        elif event in _paths:
            dir_fd = None if event == "os.truncate" else args[-1]
            if not _inside(args[0]) or dir_fd not in (None, -1):
                raise _error(f"sandbox: {event} on {args[0]!r} outside the temp dir is not allowed")
        elif event == "os.rename":
            src, dst, src_dir_fd, dst_dir_fd = args
            if not (_inside(src) and _inside(dst)) or src_dir_fd not in (None, -1) or dst_dir_fd not in (None, -1):
                raise _error(f"sandbox: renaming {src!r} -> {dst!r} outside the temp dir is not allowed")
        elif event == "shutil.rmtree" and not _inside(args[0]):
            raise _error(f"sandbox: removing {args[0]!r} outside the temp dir is not allowed")

    sys.addaudithook(hook)


def child_main(argv: list[str]) -> None:
    """`child MODE WORK_DIR MEMORY_MB CPU_S FSIZE NPROC BLOCK_PROCESSES [ASSERT_FILE]`."""
    mode, work_dir = argv[0], argv[1]
    memory_mb, cpu_s, fsize, nproc, block = (int(value) for value in argv[2:7])
    with open(os.path.join(work_dir, "solution.py"), encoding="utf-8") as handle:
        code = handle.read()
    asserts = nonce = None
    if mode == "assert":
        with open(argv[7], encoding="utf-8") as handle:
            asserts = handle.read()
        os.remove(argv[7])  # the solution cannot read the tests it is checked with
        nonce = sys.stdin.readline().strip()
        sys.stdin = open(os.devnull, encoding="utf-8")  # the nonce line is all an assert test reads
    sys.dont_write_bytecode = True
    for name in UNSAFE_MODULES:  # a later import must go through the (audited) import system again
        sys.modules.pop(name, None)
    _set_limits(memory_mb, cpu_s, fsize, nproc)
    _install_audit_hook(work_dir, bool(block))
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile(code, "solution.py", "exec"), namespace)
    if asserts is not None:
        exec(compile(asserts, "tests.py", "exec"), namespace)
        sys.stdout.write("\n" + nonce + "\n")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- supervisor side
def _proc_table() -> dict[int, tuple[int, int]]:
    """pid -> (ppid, session id) for every visible process."""
    table = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            table[int(name)] = (int(fields[1]), int(fields[3]))
        except (OSError, IndexError, ValueError):
            continue
    return table


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _leftovers(session_id: int) -> list[int]:
    """Processes in the child's session or below this supervisor (orphans reparent to a subreaper)."""
    me, table = os.getpid(), _proc_table()
    found = []
    for pid, (ppid, sid) in table.items():
        if pid == me:
            continue
        ancestor, hops = ppid, 0
        while ancestor not in (0, 1, me) and ancestor in table and hops < 4096:
            ancestor, hops = table[ancestor][0], hops + 1
        if sid == session_id or ancestor == me:
            found.append(pid)
    return found


def _kill_everything_left(child_pid: int) -> bool:
    """Kill every process the child started; True when none is left within KILL_DEADLINE_S."""
    try:
        os.killpg(child_pid, signal.SIGKILL)
    except OSError:
        pass
    deadline = time.monotonic() + KILL_DEADLINE_S
    while time.monotonic() < deadline:
        if os.getpid() == 1:  # init of our own pid namespace: -1 means exactly the rest of the namespace
            try:
                os.kill(-1, signal.SIGKILL)
            except ProcessLookupError:
                return True
        else:
            victims = _leftovers(child_pid)
            if not victims:
                return True
            for pid in victims:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        _reap()
        time.sleep(0.002)
    return False


def _become_subreaper() -> None:
    if os.getpid() == 1:
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):  # no libc prctl: the session scan still applies
        pass


def _uid_process_count() -> int:
    uid, count = os.getuid(), 0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                count += os.stat(f"/proc/{name}").st_uid == uid
            except OSError:
                continue
    return count


def _normalise_output(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").strip().split("\n")]
    return lines


def _read_capped(path: str, cap: int) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.read(cap).decode("utf-8", "replace")
    except OSError:
        return ""


def _run_one(spec: dict, index: int, test: dict, nproc: int) -> dict:
    import subprocess  # supervisor only: a child must not start with it loaded

    work_dir = spec["work_dir"]
    timeout_s = float(spec["timeout_s"])
    out_path = os.path.join(work_dir, f"stdout_{index}.txt")
    err_path = os.path.join(work_dir, f"stderr_{index}.txt")
    args = [
        sys.executable,
        "-I",
        os.path.abspath(__file__),
        "child",
        test["kind"],
        work_dir,
        str(int(spec["memory_mb"])),
        str(int(timeout_s) + 1),
        str(int(spec["max_output_bytes"])),
        str(nproc),
        str(int(not spec["allow_processes"])),
    ]
    nonce = secrets.token_hex(16)
    if test["kind"] == "assert":
        assert_path = os.path.join(work_dir, f"tests_{index}.py")
        with open(assert_path, "w", encoding="utf-8") as handle:
            handle.write(test["code"])
        args.append(assert_path)
        stdin_text = nonce + "\n"
    else:
        stdin_text = test["input"]
    in_path = os.path.join(work_dir, f"stdin_{index}.txt")
    with open(in_path, "w", encoding="utf-8") as handle:
        handle.write(stdin_text)
    env = {"HOME": work_dir, "TMPDIR": work_dir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
    start = time.monotonic()
    with open(in_path, "rb") as stdin, open(out_path, "wb") as stdout, open(err_path, "wb") as stderr:
        child = subprocess.Popen(
            args, stdin=stdin, stdout=stdout, stderr=stderr, cwd=work_dir, env=env, start_new_session=True
        )
    os.remove(in_path)  # the child holds it open; a later test cannot read this one's input
    try:
        returncode = child.wait(timeout=timeout_s)
        timed_out = False
    except subprocess.TimeoutExpired:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except OSError:  # already gone
            pass
        returncode = child.wait()
        timed_out = True
    wall_s = time.monotonic() - start
    clean = _kill_everything_left(child.pid)
    cap = int(spec["max_output_bytes"])
    output = _read_capped(out_path, cap)
    if timed_out:
        status = "timeout"
    elif returncode == -signal.SIGXFSZ or os.path.getsize(out_path) >= cap:  # Python ignores SIGXFSZ: EFBIG
        status = "output_limit"
    elif returncode != 0:
        status = f"runtime_error({returncode})"
    elif test["kind"] == "assert":
        status = "passed" if output.rstrip("\n").split("\n")[-1] == nonce else "no_completion"
    else:
        status = "passed" if _normalise_output(output) == _normalise_output(test["output"]) else "wrong_answer"
    if not clean:
        status = "leftover_processes"
    stderr_tail = _read_capped(err_path, cap)[-STDERR_TAIL_CHARS:]
    return {"status": status, "passed": status == "passed", "wall_s": round(wall_s, 3), "stderr_tail": stderr_tail}


def supervise_main() -> None:
    spec = json.loads(sys.stdin.read())
    _become_subreaper()
    with open(os.path.join(spec["work_dir"], "solution.py"), "w", encoding="utf-8") as handle:
        handle.write(spec["code"])
    nproc = _uid_process_count() + int(spec["max_processes"])
    results = [_run_one(spec, index, test, nproc) for index, test in enumerate(spec["tests"])]
    namespaced = os.getpid() == 1
    sys.stdout.write(json.dumps({"results": results, "pid_namespace": namespaced}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "supervise":
        supervise_main()
    elif len(sys.argv) >= 9 and sys.argv[1] == "child":
        child_main(sys.argv[2:])
    else:
        sys.exit(f"usage: {sys.argv[0]} supervise < spec.json | child MODE WORK_DIR MEMORY_MB CPU_S FSIZE NPROC BLOCK")
