"""The shipped YAML recipes: each parses like TRL's scripts into the right config class, and the paper recipes
reproduce the paper's setting, down to Table 4's per-round communication."""

import math
from enum import Enum
from pathlib import Path

import pytest
import torch
import yaml
from peft import get_peft_model, get_peft_model_state_dict
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from trl import ModelConfig, TrlParser, get_peft_config

from trl_federated.arguments import BenchmarkArguments, config_class
from trl_federated.config import CONFIG_CLASSES
from trl_federated.methods import METHODS

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"
RECIPES = sorted(CONFIGS.rglob("*.yaml"))
PAPER = CONFIGS / "paper"
# The recipes hold GPU settings; on this CPU-only machine TrainingArguments refuses bf16 unless told to use the CPU.
CPU = ["--use_cpu", "true", "--bf16", "false"]


def parse(path: Path, *overrides: str):
    argv = ["--config", str(path), *CPU, *overrides]
    return TrlParser((config_class(argv), ModelConfig, BenchmarkArguments)).parse_args_and_config(argv)


def _plain(value):
    return value.value if isinstance(value, Enum) else value


# How TrainingArguments stores some YAML values.
STORED_AS = {"report_to": {"none": []}}


def test_there_is_a_paper_recipe_per_method():
    assert {path.stem for path in PAPER.glob("*.yaml")} == {
        "fgrpo", "fgrpo-geoqa", "fedavg", "fedprox", "scaffold", "fdapo", "fgspo"
    }  # fmt: skip


@pytest.mark.parametrize("path", RECIPES, ids=[str(path.relative_to(CONFIGS)) for path in RECIPES])
def test_recipe_parses_into_its_config_class_with_every_key(path):
    values = yaml.safe_load(path.read_text())
    parsed = parse(path)
    args = parsed[0]
    assert type(args) is CONFIG_CLASSES[values.get("algorithm", "grpo")]
    for key, value in values.items():
        holder = next(obj for obj in parsed if hasattr(obj, key))
        if key not in ("use_cpu", "bf16"):
            expected = STORED_AS[key].get(value, value) if key in STORED_AS else value
            assert _plain(getattr(holder, key)) == expected, key


@pytest.mark.parametrize("name", ["fgrpo", "fedavg", "fedprox", "scaffold", "fdapo", "fgspo"])
def test_paper_recipes_share_the_paper_setting_and_differ_only_by_method(name):
    args, model_args, data_args = parse(PAPER / f"{name}.yaml")
    assert model_args.model_name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert (model_args.use_peft, model_args.lora_r, model_args.lora_alpha) == (True, 32, 128)
    assert (args.num_clients, args.dirichlet_alpha) == (5, 0.05)
    assert (data_args.dataset_name, args.partition_column) == ("open_r1", "difficulty")
    assert data_args.reward_funcs == ["accuracy"]
    # the RPG hyperparameters the paper reports (Section 4.3)
    rpg = (args.rpg_lambda_base, args.rpg_tau_min, args.rpg_tau_max, args.rpg_sigma_min, args.rpg_sigma_max)
    assert (*rpg, args.rpg_lambda_anneal) == (0.8, 1.5, 2.5, 0.05, 0.2, 0.1)
    # each method is the comparison harness's definition of it, and only the method's keys differ from FGRPO's
    for key, value in METHODS[name].overrides().items():
        parsed = data_args.algorithm if key == "algorithm" else getattr(args, key)
        assert str(parsed) == value, key
    assert args.loss_type == {"fdapo": "dapo", "fgspo": "grpo"}.get(name, "grpo")
    recipe, fgrpo = (yaml.safe_load((PAPER / f"{stem}.yaml").read_text()) for stem in (name, "fgrpo"))
    changed = {key for key in recipe.keys() | fgrpo.keys() if recipe.get(key) != fgrpo.get(key)}
    assert changed <= {"output_dir", *METHOD_KEYS}


def test_paper_recipes_cap_the_image_size():
    for path in sorted(PAPER.glob("*.yaml")):
        _, _, data_args = parse(path)
        assert data_args.max_pixels == 501_760, path.name  # R1-V's value for Qwen2.5-VL-3B on GEOQA


@pytest.mark.parametrize("value", [0, -1, float("nan")])
def test_bad_max_pixels_is_refused_when_parsing(value, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**yaml.safe_load((PAPER / "fgrpo.yaml").read_text()), "max_pixels": value}))
    with pytest.raises(ValueError, match="`max_pixels` must be a positive whole number"):
        parse(recipe)
    if not math.isnan(value):  # a "nan" flag is already refused by argparse, as not an int
        with pytest.raises(ValueError, match="`max_pixels` must be a positive whole number"):
            parse(PAPER / "fgrpo.yaml", "--max_pixels", str(value))


# What a method may change: the server, its client-side terms, the local algorithm and that algorithm's loss defaults.
METHOD_KEYS = {
    "aggregation", "server_optimizer", "server_learning_rate", "fedprox_mu", "scaffold_correction", "algorithm",
    "loss_type", "beta", "rpg_lambda_base", "rpg_tau_min", "rpg_tau_max", "rpg_sigma_min", "rpg_sigma_max",
    "rpg_lambda_anneal",
}  # fmt: skip


def test_geoqa_recipe_is_the_main_recipe_on_geoqa():
    main = yaml.safe_load((PAPER / "fgrpo.yaml").read_text())
    geoqa = yaml.safe_load((PAPER / "fgrpo-geoqa.yaml").read_text())
    changed = {key for key in main.keys() | geoqa.keys() if main.get(key) != geoqa.get(key)}
    assert changed == {"output_dir", "dataset_name", "partition_column"}
    assert (geoqa["dataset_name"], geoqa["partition_column"]) == ("geoqa", "category")


# Language-model dimensions of the paper's backbones (their config.json), Table 4's overhead in "MB", and the
# vision tower, whose MLP also has gate/up/down projections that the recipe must leave alone.
MROPE = {"rope_type": "default", "mrope_section": [16, 24, 24]}
QWEN25_VL = {
    "Qwen2.5-VL-3B": (dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                           num_key_value_heads=2, rope_parameters=MROPE), 2048, 228.45),
    "Qwen2.5-VL-7B": (dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                           num_key_value_heads=4, rope_parameters=MROPE), 3584, 308.06),
}  # fmt: skip


@pytest.mark.parametrize("backbone", list(QWEN25_VL))
def test_paper_lora_matches_table_4_communication(backbone):
    text_config, width, table_4_mb = QWEN25_VL[backbone]
    config = Qwen2_5_VLConfig(
        text_config={**text_config, "vocab_size": 151936},
        vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=width),
    )
    with torch.device("meta"):  # shapes only: no memory, no weights, no Hub
        model = Qwen2_5_VLForConditionalGeneration(config)
    _, model_args, _ = parse(PAPER / "fgrpo.yaml")
    adapter = get_peft_model_state_dict(get_peft_model(model, get_peft_config(model_args)))
    assert all(".language_model.layers." in key for key in adapter)
    projections = {key.split(".")[-3] for key in adapter}  # ...layers.N.self_attn.q_proj.lora_A.weight
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    mebibytes = sum(tensor.numel() * tensor.element_size() for tensor in adapter.values()) / 2**20
    assert mebibytes == pytest.approx(table_4_mb, rel=1e-3)
