"""An offline task with checkable answers for RL: arithmetic word problems generated from templates.

Each problem is ``{"prompt": "...", "answer": 12, "completion": "The answer is 12."}``. The reward
:func:`exact_match` is 1 when the last integer in a response equals the answer, else 0 (a verifiable reward, as
for GRPO on math). The same problems give SFT records (to teach the answer format), preference pairs (correct
vs wrong answer, for ``z2all reward`` / ``z2all dpo``) and RL prompts::

    python -m zero2all.train.rl_tasks --out runs/arith --train 5000 --valid 200
    # -> sft.jsonl, pairs.jsonl, prompts.jsonl, prompts_valid.jsonl
    z2all rl --algo grpo --init runs/arith-sft/final --data runs/arith/prompts.jsonl \\
        --valid runs/arith/prompts_valid.jsonl --reward-fn zero2all.train.rl_tasks:exact_match
"""

from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

# (template, operation); {a} and {b} are the operands, the answer is op(a, b)
TEMPLATES = (
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have?", "+"),
    ("There are {a} birds on a tree and {b} more land. How many birds are there?", "+"),
    ("{name} had {a} coins and spent {b}. How many coins are left?", "-"),
    ("A shelf holds {a} books. {b} are taken away. How many books remain?", "-"),
    ("There are {a} boxes with {b} pens each. How many pens are there?", "*"),
    ("{name} reads {b} pages a day for {a} days. How many pages is that?", "*"),
)
NAMES = ("Ann", "Bob", "Eva", "Tom", "Mia", "Sam")
_INT = re.compile(r"-?\d+")


def answer_text(answer: int) -> str:
    return f"The answer is {answer}."


def make_problem(rng: random.Random, max_value: int = 9, ops: str = "+-*") -> dict:
    """One problem; operands in [1, max_value] (for '-' the larger comes first, so answers are >= 0)."""
    while True:
        template, op = TEMPLATES[rng.randrange(len(TEMPLATES))]
        if op in ops:
            break
    a, b = rng.randint(1, max_value), rng.randint(1, max_value)
    if op == "-" and b > a:
        a, b = b, a
    answer = a + b if op == "+" else a - b if op == "-" else a * b
    prompt = template.format(name=rng.choice(NAMES), a=a, b=b)
    return {"prompt": prompt, "answer": answer, "completion": answer_text(answer)}


def make_problems(n: int, seed: int = 0, max_value: int = 9, ops: str = "+-*") -> list[dict]:
    rng = random.Random(seed)
    return [make_problem(rng, max_value, ops) for _ in range(n)]


def final_number(text: str) -> int | None:
    """The last integer in ``text`` (None if there is none)."""
    found = _INT.findall(text)
    return int(found[-1]) if found else None


def exact_match(completion: str, record: dict) -> float:
    """1.0 when the response's last integer equals ``record["answer"]``, else 0.0."""
    return 1.0 if final_number(completion) == int(record["answer"]) else 0.0


def sft_records(problems: list[dict]) -> list[dict]:
    return [{"instruction": p["prompt"], "output": p["completion"]} for p in problems]


def preference_pairs(problems: list[dict], seed: int = 0) -> list[dict]:
    """The correct answer preferred to a wrong one (off by a random non-zero amount)."""
    rng = random.Random(seed)
    out = []
    for p in problems:
        wrong = p["answer"] + rng.choice([-3, -2, -1, 1, 2, 3])
        wrong = wrong if wrong >= 0 else p["answer"] + 1
        out.append({"prompt": p["prompt"], "chosen": p["completion"], "rejected": answer_text(wrong)})
    return out


def write_task(out: str | Path, n_train: int, n_valid: int, seed: int = 0, max_value: int = 9) -> Path:
    """sft.jsonl, pairs.jsonl, prompts.jsonl (train) and prompts_valid.jsonl (held out) under ``out``."""
    from zero2all.fileio import atomic_write

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    train = make_problems(n_train, seed, max_value)
    valid = make_problems(n_valid, seed + 1, max_value)
    files = {"sft.jsonl": sft_records(train), "pairs.jsonl": preference_pairs(train, seed),
             "prompts.jsonl": train, "prompts_valid.jsonl": valid}
    for name, rows in files.items():
        with atomic_write(out / name, "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description="write the arithmetic word-problem task files")
    p.add_argument("--out", required=True)
    p.add_argument("--train", type=int, default=5000)
    p.add_argument("--valid", type=int, default=200)
    p.add_argument("--max-value", type=int, default=9)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(f"wrote {write_task(a.out, a.train, a.valid, a.seed, a.max_value)}")


if __name__ == "__main__":
    main()
