"""The frameworks where DeepSpeed users are: Hugging Face ``Trainer`` (transformers + accelerate), 2 ranks,
ZeRO 0 and 2, activated by ``ds_dragonn.enable()`` and a ``"dragonn"`` block in the DeepSpeed config.

Skipped (with the reason) when transformers/accelerate are not installed (``pip install 'ds_dragonn[hf]'``;
the README's set-up installs them)."""
from __future__ import annotations

import pytest
import torch

from tests.multiproc import run_ranks

pytest.importorskip("transformers", reason="pip install 'ds_dragonn[hf]' (transformers, accelerate)")
pytest.importorskip("accelerate", reason="pip install 'ds_dragonn[hf]' (transformers, accelerate)")

from tests.hf_cases import STEPS  # noqa: E402


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_trainer")
    run_ranks("tests.hf_cases:trainer_runs", 2, out, timeout=600)
    return [torch.load(out / f"trainer_rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("stage", [0, 2])
def test_trainer_compresses_with_one_config_block(trainer, stage):
    for r in range(2):
        got = trainer[r][f"s{stage}_d001"]
        assert got["engine"] == "DeepSpeedEngine" and got["compressed"] >= STEPS, got["compressed"]
        assert trainer[r][f"s{stage}_dense"]["compressed"] is None


@pytest.mark.parametrize("stage", [0, 2])
def test_trainer_density_1_equals_its_dense_run(trainer, stage):
    for r in range(2):
        d1, dense = trainer[r][f"s{stage}_d1"]["params"], trainer[r][f"s{stage}_dense"]["params"]
        assert all(torch.equal(a, b) for a, b in zip(d1, dense))
        d001 = trainer[r][f"s{stage}_d001"]["params"]
        assert not all(torch.equal(a, b) for a, b in zip(d001, dense))  # compression did change the run


def test_trainer_checkpoint_resume_carries_the_residuals(trainer):
    """``save_steps`` writes each rank's state beside DeepSpeed's; ``resume_from_checkpoint`` restores it, and
    the resumed run equals the uninterrupted one bit for bit."""
    for r in range(2):
        got = trainer[r]["resume"]
        assert f"checkpoint-{STEPS // 2}/global_step{STEPS // 2}/dragonn_rank{r}.pt" in got["state_files"]
        assert got["notes"] == [], got["notes"]
        assert all(torch.equal(a, b) for a, b in zip(got["whole"], got["resumed"]))
