"""Comparison grid of federated methods (the paper's Tables 1 and 3); same as `trl-federated compare`.

    python benchmarks/compare.py --config examples/configs/quickstart.yaml --methods fgrpo fgrpo-paper fedavg \
        --seeds 0 1 --output_dir outputs/compare
"""

import sys

from trl_federated.reports.compare import main

if __name__ == "__main__":
    sys.exit(main())
