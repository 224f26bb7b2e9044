"""How large is FedProx's proximal gradient against the GRPO gradient, and how far do the clients move in a round?

One round of the quickstart's federation (`examples/configs/quickstart.yaml`: SmolLM2-135M-Instruct, 3 clients, 2
local steps of 2 prompts x 4 completions, AdamW at 2e-4) with FedAvg and no proximal term, any `trl-federated run`
flag overriding it. At the start of every local step e a probe reads the client's distance ‖θ_e − θ^{[t]}‖ from the
round's adapter (the optimizer's float32 values, as `ProximalTerm` does), and TRL's `grad_norm` of that step, the
norm of the GRPO gradient before clipping. FedProx with μ adds the gradient μ (θ_e − θ^{[t]}), so

    r(μ) = μ ‖θ_e − θ^{[t]}‖ / ‖∇ GRPO‖

is the proximal term's size against the GRPO gradient at step e; it is linear in μ (to first order: the trajectory is
the one without the term). The probe also reports each client's per-coordinate move ‖θ_i − θ^{[t]}‖ / √d against
E x lr, and that of the clients' mean change Δ, which `FedGRPOConfig.server_learning_rate`'s default is sized to.

    OMP_NUM_THREADS=2 python benchmarks/fedprox_mu.py [--local_steps 10 ...]
"""

from __future__ import annotations

import json
import math
import sys
import tempfile

import torch

from trl_federated import RoundCallback
from trl_federated.adapters import state_distance
from trl_federated.runtime.master_weights import read_master

MU_GRID = (0.001, 0.01, 0.1, 1.0)  # FedProx's own sweep (Li et al., 2020)


class ProximalProbe(RoundCallback):
    """Per client and local step: ‖θ_e − θ^{[t]}‖ at the step's start and the step's GRPO `grad_norm`."""

    def __init__(self):
        self.steps: list[dict] = []
        self.updates: list = []
        self.client = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.params = [param for param in model.parameters() if param.requires_grad]
        self.anchor = [read_master(param).clone() for param in self.params]

    def on_step_begin(self, args, state, control, **kwargs):
        moved = torch._foreach_sub([read_master(param) for param in self.params], self.anchor)
        distance = math.sqrt(sum(norm.item() ** 2 for norm in torch._foreach_norm(moved)))
        self.steps.append({"step": state.global_step, "distance": distance})

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "grad_norm" in logs and self.steps and "grad_norm" not in self.steps[-1]:
            self.steps[-1]["grad_norm"] = float(logs["grad_norm"])
            self.steps[-1]["frac_reward_zero_std"] = logs.get("frac_reward_zero_std")

    def on_client_end(self, args, round_idx, update, **kwargs):
        for step in self.steps:
            step.setdefault("client", update.client_id)
        self.updates.append(update)


def main(argv: list[str]) -> None:
    from trl_federated.arguments import parse_run_args
    from trl_federated.data import partition_clients
    from trl_federated.data.loading import load_benchmark
    from trl_federated.runner import FederatedRunner
    from trl_federated.runtime.models import load_model, lora_config
    from trl_federated.scoring.rewards import training_rewards

    output_dir = tempfile.mkdtemp(prefix="fedprox-mu-")
    args, model_args, data_args = parse_run_args([
        "--config", "examples/configs/quickstart.yaml", "--aggregation", "fedavg", "--fedprox_mu", "0",
        "--num_rounds", "1", "--eval_initial", "false", "--save_every_round", "false", "--output_dir", output_dir,
        *argv,
    ])
    train, _ = load_benchmark(data_args)
    clients = partition_clients(train, args)
    model, processing_class = load_model(model_args, args)
    probe = ProximalProbe()
    runner = FederatedRunner(
        model, training_rewards(data_args), args, clients, processing_class=processing_class,
        peft_config=lora_config(model_args), callbacks=[probe],
    )
    initial = {key: value.clone() for key, value in runner.global_state.items()}
    runner.run()

    coordinates = sum(value.numel() for value in initial.values())
    budget = args.local_steps * args.learning_rate  # E x lr: the most E Adam steps of about lr move a coordinate
    print(f"E = {args.local_steps}, lr = {args.learning_rate:g}, d = {coordinates:,} adapter coordinates")
    print("client step  ‖θ−θ^t‖   grad_norm  zero-std groups  " + "  ".join(f"r(μ={mu:g})" for mu in MU_GRID))
    for step in probe.steps:
        # a step whose groups all had equal rewards has no GRPO gradient: the proximal term is all there is
        ratios = [mu * step["distance"] / step["grad_norm"] if step["grad_norm"] > 0 else math.inf for mu in MU_GRID]
        print(f"{step['client']:>6} {step['step']:>4}  {step['distance']:.4g}  {step['grad_norm']:.4g}  "
              f"{step['frac_reward_zero_std']}  " + "  ".join(f"{ratio:9.3g}" for ratio in ratios))
    # the steps that moved away from θ^{[t]} and had a GRPO gradient: where the term acts against it
    acting = [s for s in probe.steps if s["distance"] > 0 and s["grad_norm"] > 0]
    mean_acting = {mu: sum(mu * s["distance"] / s["grad_norm"] for s in acting) / max(len(acting), 1)
                   for mu in MU_GRID}
    print(f"mean r(μ) over the {len(acting)} steps after the first with a GRPO gradient: "
          + ", ".join(f"μ={mu:g}: {r:.3g}" for mu, r in mean_acting.items()))

    moves = {u.client_id: state_distance(u.state, initial) / math.sqrt(coordinates) for u in probe.updates}
    mean_change = {key: sum(u.state[key] - value for u in probe.updates) / len(probe.updates)
                   for key, value in initial.items()}
    delta_rms = math.sqrt(sum(value.square().sum().item() for value in mean_change.values()) / coordinates)
    print("per-coordinate RMS move / (E x lr): "
          + ", ".join(f"{client}: {move / budget:.3f}" for client, move in moves.items())
          + f"; clients' mean change Δ: {delta_rms / budget:.3f}")
    print(json.dumps({"steps": probe.steps, "mean_ratio": mean_acting, "client_rms_over_budget":
                      {client: move / budget for client, move in moves.items()},
                      "delta_rms_over_budget": delta_rms / budget}))


if __name__ == "__main__":
    main(sys.argv[1:])
