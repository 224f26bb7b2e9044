"""The fields of a federated GRPO run: `FedGRPOConfig`, in TRL's documented-dataclass style.

`FedGRPOConfig` is a `trl.GRPOConfig`: every GRPO field keeps its meaning, and the federated fields below parse the
same way from YAML and the command line (`TrlParser`, `HfArgumentParser`). Without federation (`num_clients=1`,
the default) a `FedGRPOConfig` trains exactly like a `GRPOConfig` with the same field values. Its defaults are
the paper's Algorithm 1 where TRL's differ (`loss_type`, `lr_scheduler_type`); where we keep TRL's (`optim`,
`max_grad_norm`, `beta`), its Parameters say why. Its fields come by concern from field mixins, each documenting its
own (`FederationFields` here, `robustness_fields.RobustnessFields`, `privacy_fields.PrivacyFields`), which
`declared_fields` gathers into its `Parameters:`. `FedDAPOConfig` and `FedGSPOConfig` carry the DAPO and GSPO
recipes (`recipes.CONFIG_CLASSES`), `recipes.federated_config` adds the federation to any other `GRPOConfig`
subclass, and `results.result_fields` names the fields a resumed run must keep. What it does when built
(`building.BuildsConfig`), its checks (`checks.ConfigChecks`) and its server-step derivation (`server_step.ServerStep`)
are mixins of it, beside it in this folder.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trl import GRPOConfig

from ..choices import (
    AGGREGATIONS,
    GENERATION_DTYPE_CHOICES,
    LORA_AGGREGATIONS,
    RPG_GAINS,
    RPG_SIGNALS,
    SCAFFOLD_CORRECTIONS,
    SERVER_OPTIMIZERS,
    TRANSFER_DTYPES,
)
from .building import BuildsConfig
from .checks import ConfigChecks
from .declared_fields import documents_field_mixins
from .privacy_fields import PrivacyFields
from .results import ResultHelp
from .robustness_fields import RobustnessFields
from .server_step import ServerStep


class FederatedConfig(BuildsConfig, ServerStep, ConfigChecks):
    """What makes a TRL config a federation's: `FedGRPOConfig`, its recipes, and the class `recipes.federated_config`
    makes of another TRL config (`GMPOConfig`, `RLOOConfig`), each with the federation's fields of `FedGRPOConfig`."""


