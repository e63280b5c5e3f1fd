"""Row-kernel plumbing: the row view and the default ladder against its validity predicate."""

from __future__ import annotations

import pytest
import torch

from flydsl_common.rows import MAX_SINGLE_PASS, RowConfig, as_rows, default_row_config, row_config_valid

WIDTHS = [1, 7, 255, 257, 1024, 4095, 4097, 8192, 16384, 16385, 32768, 65537, 262144, 1048576]


@pytest.mark.parametrize("arch", ["sm_90", "sm_80", "gfx942", "cpu"])
@pytest.mark.parametrize("n", WIDTHS)
def test_default_ladder_is_valid(n, arch):
    cfg = default_row_config(n, arch)
    assert row_config_valid(cfg, n, arch), cfg
    assert cfg.single_pass == (n <= MAX_SINGLE_PASS)
    assert cfg.block_m * cfg.block_n // (32 * cfg.num_warps) <= 64  # at most 64 values per thread


def test_validity_predicate_rejects():
    assert not row_config_valid(RowConfig(1, 1024, 4, True), 2000)  # single pass must cover the row
    assert not row_config_valid(RowConfig(2, 1024, 4, False), 5000)  # chunked rows: one per program
    assert not row_config_valid(RowConfig(1, 1000, 4, True), 1000)  # powers of two only
    assert not row_config_valid(RowConfig(1, 32768, 32, False), 65536, "gfx942")  # 2048 threads
    assert row_config_valid(RowConfig(1, 32768, 32, False), 65536, "sm_90")


def test_register_caps():
    capped = RowConfig(1, 4096, 8, True, maxnreg=128)
    assert row_config_valid(capped, 4096, "sm_90")
    assert capped.launch_options() == {"num_warps": 8, "maxnreg": 128}
    assert RowConfig(1, 4096, 8, True).launch_options() == {"num_warps": 8}
    assert not row_config_valid(capped, 4096, "gfx942")  # Triton's maxnreg is NVIDIA's
    for bad in (20, 100, 256):  # under 24, not a multiple of 8, over 255
        assert not row_config_valid(RowConfig(1, 4096, 8, True, maxnreg=bad), 4096, "sm_90")


def test_as_rows_views_without_copy():
    x = torch.randn(2, 3, 8)
    r = as_rows(x)
    assert r.shape == (6, 8) and r.data_ptr() == x.data_ptr()
    s = torch.randn(5, 20)[:, 2:10]  # strided rows stay a view
    assert as_rows(s).stride() == (20, 1) and as_rows(s).data_ptr() == s.data_ptr()
    t = torch.randn(4, 3, 8).transpose(0, 1)  # leading dims that do not collapse: one copy, same values
    assert torch.equal(as_rows(t), t.reshape(-1, 8))
    assert as_rows(torch.randn(8)).shape == (1, 8)
