"""What the final adapters answer: per cell and task, the test items scored correct and the most common gold answer
among them, and, where the evaluation recorded them (`row_answers`), the answer the adapter gave most often to the
task's items and how often it gave no answer. A task whose every correct item has one and the same answer is answered
by a constant: a policy that prints that answer to every question of the task scores exactly those items (and no
other).

Tasks and gold answers come from the evaluation's own record (`row_labels`, `row_gold`); for cells run before they were
recorded, the test split is rebuilt from the grid folder's `budget.json` (its benchmark, size and seed), so the per-item
scores line up with the items' gold answers, and what the adapter answered is inferred from which items scored.

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


def task_cell(scores: list[float], gold: list[str], given: list[str | None] | None, items: list[int]) -> str:
    """One task's cell: items right with the most common gold answer among them, and with `given` (the recorded
    answers) the most common answer given to the task's items and the items without an answer."""
    right = [gold[index] for index in items if scores[index] > 0.5]
    if right:
        answer, count = Counter(right).most_common(1)[0]
        constant = " **const**" if count / len(right) >= CONSTANT_SHARE and len(right) > 1 else ""
        text = f"{len(right)}: '{answer}' {count / len(right):.0%}{constant}"
    else:
        text = "0"
    if given is not None:
        answers = Counter(given[index] for index in items if given[index] is not None)
        unanswered = sum(given[index] is None for index in items)
        top = answers.most_common(1)
        gave = f"'{top[0][0]}' ×{top[0][1]}" if top else "none"
        text += f"; gave {gave}, {unanswered} without"
    return text


def answer_table(grid: Path) -> str:
    rows, task_names, gold_line = [], None, ""
    for path in sorted(grid.glob("*/*/seed*/result.json")):
        evaluations = json.loads(path.read_text(encoding="utf-8"))["evaluations"]
        for label, evaluation in sorted(evaluations.items(), key=lambda item: int(item[0])):
            if label != "-1" and label != max(evaluations, key=int):
                continue
            scores = evaluation.get("row_rewards")
            if scores is None:
                continue
            tasks, gold = gold_answers(grid, evaluation)
            if len(scores) != len(tasks):
                continue
            by_task = {task: [i for i, name in enumerate(tasks) if name == task] for task in sorted(set(tasks))}
            if task_names is None:
                task_names = list(by_task)
                gold_line = "; ".join(f"{task} {Counter(gold[i] for i in items).most_common(3)}"
                                      for task, items in by_task.items())  # fmt: skip
            given = evaluation.get("row_answers")
            cells = [task_cell(scores, gold, given, by_task.get(task, [])) for task in task_names]
            name = "/".join(path.parent.relative_to(grid).parts)
            rows.append(f"| {name}{' (base model)' if label == '-1' else ''} | " + " | ".join(cells) + " |")
    task_names = task_names or []
    lines = [
        f"# Answers scored correct, per cell and task ({grid})", "",
        "Regenerate: `python benchmarks/answers.py --grid " + str(grid) + "`. Per task: items right of the test split, "
        "and the most common gold answer among them with its share. **const** marks a task whose correct items all "
        "share one answer: the adapter scores exactly as a constant answer would. Where the evaluation recorded the "
        "answers given (`row_answers`): the answer given most often to the task's items, and the items given none.", "",
        "Gold answers of the test split, most common first: " + gold_line, "",
        "| cell | " + " | ".join(task_names) + " |",
        "|---|" + "---|" * len(task_names),
        *rows,
    ]
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
