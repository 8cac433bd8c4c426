"""benchmarks/bench_decode_attention.py on a CPU: every variant (the engine's group cache, cascade attention through a
fused kernel and in float32 products, one call over per-row copies) computes the same attention, which is also checked
here against a loop over rows and heads written from the softmax formula, with and without padding."""

from __future__ import annotations

import pytest
import torch

from benchmarks import bench_decode_attention as bench


def test_every_variant_agrees_with_the_group_cache(capsys):
    results = bench.main(["--shapes", "2x4x5x3", "3x2x7x6", "--heads", "4", "2", "--dim", "16", "--repeats", "1"])
    assert {(r["shape"], r["variant"]) for r in results} == {
        (shape, v) for shape in ("2x4x5x3", "3x2x7x6")
        for v in ("group", "cascade", "cascade-math", "per-row", "per-row-masked", "groups-of-one")}
    assert all(r["diff"] < 1e-5 and r["us"] > 0 and r["first_ms"] > 0 for r in results)
    assert "copy rate" in capsys.readouterr().out


def reference(query, prompt_k, prompt_v, prompt_bias, own_k, own_v, own_bias, n, scale):
    rows, heads, dim = query.shape
    rep = heads // prompt_k.shape[1]
    out = torch.empty(rows, heads, dim, dtype=torch.float64)
    for r in range(rows):
        g = r // n
        for h in range(heads):
            kv = h // rep
            keys = torch.cat([prompt_k[g, kv], own_k[r, kv]]).double()
            values = torch.cat([prompt_v[g, kv], own_v[r, kv]]).double()
            bias = torch.cat([prompt_bias[g], own_bias[r]]).double()
            weights = torch.softmax(keys @ query[r, h].double() * scale + bias, dim=0)
            out[r, h] = weights @ values
    return out.reshape(rows, heads * dim)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_cascade_attention_is_the_softmax_over_prompt_and_own_tokens(masked, fused, monkeypatch):
    if not fused:
        monkeypatch.setitem(bench._KERNELS, ("cpu", False), False)
        monkeypatch.setitem(bench._KERNELS, ("cpu", True), False)
    gen = torch.Generator().manual_seed(0)
    groups, n, kv, rep, dim, prompt, own = 3, 4, 2, 3, 8, 7, 5
    rows = groups * n

    def rand(*size):
        return torch.randn(*size, generator=gen)

    query, prompt_k, prompt_v = rand(rows, kv * rep, dim), rand(groups, kv, prompt, dim), rand(groups, kv, prompt, dim)
    own_k, own_v = rand(rows, kv, own, dim), rand(rows, kv, own, dim)
    prompt_bias, own_bias = torch.zeros(groups, prompt), torch.zeros(rows, own)
    if masked:  # padding in one group's prompt, one row's last token not written yet
        prompt_bias[1, -3:] = float("-inf")
        own_bias[5, -1] = float("-inf")
    got = bench.cascade_attend(query, prompt_k, prompt_v, prompt_bias if masked else None, own_k, own_v,
                               own_bias if masked else None, n, dim ** -0.5)
    want = reference(query, prompt_k, prompt_v, prompt_bias, own_k, own_v, own_bias, n, dim ** -0.5)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
