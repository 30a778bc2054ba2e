"""`arith`: arithmetic word problems made from a seed, in GSM8K's flat layout (`data.task=arith`).

Job: `arith_rows(n, seed)` gives `n` distinct one-step problems (addition of numbers up to 20,
subtraction of numbers up to 30, multiplication of numbers from 2 to 10) in varied wording, each row
`{"question": ..., "answer": "... <<a+b=c>>c\\n#### c"}` like GSM8K's, so its reward is GSM8K's strict
exact-match on `#### N` (`agents.rewards.gsm8k`) and its prompt goes through the model's chat template.
No two rows share the operation and both numbers, so a held-out row's problem is never trained on in
other words. Made for a small pretrained instruct model to climb (SmolLM2-135M-Instruct answers about
an eighth of them untrained: `configs/smollm2_arith.yaml`, docs/benchmarks.md `learn`).
"""

from __future__ import annotations

import random

ADD_MAX, SUB_MAX, MUL_MAX = 20, 30, 10
"""Numbers: a + b with a, b <= 20; a - b with b < a <= 30; a * b with a, b in [2, 10] (895 problems)."""
NAMES = ("Ana", "Ben", "Chen", "Dina", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi", "Lena", "Mia", "Noah")
ITEMS = ("apples", "marbles", "books", "stickers", "pencils", "coins", "cookies", "stamps", "shells", "cards")

ADD = (
    "{n} has {a} {i}. {m} gives {n} {b} more {i}. How many {i} does {n} have now?",
    "A shop sold {a} {i} in the morning and {b} {i} in the afternoon. How many {i} did it sell in all?",
    "{n} collected {a} {i} on Monday and {b} {i} on Tuesday. How many {i} did {n} collect in total?",
    "There are {a} {i} in one box and {b} {i} in another box. How many {i} are there altogether?",
)
SUB = (
    "{n} had {a} {i} and gave {b} of them to {m}. How many {i} does {n} have left?",
    "There were {a} {i} on a shelf. {n} took {b} of them. How many {i} are still on the shelf?",
    "{n} needs {a} {i} and already has {b}. How many more {i} does {n} need?",
    "A jar held {a} {i}. After {b} {i} were used, how many {i} were left in the jar?",
)
MUL = (
    "{n} buys {a} bags with {b} {i} in each bag. How many {i} does {n} buy?",
    "A classroom has {a} rows with {b} {i} on each row. How many {i} are there?",
    "{n} gets {b} {i} every day for {a} days. How many {i} does {n} get in total?",
    "There are {a} boxes and each box holds {b} {i}. How many {i} are there in all the boxes?",
)


def _problems() -> list[tuple[str, int, int]]:
    out = [("+", a, b) for a in range(ADD_MAX + 1) for b in range(1, ADD_MAX + 1) if a > 1]
    out += [("-", a, b) for a in range(3, SUB_MAX + 1) for b in range(1, a)]
    out += [("*", a, b) for a in range(2, MUL_MAX + 1) for b in range(2, MUL_MAX + 1)]
    return out


def arith_rows(n: int | None, seed: int) -> list[dict[str, str]]:
    """`n` distinct problems (None or more than there are: every one) in a seeded order, a third of each
    operation when there are enough; wording, names and items drawn from the same seed."""
    rng = random.Random(seed)
    n = len(_problems()) if n is None else n
    by_op: dict[str, list[tuple[str, int, int]]] = {"+": [], "-": [], "*": []}
    for p in _problems():
        by_op[p[0]].append(p)
    for ps in by_op.values():
        rng.shuffle(ps)
    picked: list[tuple[str, int, int]] = []
    while len(picked) < n and any(by_op.values()):  # round robin: the operations stay balanced
        for ps in by_op.values():
            if ps and len(picked) < n:
                picked.append(ps.pop())
    rng.shuffle(picked)
    return [_row(op, a, b, rng) for op, a, b in picked]


def _row(op: str, a: int, b: int, rng: random.Random) -> dict[str, str]:
    n, m = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    template = rng.choice({"+": ADD, "-": SUB, "*": MUL}[op])
    c = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"question": template.format(n=n, m=m, a=a, b=b, i=item), "answer": f"{a} {op} {b} = <<{a}{op}{b}={c}>>{c}\n#### {c}"}
