"""A ServerApp of one's own around `FederatedStrategy`, the way a Flower strategy is used: build it, then
`start(grid, initial_arrays, ...)`. To run it instead of the packaged one (`trl_federated.flower.fgrpo_app`), set
`serverapp = "fgrpo_app.own_server_app:app"` in pyproject.toml; the ClientApp is unchanged.

The strategy needs the model (it holds, evaluates and saves the global adapter) and the federation's
`FedGRPOConfig`, here read from the app's run config as the ClientApps read it, so that both sides agree on the
LoRA adapter, the seed and the wire format; everything else is Flower's: the grid, the initial arrays, the train
config sent to the clients, centralized evaluation with `evaluate_fn`, and the returned `Result`.
"""

import logging

from flwr.app import ConfigRecord, Context
from flwr.serverapp import Grid, ServerApp

from trl_federated.flower import FederatedStrategy, state_to_array_record
from trl_federated.flower.fgrpo_app import read_config, rewards
from trl_federated.runtime.models import load_model, lora_config

logger = logging.getLogger(__name__)
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    args, model_args, data_args = read_config(context)
    args.node_wait_timeout = 300  # seconds to wait each round for the sampled clients' SuperNodes, logged
    model, _ = load_model(model_args, args)
    strategy = FederatedStrategy(model, args, reward_funcs=rewards(data_args), peft_config=lora_config(model_args))
    # The federation starts from the strategy's seeded LoRA adapter; any adapter with its keys and shapes will do.
    initial_arrays = state_to_array_record(strategy.global_state)
    result = strategy.start(grid, initial_arrays, train_config=ConfigRecord({"note": "sent with every round"}))
    last_round = max(result.train_metrics_clientapp)
    logger.warning("Mean R̄ of the last round: %.4f", result.train_metrics_clientapp[last_round]["reward"])
