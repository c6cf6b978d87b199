"""Tests of verl/cpu/blas.py: CPU float32 products through OpenBLAS equal torch's own kernels (called through
the `.out` overloads, which the module leaves alone), in every layout and through autograd; the choice of backend
and its refusals."""

import pytest
import torch

from verl.cpu import blas as cpu_blas


@pytest.fixture
def openblas(monkeypatch):
    """OpenBLAS installed for the test (for products from 4,096 multiply-adds and 16 rows: the test's are small),
    torch's kernels back after it; skipped where it cannot load."""
    monkeypatch.setattr(cpu_blas, "MIN_FLOPS", 1 << 12)
    monkeypatch.setattr(cpu_blas, "MIN_ROWS", 16)
    try:
        assert cpu_blas.install("openblas")
    except RuntimeError as e:
        pytest.skip(str(e))
    calls = []
    real = cpu_blas._gemm
    cpu_blas._gemm = lambda *args: calls.append(args[0].shape) or real(*args)
    yield calls
    cpu_blas._gemm = real
    cpu_blas.uninstall()


def _torch_mm(a, b):
    return torch.ops.aten.mm.out(a, b, out=a.new_empty(a.shape[0], b.shape[1]))


@pytest.mark.parametrize("rows", [37, 600])  # rows split over 2 threads in blocks of 16: uneven, and even
@pytest.mark.parametrize("a_t,b_t", [(False, False), (True, False), (False, True), (True, True)])
def test_products_equal_torchs_in_every_layout(openblas, rows, a_t, b_t):
    torch.manual_seed(0)
    torch.set_num_threads(2)
    a = torch.randn(300, rows).t() if a_t else torch.randn(rows, 300)
    b = torch.randn(130, 300).t() if b_t else torch.randn(300, 130)
    torch.testing.assert_close(a @ b, _torch_mm(a, b), rtol=1e-5, atol=1e-4)
    bias = torch.randn(130)
    out = torch.addmm(bias, a, b, beta=0.5, alpha=2.0)
    torch.testing.assert_close(out, 0.5 * bias + 2.0 * _torch_mm(a, b), rtol=1e-5, atol=2e-4)
    c = torch.randn(rows, 130)
    expected = 0.25 * c + _torch_mm(a, b)
    assert c.addmm_(a, b, beta=0.25) is c
    torch.testing.assert_close(c, expected, rtol=1e-5, atol=1e-4)
    assert len(openblas) == 3  # all three went through OpenBLAS


def test_beta_zero_ignores_nan_in_self_as_torch_does(openblas):
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    self = torch.full((64, 64), float("nan"))
    torch.testing.assert_close(torch.addmm(self, a, b, beta=0), _torch_mm(a, b), rtol=1e-5, atol=1e-4)
    assert not self.addmm_(a, b, beta=0).isnan().any()


def test_a_layout_blas_cannot_read_is_copied_first(openblas):
    base = torch.randn(200, 2, 300)
    a = base[:, 0, :]  # rows 600 floats apart, columns 1: row-major with lda 600
    b = torch.randn(300, 50, 2)[:, :, 1]  # columns 2 floats apart: not a BLAS layout
    torch.testing.assert_close(a @ b, _torch_mm(a.contiguous(), b.contiguous()), rtol=1e-5, atol=1e-4)
    assert openblas == [(200, 300)]


def test_linear_forward_and_backward_equal_torchs(openblas):
    torch.manual_seed(1)
    x = torch.randn(4, 90, 64, requires_grad=True)
    w = torch.randn(96, 64, requires_grad=True)
    b = torch.randn(96, requires_grad=True)
    (torch.nn.functional.linear(x, w, b).sin().sum()).backward()
    grads = [t.grad.clone() for t in (x, w, b)]
    assert len(openblas) == 3  # forward, d input, d weight
    cpu_blas.uninstall()
    for t in (x, w, b):
        t.grad = None
    (torch.nn.functional.linear(x, w, b).sin().sum()).backward()
    for got, t in zip(grads, (x, w, b)):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-4)


def test_small_other_dtype_and_uninstalled_products_stay_with_torch(openblas):
    small = torch.randn(8, 16)  # 1,024 multiply-adds: under MIN_FLOPS
    torch.testing.assert_close(small @ small.t(), _torch_mm(small, small.t()))
    few_rows = torch.randn(15, 400)  # 15 x 400 x 15 = 90,000 multiply-adds, but under MIN_ROWS
    torch.testing.assert_close(few_rows @ few_rows.t(), _torch_mm(few_rows, few_rows.t()))
    half = torch.randn(128, 128, dtype=torch.bfloat16)
    torch.testing.assert_close(half @ half, _torch_mm(half, half))
    assert openblas == []
    cpu_blas.uninstall()
    assert not cpu_blas.active()
    big = torch.randn(128, 128)
    big @ big
    assert openblas == []


def test_the_choice_and_its_refusals(monkeypatch):
    cpu_blas.uninstall()  # as in a fresh process
    monkeypatch.setenv(cpu_blas.ENV, "mkl")
    with pytest.raises(ValueError, match="VERL_CPU_BLAS='mkl': allowed are auto, openblas, torch"):
        cpu_blas.install()
    assert not cpu_blas.install("torch") and not cpu_blas.prepare("torch")
    monkeypatch.setattr(cpu_blas, "_amd_cpu", lambda: False)
    assert not cpu_blas.install("auto")  # not an AMD processor: MKL stays
    monkeypatch.setattr(cpu_blas, "_amd_cpu", lambda: True)
    monkeypatch.setattr(cpu_blas, "_load", lambda: "the scipy-openblas32 wheel is not installed")
    assert not cpu_blas.install("auto")  # one notice, MKL stays
    with pytest.raises(RuntimeError, match="VERL_CPU_BLAS=openblas: the scipy-openblas32 wheel is not installed"):
        cpu_blas.install("openblas")
    assert not cpu_blas.active()


def test_products_registers_openblas_for_the_block_only(monkeypatch):
    cpu_blas.uninstall()
    try:
        ready = cpu_blas.prepare("openblas")
    except RuntimeError as e:
        pytest.skip(str(e))
    assert ready and not cpu_blas.active()  # prepared, not registered: decode steps keep torch's kernels
    with cpu_blas.products():
        assert cpu_blas.active()
        with cpu_blas.products():  # nested: the outer block owns the registration
            assert cpu_blas.active()
        assert cpu_blas.active()
    assert not cpu_blas.active()
    with pytest.raises(ValueError, match="boom"), cpu_blas.products():
        raise ValueError("boom")
    assert not cpu_blas.active()  # put back after an error too
    cpu_blas.prepare("torch")
    with cpu_blas.products():
        assert not cpu_blas.active()
