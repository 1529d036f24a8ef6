from setuptools import find_packages, setup

setup(
    name="neox_hf",
    version="0.1.0",
    description="GPT-NeoX-class language-model training on the Hugging Face stack",
    packages=find_packages(include=["neox_hf", "neox_hf.*"]),
    package_data={"neox_hf": ["metrics/*/*.py"]},
    python_requires=">=3.10",
    install_requires=[
        # Permissive on purpose: pinning here would pull a CUDA build on CPU machines.
        "torch>=2.4",
        "transformers>=5",
        "accelerate>=1.10",
        "deepspeed>=0.16",
        "datasets>=3",
        "tokenizers",
        "evaluate",
        "peft",
        "huggingface_hub",
        "safetensors",
        "pyyaml",
        "tensorboard",
        "matplotlib",
        "tqdm",
        "zstandard",
    ],
    extras_require={
        # The optional integrations are installed for the tests so they run rather than skip.
        "test": ["pytest", "pytest-timeout", "pytest-xdist", "lm-eval>=0.4.5", "wandb",
                 # tests/test_objectives.py compares DPO and the reward model with TRL's trainers (1.16 tokenises and
                 # computes the losses as tested; 1.x keeps transformers 5 / accelerate 1.x)
                 "trl>=1.16,<2",
                 # tests/test_optimizers.py: train.optimizer lion, sm3
                 "lion-pytorch>=0.2", "pytorch-optimizer>=3",
                 # the layering contract (.importlinter) and the docs site (mkdocs.yml), both checked by the fast tier
                 "import-linter>=2.16", "mkdocs>=1.6", "mkdocs-material>=9"],
        "docs": ["mkdocs>=1.6", "mkdocs-material>=9"],
        # train.loss_kernel auto: the head loss through Liger's or Cut Cross-Entropy's Triton kernels on CUDA
        "gpu": ["liger-kernel>=0.8", "cut-cross-entropy"],  # `mkdocs serve` / `mkdocs build` of docs/
        "eval": ["lm-eval>=0.4.5"],  # train.eval_tasks: lm-evaluation-harness during training
        # train.optimizer: lion, sm3 (GPT-NeoX optimizer.type Lion, SM3)
        "optimizers": ["lion-pytorch>=0.2", "pytorch-optimizer>=3"],
        "trackers": ["wandb"],  # output.report_to: [wandb]; comet_ml, mlflow, aim install the same way
    },
    entry_points={"console_scripts": ["neox_hf=neox_hf.cli:main"]},
)
