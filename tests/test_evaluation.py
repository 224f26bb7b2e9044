import json

import pytest
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_federated.core.evaluation import (
    COMPLETION_CHARACTERS,
    COMPLETIONS_FILE,
    evaluate_accuracy,
    format_accuracy_table,
    write_completions,
)
from trl_federated.scoring.rewards import extract_answer

LABELS = ["hard", "simple", "medium", "simple", "other", "medium", "simple"]


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_model_dir):
    """The tiny model with its matrices redrawn at unit scale.

    At its initial scale its greedy output is the same token for every prompt, which would make a comparison
    of batched and unbatched generation vacuous.
    """
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 1.0)
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def eval_dataset():
    # Prompts of different lengths, so that batches really are padded.
    prompts = [[{"role": "user", "content": "What is 1 + " + "1 + " * index + "1?"}] for index in range(len(LABELS))]
    answers = [str(index + 2) for index in range(len(LABELS))]
    return Dataset.from_dict({"prompt": prompts, "answer": answers, "difficulty": LABELS})


def recording_reward():
    """A reward that varies on random text (the parity of its code points) and remembers what it scored."""
    seen = []

    def reward(completions, answer, **kwargs):
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        seen.extend(texts)
        return [float(sum(map(ord, text)) % 2) for text in texts]

    reward.completions = seen
    return reward


def test_every_answer_on_record(model_and_tokenizer, eval_dataset):
    """Each row's label, gold answer and parsed answer are recorded in the dataset's order, the parsed answer being
    what the reward reads from that row's completion; with `keep_completions`, the completions themselves."""
    model, tokenizer = model_and_tokenizer
    tagged = eval_dataset.map(lambda row, index: {"category": f"task{index % 2}"}, with_indices=True)
    completions_seen = recording_reward()
    results = evaluate_accuracy(model, tokenizer, tagged, batch_size=3, max_new_tokens=6, keep_completions=True,
                                reward_funcs=completions_seen)  # fmt: skip
    assert results["row_labels"] == tagged["category"]  # the task column wins over the label column
    assert results["row_gold"] == tagged["answer"]
    assert sorted(results["completions"]) == sorted(completions_seen.completions)
    assert results["row_answers"] == [extract_answer(text) for text in results["completions"]]
    def length_reward(completions, **kwargs):
        return [float(len(completion[0]["content"]) % 2) for completion in completions]

    without_tasks = evaluate_accuracy(model, tokenizer, eval_dataset.remove_columns("answer"), batch_size=3,
                                      max_new_tokens=6, reward_funcs=length_reward)  # fmt: skip
    assert without_tasks["row_labels"] == eval_dataset["difficulty"] and without_tasks["row_gold"] is None
    assert "completions" not in without_tasks


def test_completions_file_holds_the_latest_evaluation(tmp_path):
    results = {"row_labels": ["gcd", "products"], "row_gold": ["4", "12"], "row_answers": ["4", None],
               "row_rewards": [1.0, 0.0], "completions": ["gcd(8, 4) = 4. <answer>4</answer>", "x" * 1000]}
    path = tmp_path / COMPLETIONS_FILE
    write_completions(path, 0, {**results, "row_labels": None})
    write_completions(path, 3, results)
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert [line["round"] for line in lines] == [3, 3]
    assert lines[0] == {"round": 3, "item": 0, "task": "gcd", "gold": "4", "answer": "4", "reward": 1.0,
                        "completion": "gcd(8, 4) = 4. <answer>4</answer>"}  # fmt: skip
    assert lines[1]["answer"] is None and lines[1]["completion"] == "x" * COMPLETION_CHARACTERS


