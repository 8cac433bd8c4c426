"""benchmarks/bench_row_gemm.py on a CPU: every kernel it times computes the same product (to float32 rounding),
and a run prints a step's total per kernel with its ratio against MKL's."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_row_gemm as bench
from rlflow.rollout import prepack, row_gemm


@pytest.mark.parametrize("rows", [1, 5, 16, 20])
def test_every_kernel_computes_the_same_product(rows):
    weight_t = torch.randn(96, 80)
    x = torch.randn(rows, 96)
    found = bench.kernels(weight_t, rows)
    assert {"torch.mm", *(["mkl"] if prepack._mkl() else []), *(["onednn"] if prepack._onednn() else []),
            *(["row_gemm"] if row_gemm.available() else [])} == set(found)
    want = x.double() @ weight_t.double()
    for name, product in found.items():
        assert torch.allclose(product(x).double(), want, rtol=0, atol=1e-4), name


def test_a_run_prints_each_kernels_step_against_mkl(capsys):
    results = bench.main(["--rows", "3", "--shapes", "qq:64:48:2,rr:48:32:1", "--repeats", "1", "--min-mib", "0"])
    out = capsys.readouterr().out
    step = results["steps"][3]
    assert set(step) >= {"torch.mm"} and all(t > 0 for t in step.values())
    assert results["bandwidth"] > 0 and "copy bandwidth" in out
    assert out.count("rows    3  qq ") == 1 and out.count("rows    3  rr ") == 1 and "a step" in out
    if "mkl" in step:
        assert "1.00x mkl" in out


@pytest.mark.skipif(not row_gemm.available(), reason="the row GEMM does not run here")
def test_packing_times_the_straight_packing_against_torchs_operators_and_a_copy(capsys):
    results = bench.main(["--rows", "2", "--shapes", "qq:64:48:2", "--repeats", "1", "--min-mib", "0", "--packing"])
    assert set(results["packing"]) == {"straight", "torch ops", "copy"}
    assert all(t > 0 for t in results["packing"].values())
    out = capsys.readouterr().out
    assert "packing a step's matrices: straight" in out and "x straight's" in out
