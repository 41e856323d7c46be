"""huge_pages: zero-filled and copied CPU tensors in one 2 MiB-aligned mapping advised for transparent huge pages."""

from __future__ import annotations

import pytest
import torch

from engine.model import huge_pages
from engine.model.huge_pages import HUGE_PAGE

needs_madvise = pytest.mark.skipif(not huge_pages.available(), reason="no mmap.madvise(MADV_HUGEPAGE) here")


def test_zeros_is_a_writable_zero_tensor() -> None:
    pool = huge_pages.zeros((3, 2, 5, 16, 2, 8), torch.bfloat16)
    assert pool.shape == (3, 2, 5, 16, 2, 8) and pool.dtype == torch.bfloat16 and pool.is_contiguous()
    assert torch.equal(pool, torch.zeros_like(pool))
    pool[2, 1, 4] = 1.5  # writable to its last element
    assert pool.float().sum() == 1.5 * 16 * 2 * 8


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@needs_madvise
def test_zeros_maps_every_page_before_returning() -> None:
    before = _rss_kib()
    pool = huge_pages.zeros((64 << 20,), torch.uint8)  # (a lazily mapped pool would add ~nothing to RSS here)
    assert _rss_kib() - before >= 60 << 10
    assert int(pool[::4096].sum()) == 0


@needs_madvise
def test_zeros_starts_on_a_huge_page_boundary() -> None:
    assert huge_pages.zeros((1000, 3), torch.float32).data_ptr() % HUGE_PAGE == 0


def test_copies_keep_values_dtypes_and_shapes_and_are_independent() -> None:
    a = torch.randn(7, 5)
    b = torch.arange(12, dtype=torch.int64).view(3, 4)
    c = torch.randn(9).to(torch.bfloat16)
    got = huge_pages.copies([a, b, c])
    for src, copy in zip([a, b, c], got, strict=True):
        assert copy.dtype == src.dtype and copy.shape == src.shape and copy.is_contiguous()
        assert torch.equal(copy, src)
    got[0][0, 0] = 123.0
    assert a[0, 0] != 123.0  # a copy, not a view of the source
    assert torch.equal(got[1], b) and torch.equal(got[2], c)  # neighbours untouched


def test_copies_of_a_strided_view_are_contiguous() -> None:
    src = torch.randn(6, 4).t()
    (copy,) = huge_pages.copies([src])
    assert copy.is_contiguous() and torch.equal(copy, src)


def test_a_tensor_listed_twice_is_copied_once() -> None:
    tied = torch.randn(4, 4)
    first, other, second = huge_pages.copies([tied, torch.ones(2), tied])
    assert first is second
    assert torch.equal(other, torch.ones(2))


@needs_madvise
def test_copies_share_one_mapping_from_a_huge_page_boundary() -> None:
    a, b = huge_pages.copies([torch.randn(10), torch.randn(3000)])
    assert a.data_ptr() % HUGE_PAGE == 0
    assert b.data_ptr() == a.data_ptr() + 4096  # (each copy on its own 4 KiB boundary)


@needs_madvise
def test_copies_refuse_a_non_cpu_tensor() -> None:
    with pytest.raises(ValueError, match="CPU"):
        huge_pages.copies([torch.ones(2), torch.ones(2, device="meta")])
