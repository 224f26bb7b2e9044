"""The arguments of `trl-federated run`, importable without the command line (the Flower app and the benchmarks parse
with them): `flags`, what is answered before TRL and torch import (the `--config` YAML, the names of its keys and of
the flags, a value outside its choices or that does not convert, `--help`); `parsing`, the parser (`ArgumentParser`,
`BenchmarkArguments`, `config_class`, `parse_run_args`), which imports them. Each name imports its module when first
read, so `flags` runs without `parsing`."""

from ..names import lazy_attributes

__getattr__ = lazy_attributes(globals(), {
    **dict.fromkeys(("check_before_import", "choice_hint", "read_yaml_config", "recorded_parser", "usage_error"),
                    ".flags"),
    **dict.fromkeys(("ArgumentParser", "BenchmarkArguments", "INTERNAL_FIELDS", "RUN_DESCRIPTION", "check_model_path",
                     "config_class", "parse_run_args", "run_parser"), ".parsing"),
})  # fmt: skip
