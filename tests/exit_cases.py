"""User-style multi-rank scripts, run by tests/test_exit.py: no ``destroy_process_group`` at the end, errors
caught and the function returned, as a user's training script does. ``run_ranks`` fails on any rank whose
exit code is not 0 (an abort at exit included)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.ckpt_cases import K, RESUME_RUNS, _engine, _train
from tests.engines import engine_config


def _caught(fn) -> str | None:
    """``str`` of the error ``fn()`` raised (None if it returned); its type name first."""
    try:
        fn()
        return None
    except Exception as err:  # noqa: BLE001 - the test reads the type and message
        return f"{type(err).__name__}: {err}"


def train_save_exit(rank: int, world: int, out_dir: str) -> None:
    """initialize, train, save_checkpoint; then saves and a load that fail on rank 1 only; then return.

    Every rank must raise the same collective error for each failure, ``latest`` must keep naming the good
    tag, and no failed tag may be left with files in it."""
    ckpt = Path(out_dir) / "ckpt"
    engine = _engine(RESUME_RUNS["s0_fp32"])
    _train(engine, rank, 0, K)
    engine.save_checkpoint(str(ckpt), tag="good")
    out = {"latest_after_good": (ckpt / "latest").read_text()}

    # rank 1 cannot write its state (disk full, say): nothing of tag "bad_state" may remain
    hook, real = engine.dragonn, engine.dragonn.state_dict

    def disk_full():
        raise OSError(28, "No space left on device")
    if rank == 1:
        hook.state_dict = disk_full
    out["save_fails"] = _caught(lambda: engine.save_checkpoint(str(ckpt), tag="bad_state"))
    hook.state_dict = real
    # rank 1's temporary file name is taken by a directory: the error names that file
    if rank == 1:
        (ckpt / "bad_dir" / "dragonn_rank1.pt.tmp").mkdir(parents=True)
    out["save_fails_dir"] = _caught(lambda: engine.save_checkpoint(str(ckpt), tag="bad_dir"))
    out["latest_after_failures"] = (ckpt / "latest").read_text()
    out["bad_state_exists"] = (ckpt / "bad_state").exists()
    out["bad_dir_files"] = sorted(p.name for p in (ckpt / "bad_dir").iterdir())

    # the state files are renamed only after every rank wrote its own: a good save still works afterwards
    _train(engine, rank, K, K + 1)
    engine.save_checkpoint(str(ckpt), tag="good2")
    out["good2_files"] = sorted(p.name for p in (ckpt / "good2").iterdir() if p.name.startswith("dragonn"))

    # rank 1's final file name is taken by a directory (the rename would fail there only): refused before
    # anything is renamed, on every rank
    if rank == 1:
        (ckpt / "bad_final" / "dragonn_rank1.pt").mkdir(parents=True)
    torch.distributed.barrier()
    out["save_fails_final"] = _caught(lambda: engine.save_checkpoint(str(ckpt), tag="bad_final"))
    out["latest_after_final"] = (ckpt / "latest").read_text()
    # rank 1's state file of "good2" is gone while rank 0's is there: an incomplete checkpoint fails everywhere
    torch.distributed.barrier()
    if rank == 1:
        (ckpt / "good2" / "dragonn_rank1.pt").unlink()
    torch.distributed.barrier()
    out["load_incomplete"] = _caught(lambda: _engine(RESUME_RUNS["s0_fp32"]).load_checkpoint(str(ckpt), tag="good2"))

    # rank 1's state file of "good" is truncated: the load fails on every rank, naming rank 1's file
    torch.distributed.barrier()
    if rank == 1:
        path = ckpt / "good" / "dragonn_rank1.pt"
        path.write_bytes(path.read_bytes()[:100])
    torch.distributed.barrier()
    out["load_fails"] = _caught(lambda: _engine(RESUME_RUNS["s0_fp32"]).load_checkpoint(str(ckpt), tag="good"))
    torch.save(out, Path(out_dir) / f"exit_rank{rank}.pt")
    # no destroy_process_group(): a user's script that ends here must still exit 0


def mismatch_exit(rank: int, world: int, out_dir: str) -> None:
    """The ranks' "dragonn" blocks differ: initialize raises on every rank, the script catches it and ends."""
    import ds_dragonn
    cfg = engine_config({"enabled": True, "density": 0.01 if rank == 0 else 0.02, "min_compress_numel": 1})
    model = torch.nn.Linear(8, 4)
    got = _caught(lambda: ds_dragonn.initialize(model=model, model_parameters=model.parameters(), config=cfg))
    torch.save({"error": got}, Path(out_dir) / f"mismatch_rank{rank}.pt")
