"""The client side: one client's round (`client`) and the trainer mixins that train it (`local_trainer`, `speedups`,
`shared_prefix`, `gated_mlp`, `fast_generation`). Above the aggregation (a client runs its aggregator's hooks), below
the server core."""
