"""float32 matrix products on the CPU through OpenBLAS instead of torch's MKL, where that is faster: `install`.

Owns the choice (`VERL_CPU_BLAS`: `auto`, `openblas` or `torch`; `auto` takes OpenBLAS on AMD processors when the
`scipy-openblas32` wheel and a C compiler are there), the CPU kernels it registers for aten's `mm`, `addmm` and
`addmm_` while inside `products()`, and the C helper that splits a product's rows over torch's OpenMP threads.
Other dtypes, devices, products under `MIN_FLOPS` and layouts needing a copy go to torch's kernel.
Layer 2: torch and verl.cpu.native_build.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator

import torch

from verl.cpu import native_build

logger = logging.getLogger(__name__)

ENV = "VERL_CPU_BLAS"
CHOICES = ("auto", "openblas", "torch")
# Products of fewer multiply-adds stay with torch's kernel, and so do products of fewer than MIN_ROWS rows (a decode
# whose rows finished): measured alone, OpenBLAS lost to MKL there (benchmarks/README.md).
MIN_FLOPS = 1 << 20
MIN_ROWS = 128

_SOURCE = r"""
#include <stdint.h>
#include <omp.h>

typedef void (*sgemm_t)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float *a,
                        int lda, const float *b, int ldb, float beta, float *c, int ldc);

/* c (m x n, row-major, ldc) = alpha op(a) op(b) + beta c, where op(a) is (m x k): a row-major with lda, or, with
   trans_a, a (k x m) row-major with lda; the same for b (k x n). The rows of c are split over `threads` OpenMP
   threads (whole blocks of 16), each calling the single-threaded BLAS `sgemm` on its rows. */
void gemm_rows(void *fn, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
               int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc, int threads) {
    const sgemm_t sgemm = (sgemm_t)fn;
    if (threads > (m + 15) / 16) threads = (int)((m + 15) / 16);
    if (threads < 1) threads = 1;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), count = omp_get_num_threads();
        const int64_t chunk = ((m + count - 1) / count + 15) / 16 * 16;
        const int64_t lo = t * chunk, hi = lo + chunk < m ? lo + chunk : m;
        if (lo < hi) {
            const float *rows = trans_a ? a + lo : a + lo * lda;
            sgemm(101, trans_a ? 112 : 111, trans_b ? 112 : 111, (int)(hi - lo), (int)n, (int)k, alpha, rows,
                  (int)lda, b, (int)ldb, beta, c + lo * ldc, (int)ldc);
        }
    }
}
"""

_lock = threading.Lock()
_state: dict = {}  # "helper", "sgemm" (the function pointer), "library" (torch.library.Library while installed)


def choice_from_env() -> str:
    value = os.environ.get(ENV, "auto")
    if value not in CHOICES:
        raise ValueError(f"{ENV}={value!r}: allowed are {', '.join(CHOICES)}")
    return value


@functools.cache
def _amd_cpu() -> bool:
    return "AuthenticAMD" in native_build.cpu_signature()  # its vendor_id line


def _load() -> str | None:
    """Load OpenBLAS and build the helper; None when both are there, else why not."""
    if "sgemm" in _state:
        return None
    try:
        wheel = importlib.import_module("scipy_openblas32")
    except ImportError:
        return "the scipy-openblas32 wheel is not installed"
    try:
        blas = ctypes.CDLL(os.path.join(wheel.get_lib_dir(), f"lib{wheel.get_library()}.so"))
        sgemm, set_threads = blas.scipy_cblas_sgemm, blas.scipy_openblas_set_num_threads
    except (OSError, AttributeError) as e:
        return f"OpenBLAS did not load ({e})"
    helper = native_build.build_library("cpu_gemm_rows", _SOURCE)
    if helper is None:
        return "its C helper could not be built (no C compiler?)"
    set_threads.argtypes = [ctypes.c_int]
    set_threads(1)  # every call runs on the calling thread: the helper splits the rows over torch's threads
    helper.gemm_rows.restype = None
    helper.gemm_rows.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                 ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                                 ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]  # fmt: skip
    _state.update(blas=blas, helper=helper, sgemm=ctypes.cast(sgemm, ctypes.c_void_p).value)
    return None


def _operand(t: torch.Tensor) -> tuple[bool, int] | None:
    """(transposed, leading dimension) of a 2-D matrix as BLAS reads it without a copy, or None."""
    rows, cols = t.shape
    if t.stride(1) == 1 and t.stride(0) >= max(1, cols):
        return False, t.stride(0)
    if t.stride(0) == 1 and t.stride(1) >= max(1, rows):
        return True, t.stride(1)
    return None


def _takes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype == torch.float32
        and a.device.type == b.device.type == "cpu"
        and a.dim() == b.dim() == 2
        and a.shape[0] * a.shape[1] * b.shape[1] >= MIN_FLOPS
        and a.shape[0] >= MIN_ROWS
        and max(*a.shape, b.shape[1]) < 2**31
        and not a.is_conj()
        and not b.is_conj()
    )


def _gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """out (contiguous m x n) = alpha a b + beta out, through OpenBLAS."""
    layout_a, layout_b = _operand(a), _operand(b)
    if layout_a is None:
        a, layout_a = a.contiguous(), (False, a.shape[1])
    if layout_b is None:
        b, layout_b = b.contiguous(), (False, b.shape[1])
    m, k = a.shape
    _state["helper"].gemm_rows(_state["sgemm"], layout_a[0], layout_b[0], m, b.shape[1], k, alpha, a.data_ptr(),
                               layout_a[1], b.data_ptr(), layout_b[1], beta, out.data_ptr(), out.stride(0),
                               torch.get_num_threads())  # fmt: skip
    return out


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[1]))
    if not _takes(a, b):
        return torch.ops.aten.mm.out(a, b, out=out)
    return _gemm(a, b, out, 1.0, 0.0)


def _addmm(self: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    out = a.new_empty((a.shape[0], b.shape[1]))
    if not _takes(a, b) or self.dtype != torch.float32 or self.device.type != "cpu" or beta != beta:
        return torch.ops.aten.addmm.out(self, a, b, beta=beta, alpha=alpha, out=out)
    if beta != 0:  # beta = 0 ignores self, nan and inf included (torch's rule)
        out.copy_(self.expand_as(out))
    return _gemm(a, b, out, float(alpha), float(beta) if beta != 0 else 0.0)


def _addmm_(self: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1) -> torch.Tensor:
    fits = self.dim() == 2 and self.is_contiguous() and tuple(self.shape) == (a.shape[0], b.shape[1])
    if not fits or not _takes(a, b) or self.dtype != torch.float32 or beta != beta:
        return torch.ops.aten.addmm.out(self, a, b, beta=beta, alpha=alpha, out=self)
    if beta == 0:
        self.zero_()
    return _gemm(a, b, self, float(alpha), float(beta))


def active() -> bool:
    """Whether this process's CPU float32 products run through OpenBLAS now."""
    return "library" in _state


