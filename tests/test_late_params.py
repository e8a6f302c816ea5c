"""Parameters that first get gradient after the dense warm-up, in the momentum mode (issue 34): they must not
take steps of hundreds of learning rates. Two ranks train the same model dense and with DRAGONN; the late
tensors' largest element step per optimizer step, in learning rates, is compared with dense AdamW's."""
from __future__ import annotations

import pytest
import torch

from tests.late_cases import LATE_AT
from tests.multiproc import ranks_fixture

REFRESH_AT = 110  # the default variance_refresh_steps (100) after the 10-step dense warm-up


late_runs = ranks_fixture("tests.late_cases:cases", "late", timeout=600, pool="zero")


def _dense_max(runs, name):
    return max(runs[0][name]["moves"][LATE_AT:])


@pytest.mark.parametrize("scale", ["x1", "x1000"])
def test_without_refresh_a_late_tensor_moves_as_adam_does(late_runs, scale):
    """No variance refresh: the late tensor keeps Adam's own update (no frozen variance to divide by), within
    2x dense AdamW's largest step, every step. Before the fix: 883-58680 learning rates."""
    dense = _dense_max(late_runs, f"side_{scale}_dense")
    moves = late_runs[0][f"side_{scale}_norefresh"]["moves"]
    assert max(moves[:LATE_AT]) < 0.01  # no gradient before (the gate is 0): weight decay only
    assert max(moves[LATE_AT:]) <= 2.0 * dense, (max(moves[LATE_AT:]), dense)


@pytest.mark.parametrize("scale", ["x1", "x1000"])
def test_with_refresh_a_late_tensor_is_safe_before_and_after_it_gets_a_variance(late_runs, scale):
    """Until the first refresh: Adam's own update (within 2x dense). After it (the refresh gave the late
    elements a variance from what arrived and the dense gradient): no larger than the largest step the run's
    other elements take for their delays (x1), and the loss no worse than dense's (x1000, where the late layer
    takes the whole budget). Before the fix: 79-434 learning rates, and the x1000 loss 3x dense's."""
    run, dense = late_runs[0][f"side_{scale}_refresh"], late_runs[0][f"side_{scale}_dense"]
    before, after = run["moves"][LATE_AT:REFRESH_AT], run["moves"][REFRESH_AT:]
    assert max(before) <= 2.0 * _dense_max(late_runs, f"side_{scale}_dense")
    assert all(torch.isfinite(torch.tensor(run["losses"])))
    if scale == "x1":
        assert max(after) <= max(2.0 * max(dense["moves"]), max(run["others"][LATE_AT:]))
    else:
        assert run["losses"][-1] <= dense["losses"][-1]


@pytest.mark.parametrize("name", ["embed_s0", "embed_s2", "embed_s3"])
def test_embedding_rows_first_looked_up_after_the_warm_up(late_runs, name):
    """Rows 256-511 of an embedding first appear after the warm-up (their variance at the freeze is 0): at
    ZeRO 0, 2 and 3 they move within 2x dense AdamW's largest step, and the ranks stay in sync. Before the fix:
    ~10 000 learning rates."""
    dense_rows = max(late_runs[0]["embed_dense"]["late_rows"])
    rows = late_runs[0][name]["late_rows"]
    assert max(rows) > 0.0  # they trained
    assert max(rows) <= 2.0 * dense_rows, (max(rows), dense_rows)
    assert late_runs[0][name]["losses"] == late_runs[1][name]["losses"]