def test_result_keys_and_counts(model_and_tokenizer, eval_dataset):
    model, tokenizer = model_and_tokenizer
    results = evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=3, max_new_tokens=6)
    assert list(results) == [
        "accuracy", "count", "rewards", "row_rewards", "row_labels", "row_gold", "row_answers", "seconds"
    ] and results["seconds"] > 0  # fmt: skip
    assert results["row_rewards"] == [0.0] * len(eval_dataset)
    assert results["rewards"] == {"answer_accuracy_reward": 0.0}
    assert list(results["accuracy"]) == ["simple", "medium", "hard", "other", "Total"]
    assert results["count"] == {"simple": 3, "medium": 2, "hard": 1, "other": 1, "Total": 7}
    assert sum(count for label, count in results["count"].items() if label != "Total") == results["count"]["Total"]
    assert all(0.0 <= value <= 1.0 for value in results["accuracy"].values())
    assert results["accuracy"]["Total"] == 0.0  # a random model never writes a correct tagged answer


def test_batching_does_not_change_greedy_results(model_and_tokenizer, eval_dataset):
    model, tokenizer = model_and_tokenizer
    one_by_one, batched = recording_reward(), recording_reward()
    single = evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=1, max_new_tokens=8, reward_funcs=one_by_one)
    together = evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=4, max_new_tokens=8, reward_funcs=batched)
    assert len(set(one_by_one.completions)) == len(eval_dataset)  # one distinct completion per prompt
    assert batched.completions == one_by_one.completions
    assert (together["accuracy"], together["count"]) == (single["accuracy"], single["count"])
    assert 0.0 < single["accuracy"]["Total"] < 1.0  # the recording reward really varies


def test_batches_group_prompts_of_similar_length(model_and_tokenizer, eval_dataset):
    """Longest prompts first, and every row's reward lands on its own row whatever the batch it ran in."""
    model, tokenizer = model_and_tokenizer
    batched = recording_reward()
    evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=3, max_new_tokens=8, reward_funcs=batched)
    per_row = [
        evaluate_accuracy(model, tokenizer, eval_dataset.select([i]), max_new_tokens=8, reward_funcs=recording_reward())
        for i in range(len(eval_dataset))
    ]
    rows_longest_first = sorted(range(len(eval_dataset)), key=lambda i: -len(eval_dataset[i]["prompt"][0]["content"]))
    single = recording_reward()
    for i in rows_longest_first:
        evaluate_accuracy(model, tokenizer, eval_dataset.select([i]), max_new_tokens=8, reward_funcs=single)
    assert batched.completions == single.completions
    # the label table is the mean of each row's own reward
    results = evaluate_accuracy(
        model, tokenizer, eval_dataset, batch_size=3, max_new_tokens=8, reward_funcs=recording_reward()
    )
    simple = [per_row[i]["accuracy"]["Total"] for i, label in enumerate(LABELS) if label == "simple"]
    assert results["accuracy"]["simple"] == pytest.approx(sum(simple) / len(simple))
    # each row's own reward, in the dataset's order (not the batches'), as evaluating that row alone gives it
    assert results["row_rewards"] == [result["accuracy"]["Total"] for result in per_row]
    assert 0 < sum(results["row_rewards"]) < len(eval_dataset)  # rows differ, so a shuffled order would show


def test_generation_stops_at_the_stop_string(model_and_tokenizer, eval_dataset):
    """A completion ends with the token that completes the first stop string; before it, it is the full greedy
    completion."""
    model, tokenizer = model_and_tokenizer
    full, stopped = recording_reward(), recording_reward()
    evaluate_accuracy(model, tokenizer, eval_dataset, max_new_tokens=24, reward_funcs=full, stop_strings=())
    # a two-character string that some, not all, completions contain after their start
    candidates = {text[i : i + 2] for text in full.completions for i in range(2, len(text) - 2)}
    stop = next(c for c in sorted(candidates) if c.strip() == c and 0 < sum(c in t[2:] for t in full.completions) < 7)
    evaluate_accuracy(model, tokenizer, eval_dataset, max_new_tokens=24, reward_funcs=stopped, stop_strings=(stop,))
    assert any(len(short) < len(long) for short, long in zip(stopped.completions, full.completions))
    for short, long in zip(stopped.completions, full.completions):
        assert long.startswith(short)
        if stop in long:
            assert stop in short and len(short) - (short.index(stop) + len(stop)) < 16  # within the last token
        else:
            assert short == long


