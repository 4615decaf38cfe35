"""Search for the 2:4 expansion's group codes and constants (``kernels/sparse24.py``, ``GROUP_CODES``).

    python tools/sparse24_group_codes.py      # about two minutes on one CPU core

A group's code (3 bits, in a 4-bit slot) must become four table indices, one
per dense position j, as nibble j of ``FLIP ^ (code * MULTIPLIER & MASK)``:
the multiply lays one copy of the code under each nibble (copies that do not
overlap, so no carries), and each index bit is then 0, 1, a code bit or its
inverse.  Bit 2 of every index is set, so the table is bytes 4-7 of the lookup
PRMT: its immediate operand, with no register to hold it.  The first solution
found is printed in the module's terms.
"""

from __future__ import annotations

import itertools

COMBOS = [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]  # the dense positions (p0, p1) of v0, v1
SOURCE = [["v0" if j == p0 else "v1" if j == p1 else "zero" for j in range(4)] for p0, p1 in COMBOS]
BIT = [lambda b: 0, lambda b: 1, lambda b: b, lambda b: 1 - b]  # what an index bit is made of


def search():
    for shifts in itertools.product(range(-2, 2), repeat=4):  # copy j starts at bit 4j + shifts[j]
        starts = [4 * j + d for j, d in enumerate(shifts)]
        if starts[0] < 0 or any(starts[j] + 3 > starts[j + 1] for j in range(3)):
            continue

        def code_bit(code, pos):
            return next(((code >> (pos - s)) & 1 for s in starts if s <= pos < s + 3), 0)

        for codes in itertools.permutations(range(8), 6):
            options = []  # per position: (its two index bits' makers, the table entries it needs)
            for j in range(4):
                fits = []
                for makers in itertools.product(range(4), repeat=2):
                    table = {}
                    for code, source in zip(codes, SOURCE):
                        index = sum(BIT[f](code_bit(code, 4 * j + k)) << k for k, f in enumerate(makers))
                        if table.setdefault(index, source[j]) != source[j]:
                            break
                    else:
                        fits.append((makers, table))
                options.append(fits)
            for choice in itertools.product(*options):
                table: dict = {}
                if all(table.setdefault(i, s) == s for _, t in choice for i, s in t.items()):
                    return starts, codes, [makers for makers, _ in choice], table
    return None


def main():
    found = search()
    if found is None:
        print("no solution")
        return
    starts, codes, makers, table = found
    mask = flip = 0
    for j, pair in enumerate(makers):
        for k, f in enumerate(pair):
            mask |= (f >= 2) << (4 * j + k)
            flip |= (f in (1, 3)) << (4 * j + k)
        flip |= 1 << (4 * j + 2)  # index 4 + i
    print("GROUP_CODES =", dict(zip(COMBOS, codes)))
    print(f"MULTIPLIER, INDEX_MASK, INDEX_FLIP = {sum(1 << s for s in starts):#x}, {mask:#x}, {flip:#x}")
    print("SOURCES =", tuple(table.get(i, "zero") for i in range(4)))


if __name__ == "__main__":
    main()
