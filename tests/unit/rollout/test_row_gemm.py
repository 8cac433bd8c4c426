"""rlflow's row GEMM (:mod:`rlflow.rollout.row_gemm`): the products against float64 references worked out here,
exact where every product and sum is representable and within the float32 summation bound elsewhere, at row
counts that take each micro-kernel (1-16 rows one panel at a time, more rows two panels at a time) and column
counts that are not multiples of the panel width; the residual add; strided operands; refused operands; packing
projections' weights straight (with a folded norm weight and a row scale) as torch would make and pack the matrix;
where
the kernel is not used (switched off, no AVX-512, a failed build: logged, MKL's products instead); threads that ask
for it at once build it once; each environment has its own build; a killed build's lock is removed."""

from __future__ import annotations

import logging

import pytest
import torch

from rlflow.rollout import prepack, row_gemm

needs_row_gemm = pytest.mark.skipif(not row_gemm.available(),
                                    reason=f"the row GEMM does not run here: "
                                           f"{row_gemm.unsupported_reason() or 'its build failed (see the log)'}")

ROWS = [1, 2, 5, 12, 13, 16, 17, 24, 25, 40, 333]
SHAPES = [(576, 960), (64, 37), (100, 16), (33, 49)]  # (in, out): multiples of 16 columns and not


def small_integers(*shape: int, seed: int) -> torch.Tensor:
    """float32 integers in [-4, 4]: every product and partial sum below is exact in float32."""
    return torch.randint(-4, 5, shape, generator=torch.Generator().manual_seed(seed)).float()


@needs_row_gemm
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_products_of_exactly_representable_values_are_exact(shape, rows):
    k, n = shape
    w, x, h = small_integers(k, n, seed=1), small_integers(rows, k, seed=2), small_integers(rows, n, seed=3)
    packed = row_gemm.pack(w)
    want = x.double() @ w.double()
    assert torch.equal(row_gemm.mm(x, packed, n).double(), want)
    assert torch.equal(row_gemm.mm(x, packed, n, h).double(), want + h.double())


@needs_row_gemm
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 16, 17, 333])
def test_products_are_within_the_float32_summation_bound(shape, rows):
    """|y - x @ w| <= gamma_k * (|x| @ |w|) with gamma_k = k u / (1 - k u), u = 2^-24: the bound of any order of
    k float32 fused multiply-adds, against the product in float64."""
    k, n = shape
    gen = torch.Generator().manual_seed(4)
    w, x = torch.randn(k, n, generator=gen), torch.randn(rows, k, generator=gen)
    got = row_gemm.mm(x, row_gemm.pack(w), n).double()
    unit = 2.0 ** -24
    bound = (k * unit / (1 - k * unit)) * (x.double().abs() @ w.double().abs())
    assert bool(((got - x.double() @ w.double()).abs() <= bound).all())


@needs_row_gemm
def test_the_residual_add_is_one_float32_add_after_the_product():
    w, x, h = torch.randn(576, 960), torch.randn(20, 576), torch.randn(20, 960)
    packed = row_gemm.pack(w)
    assert torch.equal(row_gemm.mm(x, packed, 960, h), row_gemm.mm(x, packed, 960) + h)


@needs_row_gemm
def test_strided_operands_give_the_contiguous_results():
    w = torch.randn(576, 960)
    packed = row_gemm.pack(w)
    wide = torch.randn(17, 700)
    x = wide[:, 50:626]  # rows 700 floats apart
    h_wide = torch.randn(17, 1000)
    h = h_wide[:, 20:980]
    want = row_gemm.mm(x.contiguous(), packed, 960, h.contiguous())
    assert torch.equal(row_gemm.mm(x, packed, 960, h), want)
    assert torch.equal(row_gemm.mm(x.t().contiguous().t(), packed, 960, h), want)  # columns apart: copied first
    assert row_gemm.mm(x[:0], packed, 960).shape == (0, 960)


@needs_row_gemm
def test_operands_that_do_not_match_are_refused():
    packed = row_gemm.pack(torch.randn(64, 32))
    with pytest.raises(RuntimeError, match="packed does not match"):
        row_gemm.mm(torch.randn(3, 65), packed, 32)
    with pytest.raises(RuntimeError, match="float32 CPU matrix"):
        row_gemm.mm(torch.randn(3, 64, dtype=torch.float64), packed, 32)
    with pytest.raises(RuntimeError, match="add must be float32"):
        row_gemm.mm(torch.randn(3, 64), packed, 32, torch.randn(2, 32))


#: (rows of each piece, in features): q/k/v-like pieces, panels that end inside a piece, partial last panels and
#: row lengths that are not multiples of 16
PIECES = [((576, 192, 192), 576), ((37,), 64), ((16, 17, 5), 33), ((576,), 1536)]


