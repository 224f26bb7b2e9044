"""vLLM in a federation, on CPU: TRL's server mode against a test double of TRL's `VLLMClient` (vLLM itself is not
installed here), and the refusals of what a federation cannot run on vLLM, before any model loads."""

import atexit
import gc
import types
import weakref

import pytest
import torch
from datasets import Dataset
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM, TrainerCallback
from trl.generation import vllm_generation
from trl.trainer import grpo_trainer

from conftest import length_reward
from trl_federated import FederatedRunner, FedGRPOConfig, FedGRPOTrainer


class FakeVLLMServer:
    """What `trl vllm-serve` does for a trainer, in this process: the base model, loaded once, whose weights the
    trainers overwrite, generating from whatever weights it was last sent; one weight-sync group at a time."""

    def __init__(self, model_dir):
        self.engine = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.group = None  # the open weight-sync group: the client holding it
        self.groups_opened = 0
        self.events = []  # ("trainer", expected merged weights) | ("push", weights) | ("generate",)

    def open_group(self, client):
        if self.group is not None:  # the rendezvous port is taken, and the server has one group
            raise RuntimeError("a weight-sync group is already open on the group port")
        self.group, self.groups_opened = client, self.groups_opened + 1

    def load(self, named_params):
        pushed = {}
        for name, tensor in named_params:  # read while TRL holds the adapter merged
            self.engine.get_parameter(name).data.copy_(tensor)
            pushed[name] = tensor.detach().clone()
        assert set(pushed) == {name for name, _ in self.engine.named_parameters()}
        self.events.append(("push", pushed))

    @torch.no_grad()
    def generate(self, prompts, n, max_tokens, temperature):
        self.events.append(("generate",))
        eos = self.engine.generation_config.eos_token_id
        completion_ids, logprobs = [], []
        for index, prompt in enumerate(prompts):
            with torch.random.fork_rng():
                torch.manual_seed(len(self.events) * 1000 + index)  # deterministic, and different per request
                output = self.engine.generate(
                    torch.tensor([prompt]), do_sample=True, temperature=temperature, max_new_tokens=max_tokens,
                    num_return_sequences=n, output_scores=True, return_dict_in_generate=True,
                )
            step_logprobs = torch.stack(output.scores, dim=1).log_softmax(-1)  # processed logprobs, as TRL asks
            for row, sequence in enumerate(output.sequences[:, len(prompt):].tolist()):
                length = sequence.index(eos) + 1 if eos in sequence else len(sequence)
                completion_ids.append(sequence[:length])
                logprobs.append([[step_logprobs[row, step, token].item()] for step, token in
                                 enumerate(sequence[:length])])
        return {"prompt_ids": prompts, "completion_ids": completion_ids, "logprobs": logprobs,
                "logprob_token_ids": [[[token] for token in ids] for ids in completion_ids]}


class FakeVLLMClient:
    """TRL's `VLLMClient`, as `VLLMGeneration` calls it in server mode, talking to a `FakeVLLMServer`."""

    server: FakeVLLMServer

    def __init__(self, base_url=None, host="0.0.0.0", server_port=8000, group_port=51216, connection_timeout=0.0):
        self.base_url, self.group_port, self.communicator = base_url, group_port, None

    def get_server_info(self):
        return {"model_config": {"logprobs_mode": "processed_logprobs"}, "weight_transfer_config": {"backend": "nccl"}}

    def init_communicator(self, device=0):
        self.server.open_group(self)
        self.communicator = object()
        atexit.register(self.close_communicator)  # as TRL's does

    def close_communicator(self):
        if self.communicator is not None:
            self.server.group, self.communicator = None, None

    def update_named_params(self, metadata, named_params):
        assert self.server.group is self, "weights pushed without an open weight-sync group"
        self.server.load(named_params)

    def reset_prefix_cache(self):
        pass

    def generate(self, prompts, features=None, n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=0,
                 min_p=0.0, max_tokens=16, logprobs=0, structured_outputs_regex=None, generation_kwargs=None):
        return self.server.generate(prompts, n, max_tokens, temperature)


