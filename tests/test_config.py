"""The "dragonn" block: pydantic validation with messages naming the key, the value and what is allowed."""
from __future__ import annotations

import json

import pytest

import ds_dragonn
from ds_dragonn.config import CommBackendName, DragonnConfig, DragonnConfigError


def test_defaults_when_absent():
    cfg = DragonnConfig.from_ds_config({"train_batch_size": 8})
    assert not cfg.enabled and cfg.density == 0.01 and cfg.table_factor == 4 and cfg.error_feedback
    assert cfg.comm_backend == CommBackendName.torch and cfg.exchange.value == "allgather"


def test_reads_json_path(tmp_path):
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"dragonn": {"enabled": True, "density": 0.05, "comm_backend": "torch"}}))
    cfg = DragonnConfig.from_ds_config(str(p))
    assert cfg.enabled and cfg.density == 0.05


@pytest.mark.parametrize("block, needles", [
    ({"densty": 0.1}, ["dragonn.densty", "unknown key", "did you mean 'density'?"]),
    ({"density": 0}, ["dragonn.density", "0", "greater than 0"]),
    ({"density": 1.5}, ["dragonn.density", "1.5", "less than or equal to 1"]),
    ({"density": "lots"}, ["dragonn.density", "lots"]),
    ({"table_factor": 0.5}, ["dragonn.table_factor", "0.5"]),
    ({"warmup_steps": -1}, ["dragonn.warmup_steps", "-1"]),
    ({"comm_backend": "nccl"}, ["dragonn.comm_backend", "nccl", "torch", "mpi"]),
    ({"exchange": "ring"}, ["dragonn.exchange", "ring", "allgather"]),
    ({"enabled": "maybe"}, ["dragonn.enabled", "maybe"]),
    ({"cuda_aware": True}, ["cuda_aware", "mpi"]),
    # no lax coercion: these would otherwise silently become density 1.0, enabled, 0.5, ...
    ({"density": True}, ["dragonn.density", "True", "number"]),
    ({"density": "0.5"}, ["dragonn.density", "0.5"]),
    ({"enabled": "yes"}, ["dragonn.enabled", "yes", "boolean"]),
    ({"enabled": 1}, ["dragonn.enabled", "1", "boolean"]),
    ({"seed": True}, ["dragonn.seed", "True", "integer"]),
    ({"min_sample": 2.5}, ["dragonn.min_sample", "2.5"]),
    ({"table_factor": float("inf")}, ["dragonn.table_factor", "inf", "finite"]),
    ({"density": float("nan")}, ["dragonn.density", "nan"]),
    ({"table_factor": 1e9}, ["dragonn.table_factor", "1024"]),
    ({"comm_timeout_s": 0}, ["dragonn.comm_timeout_s", "0", "greater than 0"]),
    ({"comm_timeout_s": "10"}, ["dragonn.comm_timeout_s", "10", "number"]),
    ({"comm_timeout_s": True}, ["dragonn.comm_timeout_s", "True"]),
])
def test_bad_blocks_name_key_value_and_allowed(block, needles):
    with pytest.raises(DragonnConfigError) as err:
        DragonnConfig.from_ds_config({"dragonn": block})
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_reads_hjson_and_base64_like_deepspeed(tmp_path):
    import base64
    p = tmp_path / "ds.hjson"
    p.write_text('{"train_batch_size": 8, // a comment\n "dragonn": {"enabled": true, "density": 0.02,},}')
    assert DragonnConfig.from_ds_config(str(p)).density == 0.02
    b64 = base64.urlsafe_b64encode(json.dumps({"dragonn": {"enabled": True, "density": 0.03}}).encode()).decode()
    assert DragonnConfig.from_ds_config(b64).density == 0.03


def test_block_must_be_an_object():
    with pytest.raises(DragonnConfigError, match="JSON object"):
        DragonnConfig.from_ds_config({"dragonn": True})


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(DragonnConfigError, match="not found"):
        DragonnConfig.from_ds_config(str(tmp_path / "nope.json"))


def test_initialize_rejects_bad_block_before_deepspeed_starts():
    with pytest.raises(DragonnConfigError, match="dragonn.densty"):
        ds_dragonn.initialize(model=None, config={"train_batch_size": 1, "dragonn": {"densty": 0.1}})


@pytest.mark.parametrize("zero, key", [({"stage": 3}, "stage"), ({"stage": "3"}, "stage"),
                                       ({"stage": 2, "reduce_scatter": False}, "reduce_scatter"),
                                       ({"stage": 1, "contiguous_gradients": False}, "contiguous_gradients"),
                                       ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
                                       ({"stage": 2, "offload_param": {"device": "nvme"}}, "offload_param")])
def test_initialize_refuses_unsupported_zero_settings_before_deepspeed_starts(zero, key):
    cfg = {"train_batch_size": 1, "zero_optimization": zero, "dragonn": {"enabled": True}}
    with pytest.raises(ds_dragonn.DragonnUnsupportedError, match=f"'zero_optimization.{key}'"):
        ds_dragonn.initialize(model=None, config=cfg)


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 2}, {"stage": "1"}, True,
                                  {"stage": 2, "offload_optimizer": {"device": "none"}}])
def test_initialize_accepts_zero_stages_1_and_2(zero):
    """Accepted: the call gets past ds_dragonn's checks to DeepSpeed (which wants a model)."""
    cfg = {"train_batch_size": 1, "zero_optimization": zero, "dragonn": {"enabled": True}}
    with pytest.raises(AssertionError, match="requires a model"):
        ds_dragonn.initialize(model=None, config=cfg)


def test_initialize_reads_args_deepspeed_config(tmp_path):
    import argparse
    p = tmp_path / "ds.json"
    p.write_text(json.dumps({"train_batch_size": 1, "dragonn": {"enabled": True, "density": 7}}))
    with pytest.raises(DragonnConfigError, match="dragonn.density"):
        ds_dragonn.initialize(args=argparse.Namespace(deepspeed_config=str(p)), model=None)


def test_initialize_refuses_zero1_bf16_with_fp32_accumulation():
    """DeepSpeed runs its BF16_Optimizer there (not the ZeRO optimizer the hook wraps): refused up front."""
    cfg = {"train_batch_size": 1, "zero_optimization": {"stage": 1}, "bf16": {"enabled": True},
           "data_types": {"grad_accum_dtype": "fp32"}, "dragonn": {"enabled": True}}
    with pytest.raises(ds_dragonn.DragonnUnsupportedError, match="BF16_Optimizer.*ZeRO stage 2"):
        ds_dragonn.initialize(model=None, config=cfg)


def test_null_block_is_an_error_not_silently_off():
    from ds_dragonn.config import DragonnConfig, DragonnConfigError
    with pytest.raises(DragonnConfigError, match="'dragonn' is null"):
        DragonnConfig.from_ds_config({"train_batch_size": 1, "dragonn": None})
    assert DragonnConfig.from_ds_config({"train_batch_size": 1}).enabled is False  # absent: off
