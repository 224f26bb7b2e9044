from pathlib import Path

from setuptools import find_packages, setup

# torch is a plain dependency on purpose: install the torch build you want first (the Makefile's `TORCH` and
# `TORCH_INDEX`; `docs/getting-started.md`, "Installing"), and pip then keeps it; left to pip, a fresh install on
# Linux takes PyPI's default build, with CUDA (several GB).
INSTALL_REQUIRES = [
    "torch>=2.6,<3",
    "trl==1.16.0",
    # 5.40 removes the `past_key_values` keyword (5.24 deprecates it; `shared_prefix.cache_keyword` follows the rename);
    # releases from 5.40 on are untested
    "transformers>=5.23,<5.40",
    "peft>=0.21,<0.22",
    "accelerate>=1.15,<2",
    "datasets>=4.8,<5",
    "safetensors>=0.6,<1",
    "gguf>=0.17,<1",  # reads the embedded SmolLM2 GGUF file
    "reasoning-gym==0.1.25",
    "math-verify>=0.9,<0.10",
    "flwr-datasets>=0.6,<0.7",
    "matplotlib>=3.8,<4",
    "tqdm>=4.66,<5",
    "pyyaml>=6,<7",
]

# MkDocs and mkdocstrings build docs/ (mkdocs.yml): `pip install -e ".[docs]"`, then `mkdocs serve`
DOCS = ["mkdocs>=1.6.1,<2", "mkdocstrings[python]>=1.0,<2"]
# Google's accountant, which differential privacy (`dp_noise_multiplier`) composes its rounds with; Flower's `dp`
# extra pins the same range
DP = ["dp-accounting>=0.6,<0.7"]

EXTRAS = {
    # ruff is the linter tests/test_lint.py runs; nbmake runs examples/notebooks; hypothesis drives the answer checker's
    # property tests; tensorboard reads back what a federated run reports through `report_to`; scipy is the statistics
    # (t and binomial distributions) of benchmarks/verdict.py and benchmarks/gate.py, and of their tests; the docs
    # extra, because tests/test_docs.py builds the site strictly (pure Python, about 15 s); the dp extra, whose
    # accountant tests/test_privacy.py checks
    "test": [
        "pytest>=8", "pytest-timeout>=2.3", "ruff>=0.15", "hypothesis>=6.100", "nbmake>=1.5", "ipykernel>=6",
        "tensorboard>=2.16", "scipy>=1.11", *DOCS, *DP,
    ],
    "dp": DP,
    "deepspeed": ["deepspeed>=0.18.6,<0.20"],
    "docs": DOCS,
    # TRL's own vLLM extra (vllm>=0.22,<=0.31, requests, aiohttp), for `use_vllm` with `vllm_mode: server`: the GPU
    # machine that runs `trl vllm-serve`, and every training process (TRL's VLLMClient imports vLLM). Of TRL's range
    # only 0.30 resolves with transformers>=5.23 (0.31 caps it below 5.18); tests/test_docs.py resolves it (slow)
    "vllm": ["trl[vllm]==1.16.0", "vllm>=0.30,<0.31"],
    "flower": ["flwr[simulation]>=1.41,<2"],
    "vlm": ["Pillow>=10", "num2words==0.5.14"],
    "notebooks": ["nbmake>=1.5", "ipykernel>=6"],
}
# Everything but vLLM, a GPU-only install of several hundred MB
EXTRAS["dev"] = sorted({req for name, reqs in EXTRAS.items() if name != "vllm" for req in reqs})

setup(
    name="trl-federated",
    version="0.1.0",
    description="Federated GRPO-family RL fine-tuning (FGRPO, FedAvg, FedProx, SCAFFOLD) on top of Hugging Face TRL",
    long_description=Path(__file__).with_name("README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.11",
    packages=find_packages(include=["trl_federated", "trl_federated.*"]),
    # The run parser as recorded for the installed TRL (`arguments.flags.recorded_parser`): `--help` and a bad value
    # answered before TRL imports
    package_data={
        "trl_federated.arguments": ["known_parsers.json"],
        # the example configs by name (`trl-federated run --config quickstart`) and the example Flower app's
        # pyproject.toml (`trl-federated new-app DIR`), copies of examples/
        "trl_federated": ["examples/configs/*.yaml", "examples/configs/paper/*.yaml", "examples/accelerate/*.yaml",
                          "examples/flower/pyproject.toml"],
    },
    install_requires=INSTALL_REQUIRES,
    extras_require=EXTRAS,
    entry_points={"console_scripts": ["trl-federated=trl_federated.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
