"""The model card of a federated run, and its push to the Hugging Face Hub.

The card is TRL's own (`trl.trainer.utils.generate_model_card`, as `GRPOTrainer.create_model_card` fills it from
`_tag_names`, `_name` and `_paper`), naming FGRPO and citing its paper, plus a section on the federation: method,
clients and their partition, rounds, local steps, reward window, LoRA, and the accuracy table when evaluation ran.

`FederatedRunner` writes it to `output_dir/README.md` at the end of every run, pushed or not, as TRL writes its
card at every checkpoint: the folder then describes itself. With `push_to_hub`, the final global adapter and the
card (never checkpoints, round adapters, client folders or logs) are uploaded to `hub_model_id`, or to a repository
named after `output_dir`, with `HfApi.create_repo` and `HfApi.upload_folder`, as `Trainer.push_to_hub` does.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from huggingface_hub import HfApi, ModelCard
from trl.trainer.utils import generate_model_card, get_config_model_id

from ..config import CONFIG_CLASSES, FedGRPOConfig
from ..core.callbacks import RoundCallback
from ..data.partition import split_description
from ..methods import METHODS
from ..runtime.models import DEFAULT_MODEL, DEFAULT_MODEL_PROVENANCE, base_model_hub_id, is_default_model
from .summary import ROUND_NUMBERING, format_evaluations

TAG_NAMES = ["trl", "grpo", "trl-federated", "federated-learning", "fgrpo"]
PAPER = {
    "title": "FGRPO: Federated GRPO with Adaptive Aggregation on Non-IID Data",
    "id": None,  # a preprint without an arXiv id yet: the card cites it but links no paper page
    # docstyle-ignore
    "citation": textwrap.dedent("""\
        @misc{chen2026fgrpo,
            title        = {{FGRPO: Federated GRPO with Adaptive Aggregation on Non-IID Data}},
            author       = {Pengyu Chen and Shaowei Li and Kai Wang and Yunsheng Yuan and Kai Han and Jun Luo and Feng Li},
            year         = 2026,
            note         = {Preprint},
        }"""),  # noqa: E501
}
# What the Hub repository receives: the final global adapter (PEFT layout) and its card.
PUSHED_FILES = ["adapter_model.safetensors", "adapter_config.json", "README.md"]


class HubPushError(RuntimeError):
    """The run finished and its outputs are saved in `output_dir`, but uploading them to the Hub failed."""


def hub_model_id(args: FedGRPOConfig) -> str:
    """The repository the run is pushed to: `hub_model_id`, else `output_dir`'s name (as `Trainer.init_hf_repo`)."""
    return args.hub_model_id or Path(args.output_dir).absolute().name


def method_name(args: FedGRPOConfig) -> str:
    """The method's name in the paper (`methods.METHODS`): FGRPO, FedAvg, ...; FDAPO and FGSPO with the DAPO and
    GSPO recipes."""
    algorithm = next((name for name, config_class in CONFIG_CLASSES.items() if type(args) is config_class), "grpo")
    # A method that sets other fields (`Method.settings`) names the configurations with its values, the others those
    # with the fields' defaults; a field no method of the configuration's aggregation sets does not change its name.
    fields = {name for m in METHODS.values() for name, _ in m.settings}
    defaults = {name: str(type(args).__dataclass_fields__[name].default) for name in fields}
    names: dict[tuple[str, str, str], str] = {}
    for matching in (True, False):
        for m in METHODS.values():  # the first name of a configuration: `fgrpo-sgd` is FGRPO itself
            settings = {**defaults, **dict(m.settings)}
            if not matching or all(str(getattr(args, name)) == value for name, value in settings.items()):
                names.setdefault((m.aggregation, m.server_optimizer, m.algorithm), m.display_name)
    server = (args.aggregation, args.server_optimizer)
    # FedAvg, FedProx and SCAFFOLD keep their names whatever the local algorithm.
    return names.get((*server, algorithm)) or names.get((*server, "grpo")) or f"`{server[0]}` + server `{server[1]}`"


