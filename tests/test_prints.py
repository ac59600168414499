"""Fingerprints: a change in a row always shows, the same bits always give the same
fingerprint, whatever the blocks."""

from __future__ import annotations

import pytest
import torch

from divtrace.measure import prints as prints_module
from divtrace.measure.prints import Fingerprints


def prints(rows: torch.Tensor, width: int = 1 << 18) -> torch.Tensor:
    return Fingerprints().of(rows, width)


def test_the_same_whatever_the_width_of_the_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = torch.randn(3, 5, 70_001)  # over five periods of the weights, and a tail
    whole = prints(rows).tolist()  # on the CPU one product with the held weights
    periods = torch.randn(2, 4 << 15)  # two periods a row exactly: one contiguous block
    whole_periods = prints(periods).tolist()
    monkeypatch.setattr(prints_module, "_LONG_ROWS", 1000)  # in steps, as longer rows
    for width in (1, 1 << 16, 1 << 19, 1 << 24):
        assert prints(rows, width).tolist() == whole
        assert prints(periods, width).tolist() == whole_periods
    alone = prints(rows[1:2])  # a row's fingerprint does not depend on the other rows
    assert alone.item() == prints(rows)[1].item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16,
                                   torch.bfloat16, torch.float8_e4m3fn, torch.int64,
                                   torch.int8, torch.bool, torch.complex64])
def test_one_changed_element_anywhere_always_shows(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(2, 140_000, generator=generator) * 4
    rows = base.to(dtype)
    before = prints(rows)
    for at in torch.randint(0, base.shape[1], (40,), generator=generator).tolist():
        changed = rows.clone()
        if dtype == torch.bool:
            changed[1, at] = not bool(changed[1, at])
        elif dtype.is_floating_point or dtype.is_complex:
            changed[1, at] = (base[1, at] * 1.5 + 1).to(dtype)
        else:
            changed[1, at] += 1
        after = prints(changed)
        assert after[0] == before[0]
        assert after[1] != before[1], (dtype, at)


def test_changes_that_sum_to_nothing_still_show() -> None:
    rows = torch.randn(1, 300_000, dtype=torch.float64)
    bits = rows.view(torch.int64)
    before = prints(rows)
    for at in (0, 65_535, 65_536, 200_001):
        smooth = bits.clone()  # +d, -2d, +d: a second difference, zero for linear weights
        smooth[0, at:at + 3] += torch.tensor([1, -2, 1])
        assert prints(smooth.view(torch.float64)) != before
    swapped = rows.clone()  # the same values in other places
    swapped[0, [10, 70_000]] = swapped[0, [70_000, 10]]
    assert prints(swapped) != before
    shifted = rows.roll(1, 1)
    assert prints(shifted) != before


def test_rows_of_any_length_in_bytes() -> None:
    odd = torch.randn(3, 7)  # 28 bytes a row: the words end in zero bytes
    changed = odd.clone()
    changed[2, 6] += 1
    assert (prints(odd) != prints(changed)).tolist() == [False, False, True]
    assert torch.equal(prints(odd[1:2]), prints(odd)[1:2])


def test_empty_rows_and_no_rows() -> None:
    assert prints(torch.zeros(2, 0)).tolist() == [0, 0]
    assert prints(torch.zeros(0, 5)).shape == (0,)


def test_rows_that_do_not_start_on_a_word() -> None:
    base = torch.randn(4, 9)
    inner = base[1:, 1:]  # starts 40 bytes in, rows of 32 bytes 36 apart
    assert torch.equal(prints(inner), prints(inner.clone()))


def _blocks(device: str) -> list[torch.Tensor]:
    """Blocks of many lengths and dtypes: short, empty, beyond a period of the weights,
    rows that do not start on a word, rows of several samples, rows not side by side."""
    generator = torch.Generator().manual_seed(1)
    made = [torch.randn(1, n, generator=generator) for n in (3, 17, 1, 0, 40_000, 65_541)]
    made += [torch.randn(3, 7, generator=generator).to(torch.bfloat16),
             torch.randn(2, 5, generator=generator).double(),
             torch.randn(1, 70_001, generator=generator)[:, 1:], torch.randn(2, 0),
             torch.randint(0, 9, (2, 11), generator=generator)]
    made.append(torch.randn(4, 6, generator=generator).t())  # rows not side by side
    return [b.to(device) for b in made]


_MASK = (1 << 64) - 1


def _shifted(x: int, by: int) -> int:
    """``x >> by`` of a 64-bit word read as signed, as torch shifts an int64."""
    signed = x - (1 << 64) if x >> 63 else x
    return (signed >> by) & _MASK


def _mixed(i: int) -> int:
    """splitmix64's mixing of ``i``, made odd, in plain integers modulo 2**64."""
    x = (i * 0x9E3779B97F4A7C15 + 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ _shifted(x, 30)) * 0x94D049BB133111EB) & _MASK
    x = ((x ^ _shifted(x, 27)) * 0xBF58476D1CE4E5B9) & _MASK
    return (x ^ _shifted(x, 31)) | 1