def test_model_and_tokenizer_state_is_restored(model_and_tokenizer, eval_dataset):
    model, tokenizer = model_and_tokenizer
    model.train()
    tokenizer.padding_side = "right"
    evaluate_accuracy(model, tokenizer, eval_dataset.select(range(2)), max_new_tokens=2)
    assert model.training and tokenizer.padding_side == "right"
    model.eval()
    evaluate_accuracy(model, tokenizer, eval_dataset.select(range(2)), max_new_tokens=2)
    assert not model.training


def test_peft_model(tiny_model_dir, eval_dataset):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    results = evaluate_accuracy(model, tokenizer, eval_dataset, label_column="answer", batch_size=4, max_new_tokens=4)
    assert results["count"]["Total"] == len(eval_dataset)


def test_plain_text_prompts(model_and_tokenizer):
    model, tokenizer = model_and_tokenizer
    dataset = Dataset.from_dict({"prompt": ["1 + 1 =", "2 + 2 ="], "answer": ["2", "4"], "difficulty": ["simple"] * 2})
    reward = recording_reward()
    results = evaluate_accuracy(model, tokenizer, dataset, max_new_tokens=3, reward_funcs=reward)
    assert results["count"] == {"simple": 2, "Total": 2} and len(reward.completions) == 2


def test_a_missing_prompt_column_is_named(model_and_tokenizer, eval_dataset):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="'prompt'"):
        evaluate_accuracy(model, tokenizer, eval_dataset.rename_column("prompt", "messages"))


def test_per_label_accuracy_only_with_the_label_column(model_and_tokenizer, eval_dataset):
    model, tokenizer = model_and_tokenizer
    results = evaluate_accuracy(model, tokenizer, eval_dataset, label_column="category", max_new_tokens=2)
    assert list(results["accuracy"]) == ["Total"] and results["count"] == {"Total": len(eval_dataset)}


def test_trl_style_dataset_with_several_weighted_reward_functions(model_and_tokenizer):
    """TRL's layout: `prompt` and `solution`, no label. Every non-prompt column reaches the reward functions; a
    row's reward is their weighted sum, and each function's mean skips the rows it returned None for."""
    model, tokenizer = model_and_tokenizer
    dataset = Dataset.from_dict({"prompt": ["1 + 1 =", "2 + 2 =", "3 + 3 ="], "solution": ["2", "4", "6"]})

    def solution_reward(completions, solution, **kwargs):
        return [float(gold) for gold in solution]

    def sometimes_reward(completions, solution, **kwargs):
        return [None if gold == "2" else 1.0 for gold in solution]

    results = evaluate_accuracy(
        model, tokenizer, dataset, max_new_tokens=2, reward_funcs=[solution_reward, sometimes_reward],
        reward_weights=[0.5, 2.0],
    )
    assert results["accuracy"] == {"Total": pytest.approx((0.5 * 2 + 0.5 * 4 + 2 + 0.5 * 6 + 2) / 3)}
    assert results["rewards"] == {"solution_reward": pytest.approx(4.0), "sometimes_reward": 1.0}


def test_reward_models_are_refused(model_and_tokenizer, eval_dataset):
    model, tokenizer = model_and_tokenizer
    with pytest.raises(ValueError, match="eval_reward_funcs"):
        evaluate_accuracy(model, tokenizer, eval_dataset, reward_funcs=["some/reward-model"])


