"""The "dragonn" block: pydantic validation with messages naming the key, the value and what is allowed."""
from __future__ import annotations

import json
import re

import pytest

import ds_dragonn
from ds_dragonn.config import ADVANCED_KEYS, CommBackendName, DragonnConfig, DragonnConfigError, Kernel


def test_defaults_when_absent():
    cfg = DragonnConfig.from_ds_config({"train_batch_size": 8})
    assert not cfg.enabled and cfg.density == 0.01 and cfg.error_feedback
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
    ({"warmup_steps": -1}, ["dragonn.warmup_steps", "-1"]),
    ({"comm_backend": "nccl"}, ["dragonn.comm_backend", "nccl", "torch", "mpi"]),
    ({"exchange": "ring"}, ["dragonn.exchange", "ring", "allgather"]),
    ({"enabled": "maybe"}, ["dragonn.enabled", "maybe"]),
    ({"advanced": {"cuda_aware": True}}, ["advanced.cuda_aware", "mpi"]),
    ({"advanced": {"kernel": "gpu"}}, ["dragonn.advanced.kernel", "gpu", "triton"]),
    ({"advanced": {"kernal": "cpu"}}, ["dragonn.advanced.kernal", "did you mean 'kernel'?", "cuda_aware"]),
    ({"advanced": {"variance_refresh_steps": 1}}, ["dragonn.advanced.variance_refresh_steps", "at least 2"]),
    ({"advanced": {"compressor": "topk"}}, ["dragonn.advanced.compressor", "unknown key"]),  # baselines: launch/
    ({"advanced": {"exact_skipped_steps": "yes"}}, ["dragonn.advanced.exact_skipped_steps", "yes"]),
    ({"advanced": {"exact_skipped_steps": 1}}, ["dragonn.advanced.exact_skipped_steps", "1"]),
    # no lax coercion: these would otherwise silently become density 1.0, enabled, 0.5, ...
    ({"density": True}, ["dragonn.density", "True", "number"]),
    ({"density": "0.5"}, ["dragonn.density", "0.5"]),
    ({"enabled": "yes"}, ["dragonn.enabled", "yes", "boolean"]),
    ({"enabled": 1}, ["dragonn.enabled", "1", "boolean"]),
    ({"advanced": {"error_feedback": 0}}, ["dragonn.advanced.error_feedback", "0", "boolean"]),
    ({"min_compress_numel": 2.5}, ["dragonn.min_compress_numel", "2.5"]),
    ({"outer_lr": float("inf"), "sync": "local_steps"}, ["dragonn.outer_lr", "inf", "finite"]),
    ({"density": float("nan")}, ["dragonn.density", "nan"]),
    ({"comm_timeout_s": 0}, ["dragonn.comm_timeout_s", "0", "greater than or equal to 1"]),
    ({"comm_timeout_s": 0.001}, ["dragonn.comm_timeout_s", "0.001", "greater than or equal to 1"]),
    ({"comm_timeout_s": "10"}, ["dragonn.comm_timeout_s", "10", "number"]),
    ({"comm_timeout_s": True}, ["dragonn.comm_timeout_s", "True"]),
])
def test_bad_blocks_name_key_value_and_allowed(block, needles):
    with pytest.raises(DragonnConfigError) as err:
        DragonnConfig.from_ds_config({"dragonn": block})
    for needle in needles:
        assert needle in str(err.value), str(err.value)


def test_visible_keys_and_advanced():
    """The block a user reads: fifteen keys and one "advanced" object (docs/config.md states the count)."""
    assert len(DragonnConfig.model_fields) == 16 and "advanced" in DragonnConfig.model_fields
    assert set(ADVANCED_KEYS) == {"kernel", "error_feedback", "density_warmup_start",
                                  "variance_refresh_steps", "cuda_aware", "ranks_per_node", "values", "selection",
                                  "dense_values", "max_age", "exact_skipped_steps"}
    cfg = DragonnConfig.from_ds_config({"dragonn": {"enabled": True, "advanced": {"kernel": "cpu",
                                                                                   "error_feedback": False}}})
    assert cfg.kernel == Kernel.cpu and cfg.error_feedback is False and cfg.advanced.kernel == Kernel.cpu
    assert cfg.given("density", "kernel", "error_feedback") == ["advanced.kernel", "advanced.error_feedback"]
    with pytest.raises(AttributeError):
        cfg.kernel = Kernel.reference  # read-only: set it under "advanced"
    dump = cfg.model_dump(mode="json")  # a checkpoint's description keeps the flat names
    assert dump["kernel"] == "cpu" and dump["error_feedback"] is False and dump["advanced"]["kernel"] == "cpu"
    assert "seed" not in dump and "table_factor" not in dump  # internal constants are not settings


