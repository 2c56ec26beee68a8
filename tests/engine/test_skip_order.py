"""skip_order.py: the marks of a non-finite check, per slot in the update's order, turned into
each slot's skip (its unit or an earlier one holds a mark), against a plain loop over every
way to split a few slots into units and every pattern of marks."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from trainstream.engine import skip_order


def _compositions(n: int):
    """Every list of unit sizes >= 1 that sums to n."""
    for cuts in itertools.product([False, True], repeat=n - 1):
        sizes, size = [], 1
        for cut in cuts:
            if cut:
                sizes.append(size)
                size = 1
            else:
                size += 1
        yield sizes + [size]


def _loop(sizes, marks) -> list[bool]:
    """What the host path skips, unit by unit in order: from the first unit holding a mark on."""
    out, skipping, i = [], False, 0
    for size in sizes:
        skipping = skipping or any(marks[i : i + size])
        out += [skipping] * size
        i += size
    return out


CASES = [
    (sizes, marks) for n in range(1, 7) for sizes in _compositions(n) for marks in itertools.product([0, 1], repeat=n)
]


def test_every_small_case_skips_what_the_loop_skips():
    for sizes, marks in CASES:
        n = len(marks)
        ends = skip_order.unit_ends(sizes)
        # The launches take the slots in another order than the update's: any permutation.
        order = list(range(n))
        random.Random(n * 1000 + sum(marks)).shuffle(order)
        for launch_order in (list(range(n)), order):
            found = torch.tensor(marks, dtype=torch.int32)
            index = torch.tensor([ends[i] for i in launch_order], dtype=torch.int64)
            got = skip_order.skipped(found, index)
            assert got.dtype == torch.int32 and got.shape == (n,)
            expected = _loop(sizes, marks)
            assert [bool(v) for v in got.tolist()] == [expected[i] for i in launch_order], (sizes, marks, launch_order)


def test_the_first_slot_found_in_the_update_order():
    for marks in sorted({marks for _, marks in CASES}):
        n = len(marks)
        expected = next((i for i, m in enumerate(marks) if m), None)
        assert skip_order.first_found(list(marks)) == expected
        # Marks laid out in another order (one group per gradient dtype): mark j is slot order[j]'s.
        order = list(reversed(range(n)))
        assert skip_order.first_found([marks[i] for i in order], order) == expected


def test_unit_ends():
    assert skip_order.unit_ends([2, 1, 3]) == [1, 1, 2, 5, 5, 5]
    assert skip_order.unit_ends([]) == []
    with pytest.raises(ValueError, match=r"^unit_ends: every unit has at least one slot"):
        skip_order.unit_ends([2, 0])
