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


def shm_port(path: Path):
    """The rendezvous port in ``deepspeed_allreduce_buffer_<...>_<addr>_<port>_<rank>`` (None if absent)."""
    parts = path.name.split("_")
    return int(parts[-2]) if len(parts) >= 3 and parts[-2].isdigit() else None


@pytest.fixture(scope="session", autouse=True)
def remove_deepspeed_shm_files():
    """Remove the DeepSpeed shared-memory files of the ports this session's jobs used (all have exited);
    files of other jobs on the machine, even ones created meanwhile, are left alone."""
    from tests.multiproc import USED_PORTS
    before = set(SHM.glob(DEEPSPEED_SHM_GLOB)) if SHM.is_dir() else set()
    yield
    if not SHM.is_dir():
        return
    for path in set(SHM.glob(DEEPSPEED_SHM_GLOB)) - before:
        if shm_port(path) in USED_PORTS:
            try:
                path.unlink()
            except OSError:  # another process removed it meanwhile
                pass
