"""Client sampling: which clients of the federation train in a round, as Flower's strategies choose them.

Flower's `FedAvg` sends each round's train messages to int(`fraction_train` × N) nodes, at least `min_train_nodes`;
`FedGRPOConfig.fraction_train` and `min_train_clients` mean the same for the federation's N clients, and
`fraction_evaluate`, `min_evaluate_clients` for the clients that evaluate the global adapter on their own held-out
data (Flower's evaluate round), drawn independently of the training draw as Flower draws them. A draw depends on
(`seed`, round) alone, not on which clients trained before nor on how the run got to the round, so the in-process
runner and the Flower strategy (both through `FederatedServer`) sample the same clients, and a resumed run samples
those the uninterrupted run would have. Clients are named by index: the order of the runner's `client_datasets`, a
SuperNode's `partition-id`.
"""

from __future__ import annotations

import math
import random


def clients_per_round(num_clients: int, fraction: float, minimum: int) -> int:
    """How many of `num_clients` clients a round samples: Flower's count, int(`fraction` × N) but at least
    `minimum`, and at most N. The product is rounded to 9 decimals first, so that 0.29 × 100 is 29 clients, not the
    28 that its binary value 28.999... would give."""
    return min(num_clients, max(math.floor(round(fraction * num_clients, 9)), minimum))


def sample_clients(
    num_clients: int, fraction: float, minimum: int, seed: int, round_idx: int, stream: str = "train"
) -> list[int]:
    """The indices, ascending, of the clients that take part in round `round_idx`: `clients_per_round` of the
    `num_clients`, drawn uniformly without replacement from (`stream`, `seed`, `round_idx`) alone; all of them, in
    order, when the round takes every client. `stream` ("train", "evaluate") keeps the draws of a round apart."""
    size = clients_per_round(num_clients, fraction, minimum)
    if size == num_clients:
        return list(range(num_clients))
    # Only `random()` of a string-seeded `Random` is promised to give the same sequence in every Python version
    # (`random.sample`'s algorithm may change): a resumed run, even under another Python, draws the same clients.
    # The separators keep seed 1, round 23 apart from seed 12, round 3.
    rng = random.Random(f"client-sampling/{stream}/{seed}/{round_idx}")
    keys = [rng.random() for _ in range(num_clients)]
    return sorted(sorted(range(num_clients), key=keys.__getitem__)[:size])


def participation_errors(args, num_clients: int):
    """Yield one message per sampling setting of `args` (a `FedGRPOConfig`) that a federation of `num_clients`
    clients cannot meet:
    a minimum above N (Flower would wait for nodes forever; `min_evaluate_clients` only counts with
    `fraction_evaluate` > 0), or a `min_clients_per_round` above the clients each round samples, so that no round
    could ever aggregate. The one check of these settings against the clients: the config runs it for the
    `num_clients` it declares, `server.FederatedServer` for the clients it serves."""
    if args.min_train_clients > num_clients:
        yield f"`min_train_clients` ({args.min_train_clients}) exceeds the {num_clients} clients of the federation."
    if args.fraction_evaluate > 0 and args.min_evaluate_clients > num_clients:
        yield f"`min_evaluate_clients` ({args.min_evaluate_clients}) exceeds the {num_clients} clients."
    sampled = clients_per_round(num_clients, args.fraction_train, args.min_train_clients)
    if args.min_clients_per_round > sampled:
        yield (
            f"`min_clients_per_round` ({args.min_clients_per_round}) exceeds the {sampled} clients sampled each "
            f"round (`fraction_train` {args.fraction_train} of {num_clients} clients, at least `min_train_clients` "
            f"{args.min_train_clients}): no round could ever aggregate. `min_clients_per_round` "
            f"({args.min_clients_per_round}) must not exceed them: raise `fraction_train` or `min_train_clients`, or "
            "lower `min_clients_per_round`."
        )