def prepare(choice: str | None = None) -> bool:
    """Decide per `choice` (`VERL_CPU_BLAS` when None) whether this process's training passes multiply through
    OpenBLAS (`products`), and load it: `openblas` (refused with the reason when OpenBLAS or the C helper is
    missing), `torch` (no), `auto` (on AMD processors when it is there; one notice line when it is not). Returns the
    decision. Idempotent."""
    choice = choice_from_env() if choice is None else choice
    if choice not in CHOICES:
        raise ValueError(f"{ENV}={choice!r}: allowed are {', '.join(CHOICES)}")
    with _lock:
        _state["wanted"] = False
        if choice == "torch" or (choice == "auto" and not _amd_cpu()):
            return False
        missing = _load()
        if missing is not None:
            if choice == "openblas":
                raise RuntimeError(f"{ENV}=openblas: {missing}; install scipy-openblas32 and a C compiler, or set "
                                   f"{ENV}=torch")  # fmt: skip
            logger.warning("CPU matrix products stay with torch's MKL: %s", missing)
            return False
        _state["wanted"] = True
        return True


@contextlib.contextmanager
def products() -> Iterator[None]:
    """Within the block, CPU float32 products go through OpenBLAS when `prepare` chose it (nested blocks: the
    outermost decides). Outside, torch's own kernels run: the override's Python dispatch of every call is paid
    only where the products are large (training passes), not by the decode steps' small ones."""
    if not _state.get("wanted") or active():
        yield
        return
    _register()  # the decision `prepare` made: not read again from the environment on every pass
    try:
        yield
    finally:
        uninstall()


def install(choice: str | None = None) -> bool:
    """Route this process's CPU float32 `mm`/`addmm`/`addmm_` through OpenBLAS now, until `uninstall`, when
    `prepare(choice)` chooses it. Returns whether it is active. Idempotent."""
    if not prepare(choice):
        return active()
    _register()
    return True


def _register() -> None:
    with _lock:
        if active():
            return
        library = torch.library.Library("aten", "IMPL")
        with warnings.catch_warnings():  # torch warns once that a registered kernel is overridden: that is the point
            warnings.simplefilter("ignore", UserWarning)
            library.impl("mm", _mm, "CPU")
            library.impl("addmm", _addmm, "CPU")
            library.impl("addmm_", _addmm_, "CPU")
        _state["library"] = library


def uninstall() -> None:
    """Put torch's own CPU kernels back."""
    with _lock:
        library = _state.pop("library", None)
        if library is not None:
            library._destroy()
