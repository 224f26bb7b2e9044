# Federated GRPO, shaped like TRL's `trl/scripts/grpo.py`: the same parser, model and dataset loading and trainer
# call, with `FedGRPOTrainer` (or the `--trainer_class` given, federated) as the drop-in trainer. With `num_clients > 1`
# the trainer partitions the training split over the clients (Dirichlet over `partition_column`) and runs every round;
# with 1 it is plain GRPO.

"""
The paper's setting (Qwen2.5-VL-3B-Instruct, 5 clients, μ = 0.05, FGRPO) on one GPU:

    python examples/scripts/fgrpo.py --config examples/configs/paper/fgrpo.yaml

GEOQA instead of Multimodal-Open-R1, a baseline, or federated DAPO / GSPO:

    python examples/scripts/fgrpo.py --config examples/configs/paper/fgrpo.yaml \
        --dataset_name geoqa --partition_column category --output_dir outputs/paper/fgrpo-geoqa
    python examples/scripts/fgrpo.py --config examples/configs/paper/fedprox.yaml
    python examples/scripts/fgrpo.py --config examples/configs/paper/fdapo.yaml

Any key of the YAML can be overridden with `--key value`; `python examples/scripts/fgrpo.py --help` lists them all
(every `GRPOConfig` field, the federation fields of `FedGRPOConfig`, TRL's `ModelConfig` and the benchmark).
"""

import sys

from trl import ModelConfig, get_peft_config

from trl_federated.arguments import ArgumentParser, BenchmarkArguments, config_class
from trl_federated.data.loading import load_benchmark
from trl_federated.reports.summary import ReportCallback
from trl_federated.runtime.models import load_model
from trl_federated.scoring.rewards import check_reward_columns, reward_functions, training_rewards
from trl_federated.trainer import trainer_class


def main(training_args, model_args, data_args):
    # Reward functions: the paper's binary accuracy on the `<answer>` tag by default; TRL's names (`accuracy_reward`,
    # ...), dotted import paths and `reward_model_name_or_path` as in `trl grpo`
    reward_funcs = training_rewards(data_args)
    # The accuracy table scores accuracy alone, whichever rewards train (`eval_reward_funcs`)
    eval_reward_funcs = reward_functions(data_args.eval_reward_funcs, "eval_reward_funcs")

    # Model and tokenizer, or processor for a vision-language model
    model, processing_class = load_model(model_args, training_args)

    # Dataset: train split for the clients, test split for the accuracy table before and after training
    train_dataset, eval_dataset = load_benchmark(data_args)
    check_reward_columns(reward_funcs, train_dataset)  # e.g. TRL's accuracy_reward needs a `solution` column
    check_reward_columns(eval_reward_funcs, eval_dataset, "eval_reward_funcs")

    # Initialise the federated GRPO trainer: FedGRPOTrainer, or `--trainer_class` federated (`trainer.federated`)
    trainer = trainer_class(data_args)(
        model=model,
        reward_funcs=reward_funcs,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        eval_reward_funcs=eval_reward_funcs,
        processing_class=processing_class,
        peft_config=get_peft_config(model_args),
        callbacks=[ReportCallback(training_args.output_dir)],  # summary.md and plots, rewritten every round
    )

    # Train: every round of every client, then the global adapter is in `output_dir`
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.accelerator.print(f"Training completed; adapter, metrics and summary.md in {training_args.output_dir}.")


def make_parser(argv):
    # `--algorithm dapo|gspo` (or `algorithm:` in the YAML) picks FedDAPOConfig / FedGSPOConfig and their defaults.
    # TRL's TrlParser, with `--help` grouped by dataclass and a one-line error naming an unknown key or flag and the
    # closest valid one (never abbreviated: `--num_round` is an error, not `--num_rounds`)
    return ArgumentParser(
        (config_class(argv), ModelConfig, BenchmarkArguments),
        description="Federated GRPO shaped like TRL's grpo.py: a YAML --config, then --key value flags, which override "
        "it. Example: python examples/scripts/fgrpo.py --config examples/configs/paper/fgrpo.yaml",
    )


if __name__ == "__main__":
    parser = make_parser(sys.argv[1:])
    training_args, model_args, data_args = parser.parse_args_and_config()
    main(training_args, model_args, data_args)