def test_accuracy_table():
    results = {
        "Before training": {"accuracy": {"hard": 0.0, "simple": 0.5, "medium": 0.25, "Total": 0.25}, "count": {}},
        "Round 3": {"accuracy": {"simple": 0.875, "medium": 1 / 3, "hard": 0.125, "Total": 0.4444}},
    }
    assert format_accuracy_table(results).splitlines() == [
        "| | simple | medium | hard | Total |",
        "|---|---:|---:|---:|---:|",
        "| Before training | 50.00 | 25.00 | 0.00 | 25.00 |",
        "| Round 3 | 87.50 | 33.33 | 12.50 | 44.44 |",
    ]


def test_accuracy_table_with_chosen_labels_and_missing_values():
    results = {"A": {"chain_sum": 0.5, "gcd": 0.1, "Total": 0.3}, "B": {"chain_sum": 1.0, "Total": 1.0}}
    table = format_accuracy_table(results, labels=["gcd", "chain_sum"]).splitlines()
    assert table[0] == "| | gcd | chain_sum | Total |"
    assert table[2:] == ["| A | 10.00 | 50.00 | 30.00 |", "| B | - | 100.00 | 100.00 |"]


def test_accuracy_table_orders_geoqa_primitives_as_the_paper():
    results = {"Round 1": {"polygons": 0.5, "circles": 0.25, "lines": 0.75, "points": 1.0, "other": 0.0, "Total": 0.5}}
    assert format_accuracy_table(results).splitlines()[0] == "| | points | lines | circles | polygons | other | Total |"


@pytest.mark.parametrize(
    "use_cpu", [True, pytest.param(False, marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]
)
def test_the_evaluation_before_training_runs_in_the_training_precision_and_device(
    tiny_model, tiny_tokenizer, fast_args, eval_dataset, use_cpu
):
    """With `bf16`, `Trainer` runs the forward passes under accelerate's bf16 autocast, on CPU as on GPU: the round −1
    evaluation does too, on the device accelerate gives the process, and the weights stay float32."""
    from conftest import length_reward
    from trl_federated import FederatedRunner

    args = fast_args(bf16=True, use_cpu=use_cpu, max_completion_length=4)
    clients = [Dataset.from_dict({"prompt": ["a b c"] * 4})] * 2
    runner = FederatedRunner(
        tiny_model, length_reward, args, clients, processing_class=tiny_tokenizer, eval_dataset=eval_dataset
    )
    activations = set()

    def record(module, inputs, output):
        activations.add((output.dtype, output.device))

    hooks = [
        module.register_forward_hook(record)
        for module in runner.model.modules()
        if isinstance(module, torch.nn.Linear)
    ]
    try:
        assert runner.server.start_run() == 0
    finally:
        for hook in hooks:
            hook.remove()
    assert runner.evaluations[-1]["count"]["Total"] == len(eval_dataset)
    assert activations == {(torch.bfloat16, args.device)}  # where Trainer puts the model (PartialState)
    assert {parameter.dtype for parameter in runner.model.parameters()} == {torch.float32}


def test_evaluation_shows_its_progress_over_the_items(model_and_tokenizer, eval_dataset, capsys):
    model, tokenizer = model_and_tokenizer
    evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=2, max_new_tokens=4)
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "Evaluating:   0%" in bar and f"0/{len(eval_dataset)} [" in bar  # a bar over the items, cleared at the end
    evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=2, max_new_tokens=4, show_progress=False)
    assert "Evaluating" not in capsys.readouterr().err


def test_evaluation_under_the_runners_bar_writes_no_cursor_moves_into_a_log(model_and_tokenizer, eval_dataset, capsys):
    """The runner's "Federated rounds" bar is open while it evaluates: a nested bar would clear itself by moving the
    cursor up (ESC [A), which a log file (stderr here, no terminal) keeps as text."""
    model, tokenizer = model_and_tokenizer
    with tqdm(total=1, desc="Federated rounds"):
        evaluate_accuracy(model, tokenizer, eval_dataset, batch_size=2, max_new_tokens=4)
    log = capsys.readouterr().err
    assert "Federated rounds" in log and "\x1b[A" not in log and "Evaluating" not in log