def federation_section(
    args: FedGRPOConfig,
    num_clients: int,
    peft_config: Any,
    evaluations: dict[int, dict[str, Any]],
    privacy: str | None = None,
) -> str:
    """The card's Markdown section on the federation that trained the adapter, under TRL's "Training procedure"."""
    lora = "see adapter_config.json"
    if peft_config is not None:
        targets = peft_config.target_modules
        if not isinstance(targets, str):  # PEFT resolves "all-linear" to full module names: name their kinds
            targets = ", ".join(sorted({name.split(".")[-1] for name in targets}))
        lora = f"r={peft_config.r}, α={peft_config.lora_alpha}, target modules {targets}"
    rows = [
        ("Method", f"{method_name(args)}: aggregation `{args.aggregation}`, server optimizer `{args.server_optimizer}` "
                   f"(lr {args.server_learning_rate}), LoRA aggregation `{args.lora_aggregation}`"),
        # An RLOO config has no `loss_type`: RLOO's loss is its own.
        ("Local algorithm", f"`{type(args).__name__}` ("
                            + (f"loss `{args.loss_type}`, " if hasattr(args, "loss_type") else "") + f"β={args.beta})"),
        ("Clients", f"{num_clients}, {split_description(args)}"),
        ("Rounds", f"{args.num_rounds}, {args.local_steps} local steps per client and round"),
        ("Reward window W", str(args.reward_window)),
        ("LoRA", lora),
        *([("Differential privacy", privacy)] if privacy else []),
    ]  # fmt: skip
    lines = [
        "### Federated training",
        "",
        "This adapter is the global LoRA adapter of a federated run: every round each client trains the current "
        "global adapter on its own data with local GRPO steps, and the server aggregates the clients' adapters.",
        "",
        "| | |",
        "|---|---|",
        *(f"| {name} | {value} |" for name, value in rows),
    ]
    if evaluations:
        lines += ["", "#### Accuracy (%)", "", format_evaluations(evaluations), "", ROUND_NUMBERING]
    return "\n".join(lines)


# TRL's quick start section, which `usage_example` replaces.
QUICK_START = re.compile(r"## Quick start\n\n```python\n.*?```\n", re.DOTALL)


def adapter_location(args: FedGRPOConfig) -> str:
    """Where a reader of the card finds the adapter: its Hub repository when the run pushes it, else `output_dir`."""
    return hub_model_id(args) if args.push_to_hub else str(args.output_dir)


def usage_example(model_id: str | None, adapter: str) -> str:
    """The card's quick start: the base model loaded as the run loaded it (the embedded default by its name, through
    this package; any other with transformers), the adapter at `adapter` on it with PEFT, and one answer generated."""
    if is_default_model(model_id):
        load = (f"from trl_federated.runtime.models import load_model_and_tokenizer\n\n"
                f"base, tokenizer = load_model_and_tokenizer({DEFAULT_MODEL!r})  # the embedded SmolLM2-135M-Instruct")
    else:
        load = (f"from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
                f"base = AutoModelForCausalLM.from_pretrained({model_id!r})\n"
                f"tokenizer = AutoTokenizer.from_pretrained({model_id!r})")
    return (
        "## Quick start\n\nThe base model with this LoRA adapter on it:\n\n```python\nfrom peft import PeftModel\n"
        f"{load}\nmodel = PeftModel.from_pretrained(base, {adapter!r})\n"
        'messages = [{"role": "user", "content": "What is 12 + 7? Give the answer inside <answer></answer>."}]\n'
        "inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors=\"pt\", "
        "return_dict=True)\n"
        "output = model.generate(**inputs, max_new_tokens=64)\n"
        'print(tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))\n```\n'
    )