def _by_hand(row: torch.Tensor) -> int:
    """The module docstring's fingerprint of one row, from its bytes alone: word ``j``
    times the weight of its position (``j`` mod 2**15 mixed, times its repetition's odd
    number), summed modulo 2**64."""
    data = row.contiguous().view(torch.uint8).numpy().tobytes()
    data += bytes(-len(data) % 8)  # zero bytes up to a whole word
    period = 1 << 15
    weights = [_mixed(j) for j in range(min(period, len(data) // 8))]
    total = 0
    for j in range(len(data) // 8):
        word = int.from_bytes(data[8 * j:8 * j + 8], "little")
        total += word * weights[j % period] * _mixed(j // period + (1 << 40))
    return total & _MASK


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fingerprints_are_the_sums_worked_out_by_hand(device: str) -> None:
    generator = torch.Generator().manual_seed(3)
    blocks = [torch.randn(2, 70_001, generator=generator),  # two periods and a tail
              torch.randn(3, 7, generator=generator).double(),
              torch.randint(-9, 9, (2, 13), generator=generator).to(torch.int8)]
    expected = [_by_hand(row) for b in blocks for row in b]
    printer = Fingerprints()
    for long_rows in (1 << 22, 1000):  # one product; and as longer rows, in steps
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(prints_module, "_LONG_ROWS", long_rows)
            for width in (1, 1 << 18):  # a block per period of the weights, one block
                found = torch.cat([printer.of(b.to(device), width) for b in blocks])
                assert [v & _MASK for v in found.tolist()] == expected
    together = printer.of_many([b.to(device) for b in blocks])
    assert [v & _MASK for v in together.tolist()] == expected


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_many_blocks_at_once_give_each_blocks_own_fingerprints(device: str) -> None:
    blocks = _blocks(device)
    printer = Fingerprints()
    alone = torch.cat([printer.of(b) for b in blocks])
    together = printer.of_many(blocks)
    assert together.device.type == device
    assert torch.equal(together.cpu(), alone.cpu())
    assert torch.equal(printer.of_many(blocks[:1]).cpu(), printer.of(blocks[0]).cpu())
    assert torch.equal(printer.of_many([torch.zeros(3, 0, device=device)]).cpu(),
                       torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("budget", [1, 1 << 30])  # a flush at every site, or one at the end
def test_a_pass_s_sites_fingerprinted_together_give_each_its_own(device: str,
                                                                  budget: int) -> None:
    from divtrace.measure.printbatch import PrintBatch

    generator = torch.Generator().manual_seed(1)
    sites = [[torch.randn(2, 7, generator=generator)],  # short: copied, then together
             [torch.randn(2, 40_000, generator=generator)],  # long: at once on the CPU
             [torch.randn(1, 33, generator=generator), torch.randn(1, 33, generator=generator)],
             [torch.randn(3, 7, generator=generator).double()]]
    sites = [[b.to(device) for b in blocks] for blocks in sites]
    printer, seen = Fingerprints(), {}

    def done(found: torch.Tensor, spans: list[tuple[object, int, int]]) -> None:
        for tag, start, stop in spans:
            seen[tag] = found[start:stop].clone()

    batch = PrintBatch(printer, budget, done)
    for tag, blocks in enumerate(sites):
        batch.add(blocks, tag, copies=tag == 3)
    for blocks in sites:
        blocks[0].zero_()  # a later in-place op: the fingerprints are of the rows as given
    batch.flush()
    generator = torch.Generator().manual_seed(1)
    again = [[torch.randn(2, 7, generator=generator)],
             [torch.randn(2, 40_000, generator=generator)],
             [torch.randn(1, 33, generator=generator), torch.randn(1, 33, generator=generator)]]
    for tag, blocks in enumerate(again):
        expected = torch.cat([printer.of(b) for b in blocks])
        assert torch.equal(seen[tag].cpu(), expected), tag
    # site 3 gave copies of its own: nothing copied again, so the write shows unless the
    # budget flushed it at once
    third = torch.randn(3, 7, generator=generator).double() if budget == 1 else torch.zeros(
        3, 7, dtype=torch.float64)
    assert torch.equal(seen[3].cpu(), printer.of(third))


def test_a_site_that_hands_on_its_rows_takes_the_earlier_site_s_fingerprints() -> None:
    from divtrace.align.sites import Site
    from divtrace.align.status import Status
    from divtrace.measure.measured import Measured
    from divtrace.measure.printbatch import SitePrints

    rows = torch.randn(2, 9)
    first, second = (Measured(Site(name, name, "Linear", 0, "", True), Status.OK, (2, 9),
                              torch.float32)
                     for name in ("a", "b"))
    prints = SitePrints(Fingerprints(), 1 << 30)
    prints.add(first, None, None, lambda: [rows])
    prints.add(second, None, first, lambda: pytest.fail("the rows were read again"))
    assert first.prints is None  # not before the flush
    assert second.prints is None
    prints.flush()
    assert first.prints is not None
    assert second.prints is not None
    assert torch.equal(first.prints, Fingerprints().of(rows))
    assert torch.equal(second.prints, first.prints)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_sites_on_two_devices_are_fingerprinted_device_by_device() -> None:
    from divtrace.measure.printbatch import PrintBatch

    rows = [torch.randn(2, 9, device=f"cuda:{i % 2}") for i in range(4)]
    printer, seen = Fingerprints(), {}

    def done(found: torch.Tensor, spans: list[tuple[object, int, int]]) -> None:
        for tag, start, stop in spans:
            seen[tag] = found[start:stop]

    batch = PrintBatch(printer, 1 << 30, done)
    for tag, block in enumerate(rows):
        batch.add([block], tag)
    batch.flush()
    for tag, block in enumerate(rows):
        assert seen[tag].device == block.device
        assert torch.equal(seen[tag].cpu(), printer.of(block.cpu()))
