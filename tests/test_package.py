"""The package installs like one: a wheel built from the repository carries everything the package needs
(the C++ kernel's source included), and the installed copy works away from the repository."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests.multiproc import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                           str(out), str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = out.glob("ds_dragonn-*.whl")
    return path


def test_the_wheel_carries_the_kernel_source_and_the_extras(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "ds_dragonn/compress/kernels/cpu_table.cpp" in names
    assert "ds_dragonn/__main__.py" in names and "ds_dragonn/engine/teardown.py" in names
    for extra in ("mpi", "test", "hf", "lightning"):
        assert f"Provides-Extra: {extra}" in meta, extra


def test_the_installed_wheel_works_outside_the_repository(wheel, tmp_path):
    """Installed (without dependencies: they are this environment's) into a folder of its own, imported from a
    working directory outside the repository: the environment report runs and the kernel builds from the
    installed source."""
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                           str(wheel)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), TORCH_EXTENSIONS_DIR=str(tmp_path / "ext"), DS_ACCELERATOR="cpu")
    code = ("import ds_dragonn, sys; from ds_dragonn.compress.kernels import cpu_table; "
            "assert ds_dragonn.__file__.startswith(sys.argv[1]), ds_dragonn.__file__; "
            "print('kernel', cpu_table.available())")
    proc = subprocess.run([sys.executable, "-c", code, str(target)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "kernel True" in proc.stdout, proc.stdout + proc.stderr
    proc = subprocess.run([sys.executable, "-m", "ds_dragonn"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "ds_dragonn" in proc.stdout and "unavailable" not in proc.stdout.split(
        "cpu kernel")[1].splitlines()[0], proc.stdout + proc.stderr
