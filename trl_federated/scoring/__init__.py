"""Rewards: the paper's answer-checking reward and its kin (`rewards`, `answer_check`), their declared ranges, and the
reward functions by name (`reward_functions`). Beside the configuration and the data, which score with them."""
