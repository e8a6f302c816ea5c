"""Suite-wide fixtures."""
from __future__ import annotations

from pathlib import Path

import pytest

SHM = Path("/dev/shm")
#: DeepSpeed's CPU shared-memory allreduce (ops/csrc/cpu/comm/shm.cpp) creates one 69 MB file per rank
#: and rendezvous port, named like this, and never unlinks it. The suite launches ~20 jobs on fresh
#: ports, so without this cleanup every run would leave ~1.4 GB of RAM-backed files behind and repeated
#: runs fill /dev/shm until a later compile is killed for memory.
DEEPSPEED_SHM_GLOB = "deepspeed_allreduce_buffer_*"


@pytest.fixture(scope="session", autouse=True)
def remove_deepspeed_shm_files():
    """Remove the DeepSpeed shared-memory files that this session's jobs created (all have exited)."""
    before = set(SHM.glob(DEEPSPEED_SHM_GLOB)) if SHM.is_dir() else set()
    yield
    if not SHM.is_dir():
        return
    for path in set(SHM.glob(DEEPSPEED_SHM_GLOB)) - before:
        try:
            path.unlink()
        except OSError:  # another process removed it, or it is not ours to remove
            pass
