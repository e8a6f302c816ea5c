"""The frameworks where DeepSpeed users are: Hugging Face ``Trainer`` (transformers + accelerate) and an
Accelerate loop, 2 ranks, ZeRO 0 and 2, activated by ``ds_dragonn.enable()`` and a ``"dragonn"`` block in the
DeepSpeed config. Lightning's ``DeepSpeedStrategy`` refuses CPU machines itself (the last test pins its message).

Skipped (with the reason) when transformers/accelerate are not installed (``pip install 'ds_dragonn[hf]'``;
the README's set-up installs them)."""
from __future__ import annotations

import pytest
import torch

from tests.multiproc import ranks_fixture

pytest.importorskip("transformers", reason="pip install 'ds_dragonn[hf]' (transformers, accelerate)")
pytest.importorskip("accelerate", reason="pip install 'ds_dragonn[hf]' (transformers, accelerate)")

from tests.hf_cases import STEPS  # noqa: E402


trainer = ranks_fixture("tests.hf_cases:trainer_runs", "trainer", timeout=600)


@pytest.mark.parametrize("stage", [0, 2])
def test_trainer_compresses_with_one_config_block(trainer, stage):
    for r in range(2):
        got = trainer[r][f"s{stage}_d001"]
        assert got["engine"] == "DeepSpeedEngine" and got["compressed"] >= STEPS, got["compressed"]
        assert trainer[r][f"s{stage}_dense"]["compressed"] is None


def test_trainer_auto_warm_up_reads_its_learning_rate_schedule(trainer):
    """TrainingArguments(warmup_steps=20) with Trainer's own optimizer and schedule (not handed to DeepSpeed):
    the default dense warm-up follows the learning rate and ends at twice that, then compresses."""
    assert [trainer[r]["auto_warmup"] for r in range(2)] == [(40, True), (40, True)]


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


accelerate_loop = ranks_fixture("tests.hf_cases:accelerate_runs", "accelerate", timeout=600,
                                env={"ACCELERATE_USE_DEEPSPEED": "true"})


@pytest.mark.parametrize("stage", [0, 2])
def test_accelerate_compresses_and_density_1_equals_dense(accelerate_loop, stage):
    for r in range(2):
        got = accelerate_loop[r]
        assert got[f"s{stage}_d001"]["engine"] == "DeepSpeedEngine" and got[f"s{stage}_d001"]["compressed"] >= STEPS
        assert got[f"s{stage}_dense"]["compressed"] is None and got[f"s{stage}_d001"]["deepspeed_world"] == 2
        assert all(torch.equal(a, b) for a, b in zip(got[f"s{stage}_d1"]["params"], got[f"s{stage}_dense"]["params"]))
        # accelerate 1.x on a CPU machine counts each DeepSpeed rank as a world of 1 (its data loader is not
        # sharded); the gradient reduction still spans both ranks. The README says so.
        assert got[f"s{stage}_d001"]["accelerate_processes"] in (1, 2)


def test_lightning_deepspeed_strategy_needs_cuda():
    """Lightning 2.x's ``DeepSpeedStrategy`` raises on a CPU accelerator before it calls ``deepspeed.initialize``,
    so it cannot be exercised on this CPU machine; with a GPU, ``ds_dragonn.enable()`` applies to it as to the
    others (it calls ``deepspeed.initialize``). This pins the refusal the README quotes."""
    L = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DeepSpeedStrategy
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: Lightning's DeepSpeedStrategy runs there")

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def training_step(self, batch, _):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)), batch_size=4)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False,
                        strategy=DeepSpeedStrategy(config={"train_micro_batch_size_per_gpu": 4,
                                                           "dragonn": {"enabled": True}}))
    with pytest.raises(RuntimeError, match="only supported on CUDA GPUs"):
        trainer.fit(Tiny(), data)