@pytest.fixture
def vllm_server(monkeypatch, tiny_model_dir):
    """A `FakeVLLMServer`, with TRL's `VLLMClient` replaced where TRL's vLLM backend imports it."""
    server = FakeVLLMServer(tiny_model_dir)
    client_class = type("FakeVLLMClient", (FakeVLLMClient,), {"server": server})  # one per test: a fresh client
    instances = weakref.WeakSet()
    original_init = client_class.__init__

    def init(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        instances.add(self)

    client_class.__init__ = init
    monkeypatch.setattr(vllm_generation, "VLLMClient", client_class)
    monkeypatch.setattr(vllm_generation, "is_vllm_available", lambda *args, **kwargs: True)
    server.clients = instances
    yield server
    for client in list(instances):
        atexit.unregister(client.close_communicator)


def merged_weights(model):
    """The weights a vLLM server must hold for `model`'s active LoRA adapter: W + ΔW of every LoRA layer, by vLLM's
    (the base model's) parameter names; computed with PEFT's `get_delta_weight`, not TRL's merge."""
    merged = {}
    for name, param in model.named_parameters():
        if "lora_" in name:
            continue
        merged[name.removeprefix("base_model.model.").replace(".base_layer", "")] = param.detach().clone()
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            key = name.removeprefix("base_model.model.") + ".weight"
            merged[key] = merged[key] + module.get_delta_weight(module.active_adapters[0]).detach()
    return merged


class MarkTrainers(TrainerCallback):
    """Puts a marker in the server's log when a client trainer starts, with the weights it starts from."""

    def __init__(self, server):
        self.server = server

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.server.events.append(("trainer", merged_weights(model)))


def client_datasets():
    return [Dataset.from_dict({"prompt": [f"Client {c}: what is {i} + {c}?" for i in range(8)]}) for c in range(2)]


def test_two_clients_two_rounds_share_one_vllm_server(tiny_model_dir, tiny_tokenizer, fast_args, vllm_server):
    args = fast_args(num_rounds=2, local_steps=2, reward_window=2, use_vllm=True, vllm_mode="server")
    runner = FederatedRunner(
        AutoModelForCausalLM.from_pretrained(tiny_model_dir), length_reward, args, client_datasets(),
        processing_class=tiny_tokenizer, callbacks=[MarkTrainers(vllm_server)],
    )
    history = runner.run()
    assert [sorted(record.rewards) for record in history] == [["client_0", "client_1"]] * 2

    # Every client trainer (2 clients x 2 rounds) pushed the weights it starts from, merged, before it generated.
    events = vllm_server.events
    starts = [index for index, event in enumerate(events) if event[0] == "trainer"]
    assert len(starts) == 4 and starts[0] == 0
    previous_push = None
    for start, end in zip(starts, [*starts[1:], len(events)], strict=True):
        segment = events[start:end]
        kinds = [event[0] for event in segment]
        assert kinds[1] == "push" and "generate" in kinds, kinds  # pushed first, then generated
        expected, first_push = segment[0][1], segment[1][1]
        assert set(first_push) == set(expected)
        for name, tensor in expected.items():
            torch.testing.assert_close(first_push[name], tensor, rtol=0, atol=1e-6)
        if previous_push is not None:  # the previous client's trained weights differ: this client replaced them
            assert any(not torch.allclose(previous_push[name], first_push[name]) for name in first_push)
        previous_push = [event for event in segment if event[0] == "push"][-1][1]

    # One client and one weight-sync group served every trainer of the process: none opened per client-round,
    # none left behind (TRL keeps each client it connects alive until exit).
    gc.collect()
    assert vllm_server.groups_opened == 1
    assert len(vllm_server.clients) == 1 and vllm_server.group in vllm_server.clients


# Refusals, before any model loads --------------------------------------------------------------------------


@pytest.fixture
def no_engine(monkeypatch):
    """Records every vLLM engine TRL starts and every model it or the runner loads by name (none should)."""
    calls = []

    def engine(*args, **kwargs):
        calls.append("VLLMGeneration")
        raise RuntimeError("a vLLM engine was started")

    def loader(original, name):
        def load(*args, **kwargs):
            calls.append(name)
            return original(*args, **kwargs)

        return load

    from trl_federated.runtime import models

    monkeypatch.setattr(grpo_trainer, "VLLMGeneration", engine)
    monkeypatch.setattr(grpo_trainer, "create_model_from_path",
                        loader(grpo_trainer.create_model_from_path, "create_model_from_path"))
    monkeypatch.setattr(models, "load_model_and_tokenizer",
                        loader(models.load_model_and_tokenizer, "load_model_and_tokenizer"))
    return calls


def colocated(args: FedGRPOConfig) -> FedGRPOConfig:
    args.use_vllm, args.vllm_mode = True, "colocate"  # changed after the config validated itself
    return args


def test_a_federated_config_refuses_colocated_vllm(fast_args):
    with pytest.raises(ValueError, match=r"vllm_mode='colocate'.*Use `vllm_mode='server'`"):
        fast_args(num_clients=2, use_vllm=True)  # TRL's default mode is colocate
    assert fast_args(num_clients=1, use_vllm=True).vllm_mode == "colocate"  # a single client trains as GRPO does


def test_the_runner_refuses_colocated_vllm_before_loading_the_model(tiny_model_dir, fast_args, no_engine):
    with pytest.raises(ValueError, match=r"vllm_mode='colocate'"):
        FederatedRunner(str(tiny_model_dir), length_reward, colocated(fast_args()), client_datasets())
    assert no_engine == []


def test_the_federated_trainer_refuses_colocated_vllm_before_loading_the_model(tiny_model_dir, fast_args, no_engine):
    from trl_federated.adapters import default_lora_config

    args = colocated(fast_args(num_clients=2))
    with pytest.raises(ValueError, match=r"vllm_mode='colocate'"):
        FedGRPOTrainer(model=str(tiny_model_dir), reward_funcs=length_reward, args=args,
                       train_dataset=client_datasets()[0], peft_config=default_lora_config())
    assert no_engine == []


def test_the_client_app_refuses_colocated_vllm_before_building_a_trainer(
    monkeypatch, tiny_model, tiny_tokenizer, fast_args, no_engine
):
    pytest.importorskip("flwr")
    import json

    from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from trl_federated.adapters import get_adapter_state, with_federated_adapter
    from trl_federated.flower import ClientSite, make_client_app
    from trl_federated.flower.records import state_to_array_record

    for name, value in (("_run_id", 1), ("_node_id", 0), ("_task_id", 0)):
        monkeypatch.setattr(TaskIdentity, name, value)
    global_state = get_adapter_state(with_federated_adapter(tiny_model, 0))
    site = ClientSite(model=tiny_model, processing_class=tiny_tokenizer, reward_funcs=length_reward,
                      train_dataset=client_datasets()[0], args=colocated(fast_args()))
    app = make_client_app(lambda context: site)
    content = RecordDict({"arrays": state_to_array_record(global_state),
                          "config": ConfigRecord({"server-round": 1})})
    message = Message(content, dst_node_id=7, message_type=MessageType.TRAIN)
    message.metadata.__dict__["_message_id"] = "m1"
    context = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})

    reply = app(message, context)
    assert reply.has_error()
    assert "vllm_mode='colocate'" in json.loads(reply.error.reason)["reason"]
    assert no_engine == []


def test_the_simulation_refuses_vllm_before_any_round(monkeypatch, fast_args):
    pytest.importorskip("flwr")
    from flwr.app import Context, RecordDict

    from trl_federated.flower import apps, make_server_app

    runs = []
    strategy = types.SimpleNamespace(args=fast_args(num_clients=2, use_vllm=True, vllm_mode="server"),
                                     run=runs.append)
    monkeypatch.setattr(apps, "simulated_federation_size", lambda grid: 2)  # the Simulation Engine's grid
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with pytest.raises(ValueError, match="Simulation Engine"):
        make_server_app(lambda context: strategy)(grid=None, context=context)
    assert runs == []