@pytest.mark.parametrize("key", ["seed", "table_factor", "outer_momentum", "outer_feedback_decay", "compress_1d",
                                 "tensor_min_compress_numel", "lr_weighted_residual",
                                 "strict", "self"])  # (the names of the model's own __init__ arguments)
def test_keys_the_block_does_not_have_are_refused_by_name(key):
    """Internal constants and keys of earlier drafts are unknown keys: the message names the key and its place."""
    with pytest.raises(DragonnConfigError, match=f"'dragonn.{key}': unknown key"):
        DragonnConfig.from_ds_config({"dragonn": {"enabled": True, key: 1}})
    with pytest.raises(DragonnConfigError, match=f"'dragonn.advanced.{key}': unknown key"):
        DragonnConfig.from_ds_config({"dragonn": {"advanced": {key: 1}}})


@pytest.mark.parametrize("key", ["kernel", "error_feedback", "cuda_aware", "density_warmup_start",
                                 "variance_refresh_steps"])
def test_advanced_keys_at_the_top_level_say_where_they_moved(key):
    with pytest.raises(DragonnConfigError, match=f"'dragonn.{key}' belongs under 'advanced'"):
        DragonnConfig.from_ds_config({"dragonn": {key: 1}})


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


@pytest.mark.parametrize("zero, key", [({"stage": 3, "offload_param": {"device": "cpu"}}, "offload_param"),
                                       ({"stage": "3", "offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
                                       ({"stage": 3, "zero_quantized_gradients": True}, "zero_quantized_gradients"),
                                       ({"stage": 3, "reduce_scatter": False}, "reduce_scatter"),
                                       ({"stage": 2, "reduce_scatter": False}, "reduce_scatter"),
                                       ({"stage": 1, "contiguous_gradients": False}, "contiguous_gradients"),
                                       ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
                                       ({"stage": 2, "offload_param": {"device": "nvme"}}, "offload_param")])
def test_initialize_refuses_unsupported_zero_settings_before_deepspeed_starts(zero, key):
    cfg = {"train_batch_size": 1, "zero_optimization": zero, "dragonn": {"enabled": True}}
    with pytest.raises(ds_dragonn.DragonnUnsupportedError, match=f"'zero_optimization.{key}'"):
        ds_dragonn.initialize(model=None, config=cfg)


@pytest.mark.parametrize("zero", [{"stage": 1}, {"stage": 2}, {"stage": "1"}, True, {"stage": 3},
                                  {"stage": 3, "zero_hpz_partition_size": 2},
                                  {"stage": 2, "offload_optimizer": {"device": "none"}}])
def test_initialize_accepts_zero_stages_1_to_3(zero):
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


@pytest.mark.parametrize("block, piece", [
    ({1: 2}, "'dragonn' keys are strings; got the key 1"),
    ({"enabled": True, "advanced": {"density": 0.1}}, "'dragonn.advanced.density' is a top-level key"),
    ({"enabled": True, "advanced": {3: 1}}, "'dragonn.advanced' keys are strings"),
])
def test_misplaced_and_non_string_keys_are_named(block, piece):
    with pytest.raises(DragonnConfigError, match=re.escape(piece)):
        DragonnConfig.from_ds_config({"dragonn": block})


def test_a_near_miss_block_name_warns_that_compression_is_off(caplog):
    import logging
    from deepspeed.utils import logger
    logger.propagate, before = True, logger.propagate
    try:
        with caplog.at_level(logging.WARNING):
            assert not DragonnConfig.from_ds_config({"Dragonn": {"enabled": True}}).enabled
    finally:
        logger.propagate = before
    assert "'Dragonn' but no 'dragonn'" in caplog.text
