"""``python -m ds_dragonn``: the environment report (what a bug report should include).

Prints the versions of Python, torch, DeepSpeed and ds_dragonn, the accelerator DeepSpeed detects, the CPU
selection kernel's build (OpenMP or std::thread, its ISA) or why it is unavailable, Triton and CUDA, mpi4py
and its MPI library, and the frameworks ``ds_dragonn.enable()`` serves. Exit status 0 always: it reports.
"""
from __future__ import annotations

import platform
import sys


def _try(what):
    try:
        return what()
    except Exception as err:  # noqa: BLE001 - a report, not a check
        return f"unavailable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"


def _version(module: str) -> str:
    import importlib
    return _try(lambda: getattr(importlib.import_module(module), "__version__", "installed"))


def report() -> list:
    """(name, value) rows of the environment report."""
    import torch

    import ds_dragonn
    from ds_dragonn.compress.kernels import cpu_table

    def kernel() -> str:
        if not cpu_table.available():
            return f"unavailable ({cpu_table._error})"
        return f"{cpu_table.THREADING}, ISA {cpu_table.isa_in_use()}, {cpu_table.LOADED_PATH}"

    def mpi() -> str:
        from mpi4py import MPI
        import mpi4py
        return f"mpi4py {mpi4py.__version__}, {MPI.Get_library_version().splitlines()[0].strip()}"

    def accelerator() -> str:
        from deepspeed.accelerator import get_accelerator
        acc = get_accelerator()
        return f"{acc.device_name()} (communication backend {acc.communication_backend_name()})"

    return [("python", f"{platform.python_version()} ({sys.executable})"),
            ("ds_dragonn", ds_dragonn.__version__),
            ("torch", f"{torch.__version__} (CUDA {torch.version.cuda}, available: {torch.cuda.is_available()})"),
            ("deepspeed", _version("deepspeed")),
            ("accelerator", _try(accelerator)),
            ("cpu kernel", _try(kernel)),
            ("triton", _version("triton")),
            ("mpi", _try(mpi)),
            ("transformers", _version("transformers")),
            ("accelerate", _version("accelerate")),
            ("lightning", _version("lightning"))]


def main() -> int:
    for name, value in report():
        print(f"{name:<13} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