@needs_row_gemm
@pytest.mark.parametrize("sizes, k", PIECES)
@pytest.mark.parametrize("scaled", [False, True])
def test_pieces_packed_straight_equal_the_packing_of_the_matrix_torch_makes_of_them(sizes, k, scaled):
    """``pack_rows`` has the bits of ``pack`` of ``(torch.cat(pieces) * g`` with the first piece's rows then times a
    scale that is not a power of two), transposed, made with torch's operators; ``unpack`` gives that matrix back."""
    gen = torch.Generator().manual_seed(5)
    pieces = [torch.randn(n, k, generator=gen) for n in sizes]
    g = torch.randn(k, generator=gen) if scaled else None
    scales = [80 ** -0.5, *[1.0] * (len(pieces) - 1)] if scaled else None
    want = torch.cat(pieces)
    if scaled:
        want = want * g
        want[: sizes[0]] *= scales[0]
    packed = row_gemm.pack_rows(pieces, g, scales)
    assert torch.equal(packed, row_gemm.pack(want.t().contiguous()))
    assert torch.equal(row_gemm.unpack(packed, want.shape[0]), want.t())


@needs_row_gemm
def test_pieces_with_rows_apart_pack_as_contiguous_ones_and_bad_pieces_are_refused():
    wide = torch.randn(40, 100)
    piece = wide[:, 10:74]  # rows 100 floats apart
    assert torch.equal(row_gemm.pack_rows([piece]), row_gemm.pack_rows([piece.contiguous()]))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        row_gemm.pack_rows([piece.t()])
    with pytest.raises(RuntimeError, match="float32 CPU matrices"):
        row_gemm.pack_rows([torch.randn(4, 64), torch.randn(4, 32)])
    with pytest.raises(RuntimeError, match="float32 CPU matrices"):
        row_gemm.pack_rows([torch.randn(4, 64, dtype=torch.bfloat16)])
    with pytest.raises(RuntimeError, match="col_scale must be"):
        row_gemm.pack_rows([torch.randn(4, 64)], torch.randn(63))
    with pytest.raises(RuntimeError, match="one row scale per piece"):
        row_gemm.load().pack_rows([torch.randn(4, 64)], None, [1.0, 2.0])


def test_it_is_not_tried_where_switched_off_or_without_avx512(monkeypatch):
    def no_build(*args, **kwargs):
        raise AssertionError("built although not to be tried")

    monkeypatch.setattr("torch.utils.cpp_extension.load", no_build)
    monkeypatch.setenv("RLFLOW_ROW_GEMM", "0")
    assert row_gemm.unsupported_reason() == "RLFLOW_ROW_GEMM=0"
    assert row_gemm._build() is None
    monkeypatch.delenv("RLFLOW_ROW_GEMM")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    assert "AVX2, not AVX-512" in row_gemm.unsupported_reason()
    assert row_gemm._build() is None


def test_a_failed_build_is_logged_and_leaves_mkls_products(monkeypatch, caplog):
    def failing_build(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions")

    monkeypatch.delenv("RLFLOW_ROW_GEMM", raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_build)
    with caplog.at_level(logging.WARNING, logger="rlflow.rollout.row_gemm"):
        assert row_gemm._build() is None
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "rlflow: the row GEMM kernel could not be built (RuntimeError: Ninja is required to load C++ extensions); "
        "float32 decode products use MKL's kernel"]
    monkeypatch.setattr(row_gemm, "available", lambda: False)
    assert prepack.float32_kernel() == ("mkl" if prepack._mkl() else None)


def test_threads_that_ask_at_once_build_it_once(monkeypatch):
    import threading
    import time

    calls = []

    def slow_build():
        calls.append(1)
        time.sleep(0.2)
        return object()

    monkeypatch.setattr(row_gemm, "_LOADED", [])
    monkeypatch.setattr(row_gemm, "_build", slow_build)
    got = []
    threads = [threading.Thread(target=lambda: got.append(row_gemm.load())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(got) == 3 and got[0] is got[1] is got[2]


def test_each_environment_and_torch_version_has_a_build_of_its_own(monkeypatch):
    """torch keys a build by its name: two environments sharing a name would rebuild each other's every start."""
    here = row_gemm.extension_name()
    assert here == row_gemm.extension_name() and here.startswith("rlflow_row_gemm_")
    monkeypatch.setattr("sys.prefix", "/another/venv")
    other_env = row_gemm.extension_name()
    monkeypatch.undo()
    monkeypatch.setattr(torch, "__version__", "0.0.0")
    assert len({here, other_env, row_gemm.extension_name()}) == 3


def test_a_killed_builds_lock_is_removed_and_a_running_builds_is_waited_for(monkeypatch, tmp_path, caplog):
    """torch waits forever on the lock file of a build that was killed; rlflow removes a stale one first."""
    import os
    import threading
    import time

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    name = row_gemm.extension_name()
    lock = tmp_path / name / "lock"
    lock.parent.mkdir()
    lock.write_text("")
    old = time.time() - row_gemm.STALE_LOCK_SECONDS - 5
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger="rlflow.rollout.row_gemm"):
        row_gemm._wait_for_lock(name, poll=0.01)
    assert not lock.exists() and "build that did not finish" in caplog.text
    caplog.clear()
    lock.write_text("")  # a build running in another process, which releases it
    threading.Timer(0.2, lock.unlink).start()
    start = time.perf_counter()
    with caplog.at_level(logging.WARNING, logger="rlflow.rollout.row_gemm"):
        row_gemm._wait_for_lock(name, poll=0.01)
    assert time.perf_counter() - start >= 0.15 and not caplog.text
