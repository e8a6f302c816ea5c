"""The MPI transport (``"comm_backend": "mpi"``), tested under ``mpiexec -n 2/3/4`` with mpi4py.

pytest spawns ``mpiexec`` (MPICH from PyPI) with a hard timeout (``tests/mpi/harness.py``); each rank logs
its progress, so a failure names the rank, the check and the traceback, and a hung rank is killed and
named with the check it was stuck in. What runs inside the ranks is in ``tests/mpi/``:

* ``backend_checks.py`` — the launcher mapping, each primitive against mpi4py's pickle allgather,
  bit-identity of MPI and torch (gloo) transports (outputs and residuals over 3 steps, sizes 0, 1, 7,
  1000, 2^20+3, fp32/bf16, three compressors) with a float64 reference, and the error paths (ranks
  disagreeing on size/dtype/length, an MPI error, an MPI world that is not the data-parallel group).
* ``run_logged.py`` around ``launch/train.py`` — the main job launched with plain ``mpiexec``; ``as_nodes.py``
  around it — the same as if ``mpiexec`` had placed 4 ranks on 2 hosts (the node-aware exchange over MPI).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from ds_dragonn.comm.mpi_env import MPIEnvError, detect_mpi_launcher, setup_mpi_env
from tests.mpi.cases import CHECKS, ERROR_CHECKS, WORLD_SIZES
from tests.mpi.harness import REPO, MPIRun, run_mpiexec

BACKEND_TIMEOUT = 150  # s per mpiexec job (a run takes 5-20 s on 2 cores)
TRAIN_TIMEOUT = 200
TRAIN_STEPS = 40


# -- the launcher mapping (pure: fake environments) ----------------------------------------------------
MPICH = {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}
OPENMPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def test_mpi_env_outside_mpi_changes_nothing():
    env = {"PATH": "/bin"}
    assert setup_mpi_env(environ=env) is None and env == {"PATH": "/bin"}


@pytest.mark.parametrize("launcher_env, expect", [
    (MPICH, dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")),
    (dict(MPICH, MPI_LOCALNRANKS="1"),  # two nodes: MASTER_ADDR left to DeepSpeed's discovery
     dict(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1")),
    (OPENMPI, dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1")),
    (dict(OPENMPI, OMPI_COMM_WORLD_LOCAL_SIZE="4"),
     dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")),
], ids=["mpich-local", "mpich-2nodes", "openmpi-2nodes", "openmpi-local"])
def test_mpi_env_maps_launcher_variables(launcher_env, expect):
    env = dict(launcher_env)
    info = setup_mpi_env(environ=env)
    assert {k: v for k, v in env.items() if k not in launcher_env} == expect
    assert (info.rank, info.world_size, info.local_rank) == (int(expect["RANK"]), int(expect["WORLD_SIZE"]), 1)
    assert info.master_addr == expect.get("MASTER_ADDR", "")


def test_mpi_env_keeps_what_a_launcher_already_set():
    env = dict(MPICH, RANK="1", MASTER_ADDR="10.0.0.5", MASTER_PORT="1234", LOCAL_RANK="1")
    info = setup_mpi_env(master_port=999, environ=env)
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["WORLD_SIZE"]) == ("10.0.0.5", "1234", "2")
    assert (info.master_addr, info.master_port) == ("10.0.0.5", 1234)


@pytest.mark.parametrize("var, value", [("RANK", "0"), ("WORLD_SIZE", "4")])
def test_mpi_env_rejects_contradicting_variables(var, value):
    with pytest.raises(MPIEnvError, match=rf"\[rank 1\] {var}={value} is set, but the mpich launcher says"):
        setup_mpi_env(environ=dict(MPICH, **{var: value}))


def test_detect_prefers_nothing_without_rank_and_size():
    assert detect_mpi_launcher({"PMI_RANK": "0"}) is None  # size missing: not a launcher environment


# -- the harness itself: a failing or hung rank is reported, by rank ---------------------------------
@pytest.mark.parametrize("mode", ["ok", "fail", "hang"])
def test_harness_reports_failed_and_hung_ranks(tmp_path, mode):
    run = run_mpiexec(["tests/mpi/harness_probe.py", str(tmp_path), mode, "1"], 3, tmp_path,
                      timeout=3 if mode == "hang" else 30)
    report = run.failure_report()
    if mode == "ok":
        assert report is None and run.returncode == 0
        return
    assert report is not None
    if mode == "fail":
        assert "rank 1 FAILED in 'probe'" in report and "RuntimeError: deliberate failure" in report
    else:
        assert run.timed_out and "rank 1 HUNG in 'probe' (killed after 3 s)" in report
    assert "rank 0" not in report.split("--- output")[0] and "rank 2" not in report.split("--- output")[0]
    with pytest.raises(AssertionError, match=r"failed on ranks \[1\]|no result from ranks \[1\]"):
        run.check_result("probe")


# -- the transport under mpiexec -n 2/3/4 ----------------------------------------------------------------
_RUNS: dict = {}


@pytest.fixture(scope="module")
def backend_runs(tmp_path_factory):
    """``world_size -> MPIRun`` of backend_checks.py, each started once, on first use."""
    def get(world: int) -> MPIRun:
        if world not in _RUNS:
            out = tmp_path_factory.mktemp(f"mpi{world}")
            _RUNS[world] = run_mpiexec(["tests/mpi/backend_checks.py", str(out)], world, out,
                                       timeout=BACKEND_TIMEOUT)
        return _RUNS[world]
    yield get
    _RUNS.clear()


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", CHECKS)
def test_backend(backend_runs, world, check):
    """Each check passed on every rank (bit-identity, references and error paths are asserted in the ranks)."""
    backend_runs(world).check_result(check)


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("check", ["mismatch_numel", "mismatch_dtype"])
def test_mismatch_error_lists_every_rank(backend_runs, world, check):
    results = backend_runs(world).check_result(check)
    for r, res in results.items():
        msg = res["data"]
        assert msg.startswith(f"[rank {r}]"), msg
        assert all(f"rank {q}: " in msg for q in range(world)), msg


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_every_error_check_left_ranks_in_sync(backend_runs, world):
    """After each error every rank ran the next exchange (no rank stayed behind in a collective)."""
    run = backend_runs(world)
    for r in range(world):
        assert set(ERROR_CHECKS) <= set(run.ranks[r].results) and run.ranks[r].done, run.failure_report()


# -- the main job under plain mpiexec ---------------------------------------------------------------------
def _train(tmp: Path, config: dict, name: str) -> tuple:
    cfg_path, summary = tmp / f"{name}.json", tmp / f"{name}_summary.json"
    cfg_path.write_text(json.dumps(config))
    logs = tmp / f"{name}_ranks"
    run = run_mpiexec(["tests/mpi/run_logged.py", str(logs), "launch/train.py", "--deepspeed_config", str(cfg_path),
                       "--steps", str(TRAIN_STEPS), "--log-interval", "20", "--summary", str(summary)],
                      2, logs, timeout=TRAIN_TIMEOUT)
    assert run.failure_report() is None, run.failure_report()
    return run, json.loads(summary.read_text())


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    mpi_cfg = json.loads((REPO / "configs" / "dragonn_mpi.json").read_text())
    torch_cfg = json.loads(json.dumps(mpi_cfg))
    torch_cfg["dragonn"].update(comm_backend="torch", advanced={"cuda_aware": False})
    return {"mpi": _train(tmp, mpi_cfg, "mpi"), "torch": _train(tmp, torch_cfg, "torch")}


def test_config_file_selects_mpi():
    from ds_dragonn.config import DragonnConfig
    cfg = DragonnConfig.from_ds_config(REPO / "configs" / "dragonn_mpi.json")
    assert cfg.enabled and cfg.comm_backend.value == "mpi" and cfg.cuda_aware is False


def test_mpirun_train_stays_on_loopback(trained):
    """train.py's launcher mapping preset the rendezvous from PMI_*: DeepSpeed's discovery (which would
    pick the external interface) did not run, and torch ranks are MPI ranks."""
    run, _ = trained["mpi"]
    for r, res in run.check_result("train.py").items():
        env = res["data"]
        assert env["MASTER_ADDR"] == "127.0.0.1", env
        assert env["RANK"] == env["PMI_RANK"] == str(r) and env["WORLD_SIZE"] == "2", env
        assert env["LOCAL_RANK"] == env["MPI_LOCALRANKID"], env


def test_mpirun_train_compresses_through_mpi_and_learns(trained):
    _, s = trained["mpi"]
    assert s["world_size"] == 2 and s["dragonn_enabled"]
    assert s["compressed_reductions"] == TRAIN_STEPS and s["dense_reductions"] == 0
    assert s["bytes_sent"] < 0.05 * s["dense_bytes_equivalent"]
    assert s["test_accuracy"] > 0.6, s  # 10 classes: chance is 0.1


@pytest.mark.parametrize("key", ["final_loss", "test_accuracy", "bytes_sent", "kept", "target_k"])
def test_mpirun_train_matches_torch_transport_exactly(trained, key):
    """Same seed, same world size: the MPI and torch transports train bit-identical models."""
    assert trained["mpi"][1][key] == trained["torch"][1][key]


def test_non_mpi_launch_with_mpi_backend_fails_clearly(tmp_path):
    """Started without an MPI launcher (each process its own MPI world of 1): a clear error on every rank."""
    from tests.multiproc import run_ranks
    run_ranks("tests.mpi.non_mpi_launch:world_mismatch", 2, tmp_path, timeout=120)
    for r in range(2):
        msg = (tmp_path / f"rank{r}.err").read_text()
        assert msg.startswith(f"[rank {r}]") and "all 1 MPI ranks" in msg and "group has 2 ranks" in msg, msg
        assert "mpirun -np 2" in msg, msg


# -- the node-aware exchange over MPI: 4 ranks as 2 nodes of 2 ---------------------------------------------
def _train_as_nodes(tmp: Path, config: dict, name: str) -> dict:
    cfg_path, summary = tmp / f"{name}.json", tmp / f"{name}_summary.json"
    cfg_path.write_text(json.dumps(config))
    logs = tmp / f"{name}_ranks"
    run = run_mpiexec(["tests/mpi/as_nodes.py", "2", str(logs), "launch/train.py", "--deepspeed_config",
                       str(cfg_path), "--steps", "12", "--log-interval", "12", "--summary", str(summary)],
                      4, logs, timeout=TRAIN_TIMEOUT)
    assert run.failure_report() is None, run.failure_report()
    return json.loads(summary.read_text())


@pytest.mark.timeout(600)
def test_node_aware_exchange_over_mpi_equals_the_torch_transport(tmp_path):
    """mpiexec's layout (MPI_LOCALNRANKS) gives 2 nodes x 2 ranks; the node and cross-node collectives run on
    MPI communicators split from MPI_COMM_WORLD, and train the same model, bit for bit, as gloo groups do."""
    mpi_cfg = json.loads((REPO / "configs" / "dragonn_mpi.json").read_text())
    mpi_cfg["dragonn"].update(hierarchy="node", exchange="partitioned")
    torch_cfg = json.loads(json.dumps(mpi_cfg))
    torch_cfg["dragonn"].update(comm_backend="torch", advanced={"cuda_aware": False})
    mpi, gloo = _train_as_nodes(tmp_path, mpi_cfg, "mpi"), _train_as_nodes(tmp_path, torch_cfg, "torch")
    for s in (mpi, gloo):
        assert s["world_size"] == 4 and s["hierarchy"] == "2 nodes x 2 ranks" and s["ranks_in_sync"], s
        assert s["compressed_reductions"] == 12
    for key in ("final_loss", "test_accuracy", "bytes_sent", "kept"):
        assert mpi[key] == gloo[key], key
