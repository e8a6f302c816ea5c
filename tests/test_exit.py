"""User-style scripts exit 0 on every rank, and one rank's checkpoint failure is every rank's failure.

Each script runs in fresh processes under ``tests.multiproc.run_ranks``, which fails on any rank whose exit
code is not 0: an abort at interpreter exit (``terminate called without an active exception``, rc -6) fails
these tests. The scripts end without ``destroy_process_group``, as users' scripts do.
"""
from __future__ import annotations

import pytest

from tests.multiproc import load_rank_files, run_ranks


@pytest.fixture(scope="module")
def exits(tmp_path_factory):
    out = tmp_path_factory.mktemp("exit")
    run_ranks("tests.exit_cases:train_save_exit", 2, out, timeout=400)
    run_ranks("tests.exit_cases:mismatch_exit", 2, out, timeout=400)
    return {"dir": out, "run": load_rank_files(out, "exit", 2), "mismatch": load_rank_files(out, "mismatch", 2)}


def test_a_caught_config_mismatch_then_exit_is_exit_0(exits):
    for r in range(2):
        assert exits["mismatch"][r]["error"].startswith("DragonnConfigMismatchError"), exits["mismatch"][r]


def test_a_save_that_fails_on_one_rank_fails_on_every_rank_and_leaves_nothing(exits):
    for r in range(2):
        got = exits["run"][r]
        assert got["save_fails"].startswith("CheckpointError"), got["save_fails"]
        assert "rank 1:" in got["save_fails"] and "No space left on device" in got["save_fails"]
        assert "dragonn_rank1.pt.tmp" in got["save_fails"] and "rank 0:" not in got["save_fails"]
        assert got["latest_after_failures"] == got["latest_after_good"] == "good"
        assert got["bad_state_exists"] is False  # the empty tag folder was removed
        assert got["good2_files"] == ["dragonn_rank0.pt", "dragonn_rank1.pt"]


def test_a_save_error_names_the_file(exits):
    for r in range(2):
        got = exits["run"][r]["save_fails_dir"]
        assert got.startswith("CheckpointError") and "rank 1:" in got, got
        assert "bad_dir/dragonn_rank1.pt.tmp" in got, got
        # only the directory the test made is left: no rank's state file, none of DeepSpeed's files
        assert exits["run"][r]["bad_dir_files"] == ["dragonn_rank1.pt.tmp"]


def test_a_final_file_name_taken_on_one_rank_fails_the_save_on_every_rank(exits):
    for r in range(2):
        got = exits["run"][r]["save_fails_final"]
        assert got is not None and got.startswith("CheckpointError") and "rank 1:" in got, got
        assert "bad_final/dragonn_rank1.pt exists and is not a file" in got, got
        assert exits["run"][r]["latest_after_final"] == "good2"


def test_one_rank_missing_its_state_file_fails_the_load_on_every_rank(exits):
    """A checkpoint of this world size whose rank-1 file is gone is incomplete: not the documented reset of a
    plain DeepSpeed checkpoint (no rank has a file) or of one saved by another world size."""
    for r in range(2):
        got = exits["run"][r]["load_incomplete"]
        assert got is not None and got.startswith("CheckpointError") and "rank 1:" in got, got
        assert "good2/dragonn_rank1.pt is missing" in got and "rank 0:" not in got, got


def test_a_load_that_fails_on_one_rank_fails_on_every_rank(exits):
    for r in range(2):
        got = exits["run"][r]["load_fails"]
        assert got is not None and got.startswith("CheckpointError"), got
        assert "rank 1:" in got and "good/dragonn_rank1.pt" in got and "rank 0:" not in got, got


def test_teardown_is_registered_once_and_never_raises(monkeypatch):
    """The exit handler (ds_dragonn/engine/teardown.py) without a process group: no error, no wait."""
    import atexit

    from ds_dragonn.engine import teardown
    calls = []
    monkeypatch.setattr(teardown, "_registered", False)
    monkeypatch.setattr(atexit, "register", lambda fn: calls.append(fn))
    teardown.register()
    teardown.register()
    assert calls == [teardown.teardown]
    teardown.teardown()  # no process group in this process: nothing to destroy
    assert teardown.settle_workers(0.0) is True  # no gloo worker threads here


def test_worker_states_reads_the_scheduler_state(monkeypatch):
    """Thread names and states come from /proc/self/task; a name with spaces or parentheses is parsed."""
    import builtins
    import io

    from ds_dragonn.engine import teardown
    files = {"/proc/self/task/1/comm": "pt_gloo_runloop\n", "/proc/self/task/1/stat": "1 (pt_gloo_runloop) R 0 0",
             "/proc/self/task/2/comm": "python\n", "/proc/self/task/3/comm": "pt_gloo_runloop\n",
             "/proc/self/task/3/stat": "3 (a (b) c) S 0 0"}
    monkeypatch.setattr(teardown.os, "listdir", lambda path: ["1", "2", "3"])
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: io.StringIO(files[path]))
    assert teardown.worker_states() == ["R", "S"]