@dataclass
class FederationFields:
    r"""
    The federation's fields of [`FedGRPOConfig`] but its robustness, privacy and resuming ones: its rounds, clients
    and data, evaluation, aggregation, wire format, server step and local speed-ups, and the GRPO defaults it changes.

    Parameters:
        > Rounds and local work

        num_rounds (`int`, *optional*, defaults to `10`):
            Number of communication rounds T.
        local_steps (`int`, *optional*, defaults to `10`):
            Local GRPO optimisation steps E that every client runs per round.
        reward_window (`int` or `None`, *optional*, defaults to `None`):
            Window W (at most `local_steps`): a client reports R̄, the mean of its last W step rewards, where a step
            reward is the mean over the B prompts × K completions of that step. `None` takes min(5, `local_steps`).

        > Local training: Algorithm 1's defaults where they differ from TRL's

        loss_type (`str`, *optional*, defaults to `"grpo"`):
            GRPO loss normalisation. `"grpo"` (TRL's default is `"dapo"`) is the paper's Eq. (obj_grpo): each
            completion's token terms are averaged over its own length, then over the group. Other values as in
            [`~trl.GRPOConfig`]; [`FedDAPOConfig`] sets `"dapo"`.
        lr_scheduler_type (`str`, *optional*, defaults to `"constant"`):
            Local learning-rate schedule. `"constant"` (TRL's default is `"linear"`) is Algorithm 1's fixed local step
            size α_i. Any other schedule, with its warmup, runs once over the whole federation, `num_rounds` ×
            `local_steps` steps: local step e of round t takes its value at t·E + e, so each client's fresh trainer
            continues the schedule instead of restarting it every round.
        optim (`str`, *optional*, defaults to TRL's AdamW):
            Local optimizer. Algorithm 1 writes the local step as plain gradient ascent θ + α_i g; the paper's
            experiments, like TRL and the GRPO recipes it builds on, train with Adam(W), and SGD at GRPO's gradient
            scale needs a very different learning rate. `"sgd"` gives the literal Algorithm 1 step.
        max_grad_norm (`float`, *optional*, defaults to `1.0`):
            Gradient clipping of every local step (TRL's default; Algorithm 1 has none, `0` disables it). Kept on
            because a GRPO step on a batch with one rare high-advantage completion can be far larger than the rest.
            FedProx's proximal gradient is added after clipping.
        beta (`float`, *optional*, defaults to `0.0`):
            KL coefficient β of Eq. (obj_grpo); the paper gives no value, and `0.0` (TRL's default) drops the KL term.
            With β > 0 the reference policy π_ref is θ^{[0]}, the adapter the federation starts from (the base model
            for a freshly initialised LoRA), fixed for every client and round, as one-process GRPO keeps its initial
            adapter.
        federation_round (`int`, *optional*):
            Set by the federation on each client's local configuration, not by users: the round t a client trains
            in, which places its steps at t·`local_steps` in the federation-wide learning-rate schedule. `None`: a
            plain GRPO run whose schedule spans `max_steps`.

        > Clients and data

        num_clients (`int`, *optional*, defaults to `1`):
            Number of clients. Above 1, `FedGRPOTrainer.train()` partitions `train_dataset` into this many clients
            and runs the federated loop; 1 trains exactly like [`~trl.GRPOTrainer`].
        partition_column (`str` or `None`, *optional*, defaults to `"difficulty"`):
            Dataset column whose label distribution differs across clients (Dirichlet partition), and by whose labels
            the evaluation breaks accuracy down. `None`: a uniform split that needs no label column (a TRL dataset
            such as DeepMath has none), as `dirichlet_alpha="inf"` over any column.
        dirichlet_alpha (`float`, *optional*, defaults to `0.05`):
            Concentration μ of the Dirichlet partition: small is highly non-IID (the paper's 0.05), `"inf"` is a
            uniform split.
        min_partition_size (`int`, *optional*, defaults to `2`):
            Smallest number of training rows a client may receive.
        labels_per_client (`int` or `None`, *optional*):
            Give each client exactly this many values of `partition_column` (Flower's `PathologicalPartitioner`,
            labels dealt in order) in place of the Dirichlet draw: with 1 and as many clients as labels, one task per
            client. `None`: the Dirichlet partition.
        equal_partition_sizes (`bool`, *optional*, defaults to `False`):
            Cut every client's partition to the smallest one's size (its first rows in the shuffled order): equal data
            volumes, so that FedAvg's weights are equal and only what the clients learn tells them apart.

        > Client sampling: Flower's `fraction_train`, `min_train_nodes`, `fraction_evaluate`, `min_evaluate_nodes`

        fraction_train (`float`, *optional*, defaults to `1.0`):
            Fraction in (0, 1] of the N clients that train each round, counted as Flower's strategies count nodes:
            int(`fraction_train` × N) clients, at least `min_train_clients`. They are drawn uniformly without
            replacement from (`seed`, round) alone (`trl_federated.sampling`), so the in-process runner and the Flower
            strategy train the same clients, and a resumed run those the uninterrupted run would have. A client that
            sits a round out keeps its per-client state unchanged (RPG's baseline φ and volatility σ, SCAFFOLD's
            c_i). `1.0`: every client every round, the paper's Algorithm 1.
        min_train_clients (`int`, *optional*, defaults to `1`):
            Fewest clients sampled each round (Flower's `min_train_nodes`), at most N; it matters when
            int(`fraction_train` × N) is smaller. `min_clients_per_round` must not exceed the clients sampled.
        fraction_evaluate (`float`, *optional*, defaults to `0.0`):
            Flower only: fraction in [0, 1] of the N clients sent the new global adapter after each round (Flower's
            evaluate round) to evaluate it on their own held-out data (`ClientSite.eval_dataset`), which never
            leaves them; they reply with their accuracy and row count, and the server logs each client's and the
            row-weighted mean (`client_evaluation` lines in metrics.jsonl). Counted and drawn as `fraction_train`,
            independently of the round's training draw. `0.0`: no client evaluation; the server's own evaluation of
            `eval_dataset` is unaffected.
        min_evaluate_clients (`int`, *optional*, defaults to `1`):
            Fewest clients sampled for each evaluate round (Flower's `min_evaluate_nodes`), at most N.

        > Evaluation and outputs

        eval_every (`int`, *optional*, defaults to `0`):
            Evaluate the global adapter on the eval dataset every this many rounds (`0`: only before training and
            after the last round).
        eval_initial (`bool`, *optional*, defaults to `True`):
            Evaluate the initial adapter before round 0 (round -1 of `evaluations`: the base model for a fresh LoRA),
            the baseline of every accuracy gain. Turn it off when that evaluation is already known, as in a grid of
            runs over the same model and test split.
        save_every_round (`bool`, *optional*, defaults to `True`):
            Save the global adapter of every round under `output_dir/round-<t>` (PEFT layout).
        overwrite_output_dir (`bool`, *optional*, defaults to `False`):
            Start afresh in an `output_dir` that holds another run, whose `metrics.jsonl`, `result.json`,
            `checkpoint-<t>` and `round-<t>` are deleted first. Without it such an `output_dir` is an error, unless
            `resume_from_checkpoint` continues that run.

        > Failing clients

        min_clients_per_round (`int`, *optional*, defaults to `1`):
            Fewest clients whose updates must be accepted for a round to aggregate. A client that raises, exceeds
            `client_timeout` or sends an invalid update is dropped from its round; with fewer than this many left
            the run stops with an error, and the last checkpoint stays intact.
        client_timeout (`float`, *optional*):
            Wall-clock seconds a client's local round may take, from building its trainer to its last step.
            Training stops at the first step boundary past it and the late update is dropped. `None`: no limit.
        node_wait_timeout (`float`, *optional*, defaults to `600.0`):
            Flower deployment only: seconds the server waits, each round, until every client the round samples
            (all `num_clients` unless `fraction_train` < 1) is served by a connected SuperNode; the round then goes
            on with the sampled clients served, if they are at least `min_clients_per_round`. A SuperNode gone for
            good delays only the rounds that sample its client. `0`: never wait.

        > Aggregation

        aggregation (`str`, *optional*, defaults to `"rpg"`):
            Client weighting: `"rpg"` (FGRPO: softmax of relative performance gains), `"fedavg"` (data volume),
            `"fedprox"` (data volume, plus a proximal term in every client's loss, see `fedprox_mu`) or `"scaffold"`
            (data volume, plus control variates, see `scaffold_correction`). The methods the paper compares are these
            with a server optimizer and a local algorithm (`trl_federated.methods`), e.g. `"fedavg"` with
            `server_optimizer="adam"` is the "w/o RPG" ablation of the paper's step.
        rpg_lambda_base (`float`, *optional*, defaults to `0.8`):
            EMA coefficient λ_base in (0, 1] of each client's reward baseline φ.
        rpg_iota (`float`, *optional*, defaults to `0.9`):
            Decay ι in (0, 1] of the reward-volatility estimate σ.
        rpg_sigma_min (`float`, *optional*, defaults to `0.05`):
            Lower clip σ_min of the reward volatility, in absolute reward units: the paper's value, for a binary
            reward in [0, 1]. Scale it with the reward's range (the run warns when the reward functions declare a
            wider one).
        rpg_sigma_max (`float`, *optional*, defaults to `0.2`):
            Upper clip σ_max of the reward volatility, in absolute reward units, for a reward in [0, 1] (see
            `rpg_sigma_min`).
        rpg_tau_min (`float`, *optional*, defaults to `1.5`):
            Final softmax temperature τ_min.
        rpg_tau_max (`float`, *optional*, defaults to `2.5`):
            Initial softmax temperature τ_max.
        rpg_lambda_anneal (`float`, *optional*, defaults to `0.1`):
            Rate λ_anneal of the exponential temperature annealing.
        rpg_eps (`float`, *optional*, defaults to `1e-8`):
            ε added to σ in the RPG denominator.
        rpg_gain (`str`, *optional*, defaults to `"paper"`):
            How RPG turns R̄ into a gain: `"paper"` is Eq. rpg; `"noise-aware"` (`aggregation.rpg.RPGAggregator`)
            soft-thresholds the gap R̄ − φ at `rpg_noise_threshold` of its standard errors (from the standard error of
            R̄ over the window's step rewards) and floors σ at that standard error, so that a gap within R̄'s sampling
            noise earns no weight. Not under differential privacy, whose release covers R̄ alone.
        rpg_noise_threshold (`float`, *optional*, defaults to `1.0`):
            With `rpg_gain="noise-aware"`: the standard errors of the gap a client's R̄ must move before it earns a
            gain; 0 keeps only the σ floor.
        rpg_signal (`str`, *optional*, defaults to `"reward-window"`):
            What a client reports as R̄, the signal RPG's gain reads: `"reward-window"` is the paper's, the mean reward
            of its last `reward_window` local steps; `"held-out"` is its local model's greedy mean reward on
            `rpg_signal_items` rows of its own partition, set aside once (the same rows every round, drawn with a
            generator seeded by the client's id), never trained on and never sent, measured after its local steps with
            the server's evaluation and reported and released (the gate, differential privacy's R̃) as R̄ is; its
            standard error √((M − p)(p − m)/n) for rewards in [m, M] is what `rpg_gain="noise-aware"` reads. Why: the
            window cannot carry the signal. On the premise pilot R̄ is 64 completions of 8 prompts a round, and
            prompt-to-prompt variance dominates (σ_p ≈ 0.2): se(R̄) ≈ 0.095 against a client's real trend of 0.016-0.027
            a round, which bounds the correlation any gain can reach near 0.03 (0.10 at se 0.05, ~29 prompts a window;
            0.41 at se 0.02, ~180 prompts, ~90 local steps a round: ~15 CPU h a cell). A fixed slice makes
            R̄_t − R̄_{t−1} a paired difference on the same items, so the prompts' difficulty cancels, and greedy
            decoding adds no sampling noise: only the items whose answer changed move it. At ~0.17 CPU s an item, 160
            items a client-round cost ~0.4 CPU h a cell. Not under record-level DP, whose accountant does not count that
            measurement. The default stays the paper's: on the balanced premise pilot (2 seeds) the held-out R̄ gave
            RPG's gain a mean z of +1.41 against its null, the window's −1.40, both short of the gate's 2.
        rpg_signal_items (`int`, *optional*, defaults to `160`):
            With `rpg_signal="held-out"`: the rows n of each client's partition set aside for it. The greedy mean of a
            binary reward on n items has standard error √(p(1 − p)/n) ≤ 0.5/√n, 0.04 at 160 (for rewards in [m, M],
            √((M − p)(p − m)/n), an upper bound where rewards fall between m and M). The partition must keep at least
            `min_partition_size` rows, and a generation batch's prompts, to train on beside them.
        rpg_h_max (`float` or `None`, *optional*, defaults to `10.0`):
            Bound on |h| (the paper's Assumption 5): h is clipped to [-h_max, h_max], which caps the weight a client
            can gain by inflating its self-reported reward at exp(2 h_max / τ) times another's. An honest |h| never
            exceeds max(1 / (1 − ι), (R_max − R_min) / σ_max): below σ_max, σ ≥ (1 − ι)|gap|, so |h| ≤ 1 / (1 − ι);
            at σ_max, |h| ≤ |gap| / σ_max. With the paper's ι = 0.9 and σ_max = 0.2 that is 10 for rewards spanning
            up to 2 (accuracy + format), so the default changes nothing an honest run learns. `None`: unbounded.
        fedprox_mu (`float`, *optional*):
            FedProx proximal coefficient μ (not the Dirichlet μ): each client adds μ/2 ‖θ_i − θ^{[t]}‖² over the
            adapter to its GRPO loss, so its gradient μ (θ_i − θ^{[t]}) is clipped (`max_grad_norm`) together with
            the GRPO gradient, as in Flower's FedProx. `None`: 0.1 with `aggregation="fedprox"` and 0 (off)
            otherwise; any aggregation accepts a positive value. The paper gives no μ; 0.1 is the value of FedProx's
            own sweep ({0.001, 0.01, 0.1, 1}) at which the term acts without dominating at the quickstart's budget:
            there ‖μ (θ − θ^{[t]})‖ / ‖∇ GRPO‖ was 0.086 on the second local step (0.0086 at 0.01, which does nothing
            measurable), and it grows with every further step as Adam moves each coordinate by about the
            learning rate (`benchmarks/fedprox_mu.py`, `benchmarks/RESULTS.md`).
        scaffold_correction (`str`, *optional*, defaults to `"decoupled"`):
            How SCAFFOLD's correction c − c_i meets the local Adam: `"decoupled"` (applied to the parameters after
            each step, scaled by the learning rate, outside Adam) or `"gradient"` (added to the gradient before
            Adam, as in SGD-SCAFFOLD, through the loss: clipped with the GRPO gradient).
        aggregation_args (`dict` or `None`, *optional*, defaults to `None`):
            The hyperparameters of a registered aggregation that has its own (`register_aggregation`), by name; a
            JSON object on the command line. Its `from_config` reads them, its `config_errors` checks them.

        > Wire format

        lora_aggregation (`str`, *optional*, defaults to `"separate"`):
            How LoRA factors are federated. `"separate"` (the paper's): clients train and send A and B, and the
            server averages each; the average of B_i·A_i is then not the product of the averages. `"freeze_a"`
            (FFA-LoRA, Sun et al., ICLR 2024): A stays at its shared seeded initialisation and clients train and
            send B only, so Σ ω_i B_i A is exactly the average of the clients' updates and the payload roughly
            halves.
        transfer_dtype (`str`, *optional*, defaults to `"float32"`):
            Precision of each client's update on the wire. `"float32"` sends the adapter as trained; `"bfloat16"`
            sends the change θ_i − θ^{[t]} in bfloat16 (half the bytes), which the server adds back in float32, so
            the error is relative to the round's change, not to the weights. `"int8"`, `"nf4"` and `"fp4"` send the
            change quantized in blocks of 64 values, each block scaled by its largest magnitude (float32): absmax
            int8 (0.27 of the bytes), or 4-bit codes (0.14) on QLoRA's NormalFloat or the FP4 (E2M1) grid; each
            client keeps what its rounding left out and adds it to its next change (error feedback), so that the
            rounding does not add up over rounds. The server's broadcast stays float32.

        > Server optimizer

        server_optimizer (`str`, *optional*):
            Server step on the pseudo-gradient Δ. `"adam"`: the paper's literal Eqs. momentum/model_update (ε = 1e-8,
            no bias correction), which moves every coordinate by about α whatever Δ's size; `"sgd"`: θ + α Δ (α = 1:
            model averaging); `"fedadam"`: Adam with ε on each tensor's own update scale (τ from its first Δ), v
            started at τ², m bias-corrected, so its step has the clients' size; `"adam-norm"`: Adam's direction
            scaled per tensor to ‖Δ‖ of that tensor; `"nesterov"`: DiLoCo's Nesterov outer momentum. `None`: `"sgd"`
            with learning rate 1, the (weighted) mean of the client models: FedAvg, FedProx and SCAFFOLD as their
            papers define them, and FGRPO's RPG-weighted mean, chosen by experiment over the paper's `"adam"`, which
            learned less than FedAvg at the grid's budget while the weighted mean learned as much (docs/methods.md,
            "FGRPO's server step, chosen by experiment"); `"adam"` is the paper's step (the `fgrpo-paper` method).
            Left unset, a resumed run keeps the step (with its derived learning rate and ε) its checkpoint recorded,
            whatever the default is now.
            `benchmarks/server_step.py` compares them at the grid's budget.
        server_learning_rate (`float`, *optional*):
            Server learning rate α (Eq. model_update); an explicit value is used as given. `None` derives it once,
            when the config is made: for `"adam"`, α = 0.5 × `local_steps` × `learning_rate` (`SERVER_ADAM_SCALE` ×
            E × lr; the paper gives no value): its first step moves every coordinate by α (m / √v = 0.1 Δ / (0.1 |Δ|))
            and by up to 2.13 α per round along a persistent direction, while E local Adam steps move a coordinate
            by at most about E × lr; the paper's Theorem 1 ties the rates the same way (α = L E α_i). The others'
            rates are multiples of the clients' change: 1.0 for `"sgd"`, `"fedadam"` and `"adam-norm"` (FedAvg's
            step length in their first round) and DiLoCo's 0.7 for `"nesterov"`. Every round logs ‖server step‖ /
            ‖Δ‖ (`server_step_ratio`) and warns when it exceeds 5. A resumed run keeps the derived value its
            checkpoint recorded.
        server_beta1 (`float`, *optional*, defaults to `0.9`):
            Server Adam first-moment decay β1; Nesterov's momentum μ.
        server_beta2 (`float`, *optional*, defaults to `0.99`):
            Server Adam second-moment decay β2.
        server_epsilon (`float`, *optional*):
            Server Adam ε. `None`: the paper's 1e-8 for `"adam"` and `"adam-norm"`; for `"fedadam"`, τ, the RMS of
            each tensor's first non-zero Δ, so that ε sits on the update's own scale (an explicit value fixes τ).
        server_bias_correction (`bool`, *optional*, defaults to `False`):
            Apply Adam bias correction to `"adam"` (the paper's update has none; `"fedadam"` and `"adam-norm"` always
            correct).
        server_optimizer_args (`dict` or `None`, *optional*, defaults to `None`):
            The hyperparameters of a registered server optimizer that has its own (`register_server_optimizer`), as
            `aggregation_args`.

        > Exact speed-ups of the local step

        shared_prefix (`bool`, *optional*, defaults to `False`):
            Compute each distinct prompt of a batch once, and its K completions on top of the prompt's keys and
            values, instead of the whole prompt + completion K times, for the loss and for the old and reference
            log-probabilities. Exact (the same loss and gradients up to float rounding) for any loss type; calls it
            cannot split (images, gradient checkpointing or active dropout in training, sliding-window or recurrent
            layers, prompt-learning adapters) use the standard forward, and are counted and logged once. With
            gradient accumulation over one generation batch (`steps_per_generation` = `gradient_accumulation_steps`,
            `num_iterations` 1, loss `"grpo"`, `"dapo"` or `"dr_grpo"`) the micro-batches are also cut by prompt
            instead of at random, which leaves the step's gradient unchanged and computes each prompt once per step.
        recompute_gated_mlp (`bool`, *optional*, defaults to `False`):
            SiLU-gated MLPs (Llama, Qwen2, Mistral, ...) keep only gate_proj(x) and up_proj(x) for the backward and
            recompute silu(g) and silu(g)·u there: two intermediate-size tensors fewer per token and layer, the same
            gradients up to float rounding. Off by default: it costs CPU time on the loss step and lowers the peak
            memory only where MLP activations dominate it (long completions, large batches).
        skip_zero_advantage_rows (`bool`, *optional*, defaults to `False`):
            Leave out of the loss forward + backward the rows whose advantage is 0 (every row of a group whose
            completions all scored alike): without a KL term their loss and gradient are 0, so each micro-batch's
            loss, rescaled to its full rows, and the step's gradient are unchanged up to float rounding. In the
            committed grids 59-75% of groups scored alike. Loss `"grpo"`, `"dr_grpo"` or `"dapo"` with `beta` 0 and
            no entropy bonus, entropy mask, off-policy mask or MoE auxiliary loss; elsewhere the standard loss, counted
            and logged once. Off by default: TRL's logged `entropy` and clip ratios then cover the rows computed (one
            row of a micro-batch with none), not every row, unlike `GRPOTrainer`'s.

        > Fast generation: the local step's sampling and the greedy evaluation, at float rounding (bf16: its weights)

        fast_generation (`bool`, *optional*, defaults to `False`):
            Generate (TRL's transformers path, and the server's greedy evaluation) from a plain copy of the weights
            with LoRA merged in, refreshed before each generation, with eager attention and oneDNN-packed projection
            weights on CPU, each distinct prompt prefilled once and its cache shared by its K completions; decoding,
            sampling and stopping are `generate`'s own under TRL's generation config. What merging changes is float
            rounding: in float32 greedy completions are TRL's but at near-ties, sampled ones follow the same
            distribution. vLLM, continuous batching, images, sharded models, non-LoRA adapters or active dropout use
            TRL's generation, counted and logged once.
        generation_dtype (`str`, *optional*, defaults to `"auto"`):
            The dtype of the weights `fast_generation` generates with: `"float32"`, `"bfloat16"`, or `"auto"`:
            bfloat16 where the device computes it natively (AVX512-BF16 or AMX CPUs, bf16 CUDA devices), half the
            bytes per decode step, else float32. In bfloat16 the completions are sampled from the bf16-rounded
            policy (per-token log-probabilities within ~1e-2 of float32's, as a vLLM sampler's); the loss still
            scores them with the trained weights.
    """

    # Rounds and local work
    num_rounds: int = field(default=10, metadata={"help": "Number of communication rounds T."})
    local_steps: int = field(
        default=10, metadata={"help": ResultHelp("Local GRPO optimisation steps E that every client runs per round.")}
    )
    reward_window: int | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "Window W (<= local_steps): a client reports R̄, the mean of its last W step rewards (each the mean "
                "over the step's B prompts x K completions). Unset: min(5, local_steps)."
            )
        },
    )

    # Local training: the defaults of Algorithm 1 where they differ from TRL's
    loss_type: str = field(
        default="grpo",
        metadata={
            "help": "GRPO loss normalisation. 'grpo' (TRL's default is 'dapo') is the paper's Eq. (obj_grpo): token "
            "terms averaged over each completion's length, then over the group. Other values as in GRPOConfig."
        },
    )
    lr_scheduler_type: str = field(
        default="constant",
        metadata={
            "help": "Local learning-rate schedule. 'constant' (TRL's default is 'linear') is Algorithm 1's fixed step "
            "size. Any other schedule runs once over the whole federation (num_rounds x local_steps steps) instead "
            "of restarting every round."
        },
    )
    optim: str = field(
        default=GRPOConfig.__dataclass_fields__["optim"].default,
        metadata={
            "help": "Local optimizer (TRL's default, AdamW, as in the paper's experiments). 'sgd' gives Algorithm 1's "
            "literal step θ + α_i g, which at GRPO's gradient scale needs a very different learning rate."
        },
    )
    max_grad_norm: float = field(
        default=1.0,
        metadata={
            "help": "Gradient clipping of every local step (TRL's default; Algorithm 1 has none; 0 disables it), kept "
            "because one rare high-advantage completion can make a step far larger than the rest."
        },
    )
    beta: float = field(
        default=0.0,
        metadata={
            "help": "KL coefficient β of Eq. (obj_grpo); 0.0 (TRL's default; the paper gives none) drops the KL term. "
            "With β > 0 the reference policy is the adapter the federation starts from, for every client and round."
        },
    )
    federation_round: int | None = field(
        default=None,
        metadata={
            "help": "Set by the federation on each client's local configuration, not by users: the round a client "
            "trains in, which places its steps in the federation-wide learning-rate schedule. None: plain GRPO."
        },
    )

    # Clients and data (federated mode of the drop-in trainer)
    num_clients: int = field(
        default=1,
        metadata={
            "help": "Number of clients. Above 1, FedGRPOTrainer.train() partitions train_dataset into this many "
            "clients and runs the federation; 1 trains exactly like GRPOTrainer."
        },
    )
    partition_column: str | None = field(
        default="difficulty",
        metadata={
            "help": "Dataset column whose label distribution differs across clients (Dirichlet partition) and by "
            "whose labels evaluation accuracy is broken down. None: a uniform split that needs no label column."
        },
    )
    dirichlet_alpha: float = field(
        default=0.05,
        metadata={
            "help": "Concentration μ of the Dirichlet partition: small is highly non-IID (paper: 0.05), 'inf' is "
            "a uniform split."
        },
    )
    min_partition_size: int = field(
        default=2, metadata={"help": "Smallest number of training rows a client may receive."}
    )
    labels_per_client: int | None = field(
        default=None,
        metadata={"help": "Give each client exactly this many values of `partition_column` (Flower's "
                  "PathologicalPartitioner, dealt in order) in place of the Dirichlet draw. None: the Dirichlet draw."},
    )
    equal_partition_sizes: bool = field(
        default=False,
        metadata={"help": "Cut every client's partition to the smallest one's size: equal data volumes (FedAvg's "
                  "weights equal), so that only what the clients learn tells them apart."},
    )

    # Client sampling, named after Flower's strategies
    fraction_train: float = field(
        default=1.0,
        metadata={
            "help": ResultHelp(
                "Fraction in (0, 1] of the clients that train each round, as Flower's strategies count: "
                "int(fraction_train x N), at least min_train_clients, drawn from (seed, round) alone so that the "
                "runner, the Flower strategy and a resumed run train the same clients. A client that sits a round out "
                "keeps its RPG baseline and SCAFFOLD control unchanged. 1.0: every client every round (the paper)."
            )
        },
    )
    min_train_clients: int = field(
        default=1,
        metadata={
            "help": ResultHelp(
                "Fewest clients sampled each round (Flower's min_train_nodes), at most the number of clients; it "
                "matters when int(fraction_train x N) is smaller."
            )
        },
    )
    fraction_evaluate: float = field(
        default=0.0,
        metadata={
            "help": "Flower only: fraction in [0, 1] of the clients that evaluate the new global adapter after each "
            "round on their own held-out data (Flower's evaluate round), counted and drawn as fraction_train; the "
            "server logs each client's accuracy and their row-weighted mean. 0.0: no client evaluation."
        },
    )
    min_evaluate_clients: int = field(
        default=1,
        metadata={"help": "Fewest clients sampled for each evaluate round (Flower's min_evaluate_nodes)."},
    )

    # Evaluation and outputs
    eval_every: int = field(
        default=0,
        metadata={
            "help": "Evaluate the global adapter on the eval dataset every this many rounds (0: only before "
            "training and after the last round)."
        },
    )
    eval_initial: bool = field(
        default=True,
        metadata={
            "help": "Evaluate the initial adapter before round 0, the baseline of every accuracy gain. Turn it off "
            "when that evaluation is already known, as in a grid of runs over the same model and test split."
        },
    )
    save_every_round: bool = field(
        default=True,
        metadata={"help": "Save the global adapter of every round under output_dir/round-<t> (PEFT layout)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start afresh in an output_dir that holds another run, deleting that run's files first. Without "
            "it such an output_dir is an error, unless `resume_from_checkpoint` continues that run."
        },
    )

    # Failing clients
    min_clients_per_round: int = field(
        default=1,
        metadata={
            "help": "Fewest clients whose updates must be accepted for a round to aggregate: with fewer (clients that "
            "raised, timed out or sent an invalid update are dropped) the run stops, its last checkpoint intact."
        },
    )
    client_timeout: float | None = field(
        default=None,
        metadata={
            "help": "Wall-clock seconds a client's local round may take; training stops at the first step boundary "
            "past it and the late update is dropped. None: no limit."
        },
    )
    node_wait_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Flower deployment only: seconds the server waits, each round, for the SuperNodes of the clients "
            "the round samples (all of them unless fraction_train < 1) to connect before going on with those served "
            "(at least `min_clients_per_round`). 0: never wait."
        },
    )

    # Aggregation
    aggregation: str = field(
        default="rpg",
        metadata={
            "help": "Client weighting: 'rpg' (FGRPO, softmax of relative performance gains), 'fedavg' (data "
            "volume), 'fedprox' (data volume plus a proximal term in every client's loss, see `fedprox_mu`) or "
            "'scaffold' (data volume plus control variates, see `scaffold_correction`).",
            "choices": AGGREGATIONS,  # the registry itself: a name registered after import is a choice
        },
    )
    rpg_lambda_base: float = field(
        default=0.8,
        metadata={"help": ResultHelp("EMA coefficient λ_base in (0, 1] of each client's reward baseline φ.")},
    )
    rpg_iota: float = field(
        default=0.9, metadata={"help": ResultHelp("Decay ι in (0, 1] of the reward-volatility estimate σ.")}
    )
    rpg_sigma_min: float = field(
        default=0.05,
        metadata={
            "help": ResultHelp(
                "Lower clip σ_min of the reward volatility, in absolute reward units, for a reward in [0, 1] (the "
                "paper's): scale it with the reward's range."
            )
        },
    )
    rpg_sigma_max: float = field(
        default=0.2,
        metadata={
            "help": ResultHelp(
                "Upper clip σ_max of the reward volatility, in absolute reward units, for a reward in [0, 1] (the "
                "paper's): scale it with the reward's range."
            )
        },
    )
    rpg_tau_min: float = field(default=1.5, metadata={"help": ResultHelp("Final softmax temperature τ_min.")})
    rpg_tau_max: float = field(default=2.5, metadata={"help": ResultHelp("Initial softmax temperature τ_max.")})
    rpg_lambda_anneal: float = field(
        default=0.1, metadata={"help": ResultHelp("Rate λ_anneal of the exponential temperature annealing.")}
    )
    rpg_eps: float = field(default=1e-8, metadata={"help": ResultHelp("ε added to σ in the RPG denominator.")})
    rpg_gain: str = field(
        default="paper",
        metadata={"help": ResultHelp("How RPG turns R̄ into a gain: 'paper' (Eq. rpg) or 'noise-aware' (the gap "
                                     "soft-thresholded at its standard error, σ floored there)."),
                  "choices": list(RPG_GAINS)},
    )
    rpg_noise_threshold: float = field(
        default=1.0,
        metadata={"help": ResultHelp("With rpg_gain 'noise-aware': the standard errors of the gap that earn no gain.")},
    )
    rpg_signal: str = field(
        default="reward-window",
        metadata={
            "help": ResultHelp(
                "What a client reports as R̄: 'reward-window' (the paper's mean reward of its last reward_window "
                "steps) or 'held-out' (its local model's greedy mean reward on a fixed slice of rpg_signal_items rows "
                "of its own partition, never trained on or sent, released as R̄ is). The window's R̄ (64 completions "
                "of 8 prompts) has se ~0.095 against a real trend of 0.016-0.027 a round; a fixed slice makes each "
                "round's change a paired difference on the same items, ~0.4 CPU h a cell at 160 items. The paper's "
                "stays the default: on the balanced premise pilot neither passed the gate (mean z +1.41 held-out, "
                "−1.40 window; gate 2)."
            ),
            "choices": list(RPG_SIGNALS),
        },
    )
    rpg_signal_items: int = field(
        default=160,
        metadata={
            "help": ResultHelp(
                "With rpg_signal 'held-out': the rows of each client's partition set aside for it (se of a binary "
                "reward's mean at most 0.5/sqrt(n): 0.04 at 160)."
            )
        },
    )
    rpg_h_max: float | None = field(
        default=10.0,
        metadata={
            "help": ResultHelp(
                "Bound on |h| (the paper's Assumption 5), which caps the weight a client can gain by inflating its "
                "reported reward. The default binds no honest run whose rewards span up to 2. None: unbounded."
            )
        },
    )

    fedprox_mu: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "FedProx proximal coefficient μ: each client adds μ/2 ||θ_i − θ^{[t]}||² to its GRPO loss (its "
                "gradient is clipped with the GRPO gradient, as in Flower's FedProx). None: 0.1 with "
                "aggregation='fedprox' (the paper gives none; at the quickstart's budget its pull is ~9 percent of the "
                "GRPO gradient on the second local step, 0.01's ~1 percent), 0 (off) otherwise; any aggregation "
                "accepts a positive value."
            )
        },
    )

    scaffold_correction: str = field(
        default="decoupled",
        metadata={
            "help": ResultHelp(
                "How SCAFFOLD's correction c − c_i meets the local Adam: 'decoupled' (applied to the parameters "
                "after each step, outside Adam) or 'gradient' (added to the gradient before Adam, as in SGD-SCAFFOLD)."
            ),
            "choices": list(SCAFFOLD_CORRECTIONS),
        },
    )
    aggregation_args: dict | str | None = field(
        default=None,
        metadata={"help": ResultHelp("The hyperparameters of a registered aggregation that has its own, by name (a "
                                     "JSON object on the command line): its `from_config` reads them, its "
                                     "`config_errors` checks them.")},
    )

    # Wire format
    lora_aggregation: str = field(
        default="separate",
        metadata={
            "help": "How LoRA factors are federated: 'separate' (the paper's: A and B are averaged each on its own, "
            "which is not the average of the B_i·A_i) or 'freeze_a' (FFA-LoRA: A keeps its shared initialisation "
            "and only B trains and travels, so the average is exact and the payload roughly halves).",
            "choices": list(LORA_AGGREGATIONS),
        },
    )
    transfer_dtype: str = field(
        default="float32",
        metadata={
            "help": "Precision of each client's update on the wire: 'float32' sends the adapter as trained, "
            "'bfloat16' the round's change θ_i − θ (half the bytes, rounded relative to the change, not the weights); "
            "'int8', 'nf4' and 'fp4' that change quantized in blocks of 64 with a float32 scale each (0.27, 0.14 "
            "and 0.14 of the bytes), what the rounding left out kept by the client for its next round (error "
            "feedback).",
            "choices": TRANSFER_DTYPES,  # the registry itself
        },
    )

    # Server optimizer
    server_optimizer: str | None = field(
        default=None,
        metadata={
            "help": "Server step on the pseudo-gradient Δ: 'adam' (the paper's literal Eq. model_update: ε 1e-8, no "
            "bias correction, every coordinate moves about α whatever Δ), 'sgd' (θ + αΔ), 'fedadam' (Adam with ε on "
            "the update's own scale, v started at ε², bias-corrected), 'adam-norm' (Adam's direction at ‖Δ‖ per "
            "tensor) or 'nesterov' (DiLoCo's outer momentum). None: 'sgd' with learning rate 1, the weighted mean "
            "of the client models, for every method: FGRPO's default by experiment (the paper's 'adam' learned less "
            "than FedAvg at the grid's budget, the RPG-weighted mean as much; docs/methods.md); a resumed run keeps "
            "its checkpoint's.",
            "choices": SERVER_OPTIMIZERS,  # the registry itself
        },
    )
    server_learning_rate: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "Server learning rate α (Eq. model_update); an explicit value is used as given. None derives it once: "
                "0.5 x local_steps x learning_rate for 'adam', whose first step moves every coordinate by α whatever "
                "the clients' change (half of the most E local Adam steps move one, as the paper's Theorem 1 ties α "
                "to E x the local rate); for the others a multiple of the clients' change: 1.0 for 'sgd', 'fedadam' "
                "and 'adam-norm' (FedAvg's step length), DiLoCo's 0.7 for 'nesterov'. A resumed run keeps the "
                "derived value of its checkpoint."
            )
        },
    )
    server_beta1: float = field(
        default=0.9, metadata={"help": ResultHelp("Server Adam first-moment decay β1; Nesterov's momentum μ.")}
    )
    server_beta2: float = field(default=0.99, metadata={"help": ResultHelp("Server Adam second-moment decay β2.")})
    server_epsilon: float | None = field(
        default=None,
        metadata={
            "help": ResultHelp(
                "Server Adam ε. None: the paper's 1e-8 for 'adam' and 'adam-norm'; for 'fedadam' the RMS of each "
                "tensor's first non-zero Δ, so that ε sits on the update's own scale, as FedAdam's τ."
            )
        },
    )
    server_bias_correction: bool = field(
        default=False,
        metadata={
            "help": ResultHelp(
                "Apply Adam bias correction to 'adam' (the paper's update has none; 'fedadam' and 'adam-norm' always "
                "correct)."
            )
        },
    )
    server_optimizer_args: dict | str | None = field(
        default=None,
        metadata={"help": ResultHelp("The hyperparameters of a registered server optimizer that has its own, by name "
                                     "(a JSON object on the command line), as `aggregation_args`.")},
    )

    # Exact speed-ups of the local step (any number of clients, 1 included)
    shared_prefix: bool = field(
        default=False,
        metadata={
            "help": "Compute each distinct prompt of a batch once and its K completions on top of its keys and "
            "values, instead of prompt + completion K times. Exact up to float rounding; calls it cannot split "
            "(images, gradient checkpointing, active dropout, ...) use the standard forward."
        },
    )
    recompute_gated_mlp: bool = field(
        default=False,
        metadata={
            "help": "Keep only gate_proj(x) and up_proj(x) of SiLU-gated MLPs (Llama, Qwen2, Mistral, ...) for the "
            "backward and recompute the rest there: less activation memory, the same gradients up to float "
            "rounding. Off by default: it costs CPU and pays only where MLP activations dominate memory."
        },
    )
    skip_zero_advantage_rows: bool = field(
        default=False,
        metadata={
            "help": "Leave the rows whose advantage is 0 (groups that all scored alike: 0.59-0.75 of them in the "
            "committed grids) out of the loss forward + backward: with beta 0 their loss and gradient are 0, so the "
            "step's gradient is unchanged up to float rounding. Off by default: TRL's logged entropy and clip ratios "
            "then cover the rows computed only. Loss grpo, dr_grpo or dapo; other settings keep the standard loss, "
            "logged once."
        },
    )
    fast_generation: bool = field(
        default=False,
        metadata={
            "help": "Generate (local steps and the greedy evaluation) from a copy of the weights with LoRA merged, "
            "refreshed before each generation, each distinct prompt prefilled once for its K completions, under "
            "TRL's generation config: float rounding changes only (in float32, greedy completions are TRL's but at "
            "near-ties). The copy costs one model's weights in generation_dtype (on CPU its projections are freed "
            "after each generation). vLLM, images, sharded models, non-LoRA adapters use TRL's generation."
        },
    )
    generation_dtype: str = field(
        default="auto",
        metadata={
            "help": "Weights dtype of `fast_generation`: 'auto' (bfloat16 where the device has native bf16, else "
            "float32), 'float32' or 'bfloat16'. bf16 halves the bytes per decode step and samples from the "
            "bf16-rounded policy (log-probabilities within ~1e-2 of float32's); the loss keeps the trained weights.",
            "choices": list(GENERATION_DTYPE_CHOICES),
        },
    )


