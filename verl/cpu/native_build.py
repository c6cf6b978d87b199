"""Small C kernels compiled at first use: `build_library`.

Owns the build of a C source into a shared library (gcc or cc, `-O3 -march=native -fopenmp`) in a per-user cache
(`$XDG_CACHE_HOME/verl/kernels`, else `~/.cache/verl/kernels`), keyed by the source, the flags, the compiler and the
CPU (a cache on a shared home directory must not hand one machine's build to another), and its loading with ctypes.
The library binds to the libgomp torch has already loaded (same soname), so its OpenMP regions run on torch's thread
team. No compiler, a failed build or an unloadable library give None and one warning; callers keep their torch path.

Layer 2 (verl/cpu): the standard library only; must not import Ray.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared")


def cpu_signature() -> str:
    """What `-march=native` compiles for: the CPU's model name and flags."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [line for line in f if line.startswith(("model name", "flags", "vendor_id"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return os.uname().machine


def cache_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "verl", "kernels")


def compiler() -> str | None:
    """The C compiler to build with: `$CC`, else gcc, else cc; None when there is none (or not on Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    for name in (os.environ.get("CC"), "gcc", "cc"):
        if name and shutil.which(name):
            return name
    return None


def build_library(name: str, source: str) -> ctypes.CDLL | None:
    """`source` compiled into `<cache_dir>/<name>_<key>.so` (once; reused after) and loaded, or None with a warning
    naming what failed. Concurrent builders each write a temporary file and move it into place atomically."""
    cc = compiler()
    if cc is None:
        return None
    key = hashlib.sha256("\0".join([source, " ".join(FLAGS), cc, cpu_signature()]).encode()).hexdigest()
    path = os.path.join(cache_dir(), f"{name}_{key[:16]}.so")
    try:
        if not os.path.isfile(path):
            os.makedirs(cache_dir(), exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
                src, built = os.path.join(tmp, f"{name}.c"), os.path.join(tmp, f"{name}.so")
                with open(src, "w", encoding="utf-8") as f:
                    f.write(source)
                done = subprocess.run([cc, *FLAGS, src, "-o", built], capture_output=True, text=True)
                if done.returncode != 0:
                    reason = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
                    logger.warning("%s: %s failed (%s); using torch's ops", name, cc, reason)
                    return None
                os.replace(built, path)
        return ctypes.CDLL(path)
    except OSError as e:  # an unwritable cache, a library that does not load
        logger.warning("%s unavailable (%s); using torch's ops", name, e)
        return None