def federated_model_card(
    model,
    args: FedGRPOConfig,
    num_clients: int,
    evaluations: dict[int, dict[str, Any]],
    dataset_name: str | None = None,
    privacy: str | None = None,
) -> ModelCard:
    """TRL's model card for the run's global adapter, tagged and cited as FGRPO, with the federation's section
    (`privacy`: the differential-privacy guarantee the run reached, `ClientLevelPrivacy.describe`; None: none)."""
    model_id = get_config_model_id(model.config)
    base_model = base_model_hub_id(model_id)
    repo_id = hub_model_id(args)
    card = generate_model_card(
        base_model=base_model,
        model_name=repo_id.split("/")[-1],
        hub_model_id=repo_id,
        dataset_name=dataset_name,
        tags=TAG_NAMES,
        wandb_url=None,
        trackio_url=None,
        trainer_name="FGRPO",
        trainer_citation=PAPER["citation"],
        paper_title=PAPER["title"],
        paper_id=PAPER["id"],
    )
    # TRL's template fills what a federated card must say otherwise: its quick start names the repository as a full
    # model for `pipeline` (the folder holds an adapter), its card data a `licence: license` placeholder, and its
    # "Training procedure" opens with blank lines where the W&B and Trackio badges go.
    card.text = QUICK_START.sub(lambda _: usage_example(model_id, adapter_location(args)), card.text, count=1)
    card.data.pop("licence", None)
    card.text = re.sub(r"(## Training procedure\n)\s*\n(?=This model was trained)", r"\1\n", card.text, count=1)
    if base_model is None:  # TRL's template would link "huggingface.co/None"
        card.text = card.text.replace("[None](https://huggingface.co/None)", "a local model", 1)
    if is_default_model(model_id):  # `base_model` names the original; the weights trained on are a 4-bit build of it
        card.text = card.text.replace("### Framework versions", f"{DEFAULT_MODEL_PROVENANCE}\n\n### Framework versions",
                                      1)
    card.data.library_name = "peft"  # the repository holds an adapter: the Hub then offers to load it with PEFT
    peft_config = getattr(model, "peft_config", {}).get(getattr(model, "active_adapter", "default"))
    section = federation_section(args, num_clients, peft_config, evaluations, privacy)
    card.text = card.text.replace("### Framework versions", f"{section}\n\n### Framework versions", 1)
    return card


def push_to_hub(args: FedGRPOConfig) -> str:
    """Upload `output_dir`'s adapter and card to the Hub; returns the commit URL. Raises `HubPushError`, saying
    that nothing local is lost, when the Hub refuses or cannot be reached."""
    repo_id, folder = hub_model_id(args), Path(args.output_dir)
    api = HfApi(token=args.hub_token)
    try:
        repo_id = api.create_repo(repo_id, private=args.hub_private_repo, exist_ok=True).repo_id
        commit = api.upload_folder(
            repo_id=repo_id,
            folder_path=str(folder),
            allow_patterns=PUSHED_FILES,
            commit_message="End of federated training",
            revision=args.hub_revision,
        )
    except Exception as error:
        raise HubPushError(
            f"Could not push {folder} to the Hub repository {repo_id!r} ({type(error).__name__}: {error}). The "
            f"run is complete and its adapter and model card are saved in {folder}; push them later with "
            f"`hf upload {repo_id} {folder} --include {' '.join(PUSHED_FILES)}`."
        ) from error
    return str(commit)


class ModelCardReport(RoundCallback):
    """Writes the model card over PEFT's placeholder README.md when the final adapter is saved, pushed or not (the
    folder describes its adapter), and pushes the folder to the Hub when the run ends with `args.push_to_hub`."""

    def __init__(self, dataset_name: str | None = None):
        self.dataset_name = dataset_name

    def on_adapter_saved(self, args, model, output_dir, num_clients, evaluations, privacy, **kwargs):
        card = federated_model_card(model, args, num_clients, evaluations, self.dataset_name, privacy=privacy)
        card.save(Path(output_dir) / "README.md")

    def on_run_end(self, args, **kwargs):
        if args.push_to_hub:
            push_to_hub(args)