# A dataclass takes its bases' fields in reverse MRO order, then its own: the field mixins are listed last concern
# first, so that `dataclasses.fields`, `--help` and the `Parameters:` list the federation's fields after TRL's, from
# the rounds to resuming.
@documents_field_mixins
@dataclass
class FedGRPOConfig(FederatedConfig, PrivacyFields, RobustnessFields, FederationFields, GRPOConfig):
    r"""
    Configuration class for [`FedGRPOTrainer`] and [`FederatedRunner`]: a [`~trl.GRPOConfig`] plus the federation.

    Each of `num_rounds` rounds, every client starts from the global LoRA adapter, runs `local_steps` GRPO
    optimisation steps on its private data and reports the adapter and R̄, the mean step reward over its last
    `reward_window` steps. The server weights the clients (`aggregation`) and applies the weighted
    pseudo-gradient with a server optimizer. With `aggregation="rpg"` this is FGRPO; the RPG hyperparameter
    defaults are the paper's (Section 4.3), and `rpg_iota`, `rpg_eps`, which the paper leaves open, are ours.

    When `num_clients > 1`, `FedGRPOTrainer(..., train_dataset=ds).train()` splits `ds` into `num_clients`
    partitions with a Dirichlet(`dirichlet_alpha`) distribution over `partition_column` and runs the federation.

    This class lists only the federation's parameters and the GRPO parameters whose defaults it changes; every
    other parameter is [`~trl.GRPOConfig`]'s, except that an unset `bf16` (TRL: on unless `fp16`) follows the device
    training runs on: with `use_cpu`, on where the CPU computes bf16 natively (AVX512-BF16 or AMX: matrix products
    ~2x faster, the quickstart's whole loss ~1.08x; elsewhere bf16 is emulated, slower than float32), and off on a
    machine without a bf16 accelerator when `use_cpu` is not set, where TRL's default refuses to start. Using
    [`~transformers.HfArgumentParser`] or [`~trl.TrlParser`] we can turn it into command-line arguments and read it
    from a YAML file.

    Parameters:
        > Resuming

        resume_allow_changes (`str`, *optional*):
            Comma-separated fields that a resumed run may change (e.g. `"learning_rate,rpg_tau_min"`), among those
            that change what a run computes (`result_fields`): any other difference from the checkpoint's run is a
            `CheckpointMismatchError`. The model, LoRA, clients, aggregation, server optimizer and wire format can
            never change.
    """

    # Resuming
    resume_allow_changes: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated result-changing fields that a resumed run may change (e.g. "
            "'learning_rate,rpg_tau_min'); any other difference from the checkpoint's run is an error. The model, "
            "LoRA, clients, aggregation, server_optimizer and wire format can never change."
        },
    )

