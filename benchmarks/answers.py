"""What the final adapters answer right: per cell and task, the test items scored correct and the most common gold
answer among them. A task whose every correct item has one and the same answer is answered by a constant: a policy
that prints that answer to every question of the task scores exactly those items (and no other).

The test split is rebuilt from the grid folder's `budget.json` (the benchmark's size and seed), so the per-item scores
a cell's result.json holds line up with the items' gold answers; nothing is generated.

    python benchmarks/answers.py [--grid benchmarks/results/grid] [--output benchmarks/results/grid/answers.md]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from harness.cells import gold_answers

CONSTANT_SHARE = 1.0  # every correct item has the one answer


def answer_table(grid: Path) -> str:
    tasks, answers = gold_answers(grid)
    by_task = {task: [i for i, name in enumerate(tasks) if name == task] for task in sorted(set(tasks))}
    lines = [
        f"# Answers scored correct, per cell and task ({grid})", "",
        "Regenerate: `python benchmarks/answers.py --grid " + str(grid) + "`. Per task: items right of the test split, "
        "and the most common gold answer among them with its share. **const** marks a task whose correct items all "
        "share one answer: the adapter scores exactly as a constant answer would.", "",
        "Gold answers of the test split, most common first: "
        + "; ".join(f"{task} {Counter(answers[i] for i in items).most_common(3)}" for task, items in by_task.items()),
        "",
        "| cell | " + " | ".join(by_task) + " |",
        "|---|" + "---|" * len(by_task),
    ]
    for path in sorted(grid.glob("*/*/seed*/result.json")):
        evaluations = json.loads(path.read_text(encoding="utf-8"))["evaluations"]
        rows = []
        for label, evaluation in sorted(evaluations.items(), key=lambda item: int(item[0])):
            if label != "-1" and label != max(evaluations, key=int):
                continue
            scores = evaluation.get("row_rewards")
            if scores is None or len(scores) != len(tasks):
                continue
            cells = []
            for items in by_task.values():
                right = [answers[i] for i in items if scores[i] > 0.5]
                if not right:
                    cells.append("0")
                    continue
                answer, count = Counter(right).most_common(1)[0]
                share = count / len(right)
                constant = " **const**" if share >= CONSTANT_SHARE and len(right) > 1 else ""
                cells.append(f"{len(right)}: '{answer}' {share:.0%}{constant}")
            name = "/".join(path.parent.relative_to(grid).parts)
            rows.append(f"| {name}{' (base model)' if label == '-1' else ''} | " + " | ".join(cells) + " |")
        lines += rows
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--grid", default="benchmarks/results/grid", help="A grid folder with its budget.json.")
    parser.add_argument("--output", default=None, help="Where to write the table (default: answers.md in the grid).")
    args = parser.parse_args(argv)
    grid = Path(args.grid)
    text = answer_table(grid)
    Path(args.output or grid / "answers.md").write_text(text, encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
