"""ds_dragonn.plan: every row of the table of refused combinations is refused with its own message, every class
of supported combination resolves to a plan, and the DeepSpeed hook points are checked by signature (no
processes: the engine is described by ``plan.Facts``)."""
from __future__ import annotations

import dataclasses

import pytest

from ds_dragonn.config import AdvancedConfig, DragonnConfig, DragonnConfigError
from ds_dragonn.plan import RULES, DragonnUnsupportedError, Facts, Plan, check, refusal, resolve


def _cfg(block: dict) -> DragonnConfig:
    """The block as a config object without its cross-field validation (a "config" row refuses it there)."""
    fields = dict(block)
    fields["advanced"] = AdvancedConfig(**fields.pop("advanced", {}))
    for key in ("compress", "sync", "hierarchy", "comm_backend", "exchange"):
        if key in fields:
            fields[key] = DragonnConfig.model_fields[key].annotation(fields[key])
    return DragonnConfig.model_construct(**{"enabled": True, **fields})


def _ds(**extra) -> Facts:
    return Facts.from_ds_config(extra)


ADAM = dict(optimizer="Adam", hooked_optimizer=True, momentum_refusal="", may_skip_steps=False)

#: rule name -> (the "dragonn" block, the facts, the phase, a piece of the message that names the key/value)
REFUSED = {
    "momentum_needs_error_feedback": ({"compress": "momentum", "advanced": {"error_feedback": False}}, Facts(),
                                      "config", "'advanced.error_feedback': true"),
    "momentum_needs_warmup": ({"compress": "momentum", "warmup_steps": 0}, Facts(), "config", "'warmup_steps' >= 1"),
    "momentum_keys_with_gradient": ({"compress": "gradient", "advanced": {"variance_refresh_steps": 10}}, Facts(),
                                    "config", "'advanced.variance_refresh_steps' applies to 'compress': 'momentum'"),
    "local_steps_keys_every_step": ({"outer_lr": 1.0}, Facts(), "config",
                                    "'outer_lr' applies to 'sync': 'local_steps'"),
    "dense_values_local_steps": ({"sync": "local_steps", "advanced": {"dense_values": "int8"}}, Facts(), "config",
                                 "'advanced.dense_values': 'int8' applies to 'sync': 'every_step'"),
    "momentum_keys_local_steps": ({"sync": "local_steps", "advanced": {"variance_refresh_steps": 10}}, Facts(),
                                  "config", "'advanced.variance_refresh_steps' applies to 'sync': 'every_step'"),
    "momentum_local_steps": ({"sync": "local_steps", "compress": "momentum"}, Facts(), "config",
                             "'compress': 'momentum' applies to 'sync': 'every_step'"),
    "ranks_per_node_flat": ({"hierarchy": "flat", "advanced": {"ranks_per_node": 2}}, Facts(), "config",
                            "'advanced.ranks_per_node' has no effect"),
    "cuda_aware_without_mpi": ({"advanced": {"cuda_aware": True}}, Facts(), "config", "'comm_backend': 'torch'"),
    "local_steps_zero": ({"sync": "local_steps"}, _ds(zero_optimization={"stage": 2}), "start",
                         "ZeRO stage 2 partitions them"),
    "dense_values_zero": ({"advanced": {"dense_values": "int8"}}, _ds(zero_optimization={"stage": 1}), "start",
                          "'dragonn.advanced.dense_values': 'int8' applies to ZeRO stage 0"),
    "pipeline_engine": ({}, Facts(pipeline_model=True), "start", "PipelineModule"),
    "offload": ({}, _ds(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}), "start",
                "'zero_optimization.offload_optimizer'"),
    "reduce_scatter_off": ({}, _ds(zero_optimization={"stage": 2, "reduce_scatter": False}), "start",
                           "'zero_optimization.reduce_scatter' is false"),
    "zero1_bf16_fp32_accum": ({}, _ds(zero_optimization={"stage": 1}, bf16={"enabled": True},
                                      data_types={"grad_accum_dtype": "fp32"}), "start",
                              "'data_types.grad_accum_dtype': 'fp32'"),
    "contiguous_gradients_off": ({}, _ds(zero_optimization={"stage": 1, "contiguous_gradients": False}), "start",
                                 "'zero_optimization.contiguous_gradients' is false"),
    "zero3_quantized_gradients": ({}, _ds(zero_optimization={"stage": 3, "zero_quantized_gradients": True}), "start",
                                  "'zero_optimization.zero_quantized_gradients'"),
    "zero3_zenflow": ({}, _ds(zero_optimization={"stage": 3, "zenflow": {"topk_ratio": 0.1}}), "start",
                      "'zero_optimization.zenflow'"),
    "zero3_predivide": ({}, _ds(zero_optimization={"stage": 3}, gradient_predivide_factor=2.0), "start",
                        "'gradient_predivide_factor' (2.0"),
    "unhooked_optimizer": ({}, Facts(stage=2, optimizer="BF16_Optimizer", hooked_optimizer=False), "engine",
                           "stage 2 with BF16_Optimizer"),
    "momentum_optimizer": ({"compress": "momentum"}, Facts(optimizer="SGD", hooked_optimizer=True,
                                                           momentum_refusal="needs Adam's update (SGD)"),
                           "engine", "'dragonn.compress': 'momentum' needs Adam's update (SGD)"),
    "local_steps_bf16_optimizer": ({"sync": "local_steps"}, Facts(bf16_optimizer=True), "engine", "BF16_Optimizer"),
    "kernel_device": ({"advanced": {"kernel": "triton"}}, Facts(device="cpu"), "engine",
                      "'dragonn.advanced.kernel': 'triton' needs a CUDA device"),
    "node_layout": ({"hierarchy": "node", "advanced": {"ranks_per_node": 2}},
                    Facts(hook_name="ZeRO stage 0", supports_hierarchy=True, dp_world=4, world=8), "layout",
                    "'dragonn.hierarchy': 'node': the data-parallel group (4 ranks) is not the world (8)"),
}


def test_every_row_has_a_refused_case_and_the_names_are_unique():
    names = [rule.name for rule in RULES]
    assert len(names) == len(set(names))
    assert set(REFUSED) == set(names)


@pytest.mark.parametrize("name", [rule.name for rule in RULES])
def test_each_row_refuses_its_case_with_its_own_message(name, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # launch/test.sh sets it; kernel_device reads it
    block, facts, phase, piece = REFUSED[name]
    cfg = _cfg(block)
    found = refusal(cfg, facts, phase)
    assert found is not None and found[0].name == name, found
    message = found[1]
    assert piece in message
    if phase == "config":  # through pydantic: a DragonnConfigError carrying exactly the row's message
        with pytest.raises(DragonnConfigError) as err:
            DragonnConfig.from_ds_config({"dragonn": {"enabled": True, **block}})
        assert message in str(err.value)
    else:
        with pytest.raises(DragonnUnsupportedError) as err:
            check(cfg, facts, phase)
        assert str(err.value) == message
    for other in {"config", "start", "engine", "layout"} - set(found[0].phases):  # no other phase checks it
        hit = refusal(cfg, facts, other)
        assert hit is None or hit[0].name != name


def test_reduce_scatter_false_is_one_row_at_every_stage_and_read_from_the_built_optimizer():
    for stage in (1, 2, 3):
        found = refusal(_cfg({}), _ds(zero_optimization={"stage": stage, "reduce_scatter": False}), "start")
        assert found[0].name == "reduce_scatter_off" and f"ZeRO stage {stage}" in found[1]
    # a string "false" is false to DeepSpeed, and so to the row; the optimizer DeepSpeed built says False too
    assert refusal(_cfg({}), _ds(zero_optimization={"stage": 2, "reduce_scatter": "false"}), "start")[0].name == \
        "reduce_scatter_off"
    built = Facts(stage=2, reduce_scatter=False, hooked_optimizer=True)
    assert refusal(_cfg({}), built, "engine")[0].name == "reduce_scatter_off"


#: (name, block, facts, expected plan fields) for each class of supported combination
SUPPORTED = [
    ("zero0_gradient", {"compress": "gradient"}, Facts(stage=0, optimizer="SGD", hooked_optimizer=True,
                                                       may_skip_steps=False),
     {"stage": 0, "compress": "gradient", "exchange": "allgather", "transactional": False}),
    ("zero0_auto_adam", {}, Facts(stage=0, **ADAM), {"compress": "momentum"}),
    ("zero0_auto_sgd", {}, Facts(stage=0, optimizer="SGD", hooked_optimizer=True, momentum_refusal="needs Adam"),
     {"compress": "gradient"}),
    ("zero0_auto_dense_warmup_0", {"warmup_steps": 0}, Facts(stage=0, **ADAM), {"compress": "gradient"}),
    ("zero0_partitioned_int8", {"exchange": "partitioned", "advanced": {"values": "int8", "dense_values": "int8"}},
     Facts(stage=0, **ADAM), {"exchange": "partitioned", "values": "int8", "dense_values": "int8"}),
    ("zero0_fp16", {"compress": "gradient"}, Facts.from_ds_config({"fp16": {"enabled": True}}).updated(
        optimizer="FP16_Optimizer", hooked_optimizer=True, may_skip_steps=True, loss_scaler=True),
     {"transactional": True}),
    ("zero0_bf16", {"compress": "gradient"}, Facts.from_ds_config({"bf16": {"enabled": True}}).updated(
        optimizer="FP16_Optimizer", hooked_optimizer=True, may_skip_steps=True, loss_scaler=False),
     {"transactional": False}),
    ("zero0_bf16_exact", {"compress": "gradient", "advanced": {"exact_skipped_steps": True}},
     Facts.from_ds_config({"bf16": {"enabled": True}}).updated(optimizer="FP16_Optimizer", hooked_optimizer=True,
                                                               may_skip_steps=True, loss_scaler=False),
     {"transactional": True}),
    ("zero0_fp32_exact_never_skips", {"compress": "gradient", "advanced": {"exact_skipped_steps": True}},
     Facts(stage=0, optimizer="SGD", hooked_optimizer=True, may_skip_steps=False), {"transactional": False}),
    ("zero1", {}, Facts.from_ds_config({"zero_optimization": {"stage": 1}}).updated(**ADAM),
     {"stage": 1, "exchange": "reduce_scatter"}),
    ("zero2_offload_none", {}, Facts.from_ds_config({"zero_optimization": {
        "stage": 2, "offload_optimizer": {"device": "none"}}}).updated(**ADAM), {"stage": 2}),
    ("zero3", {}, Facts.from_ds_config({"zero_optimization": {"stage": 3}}).updated(**ADAM), {"stage": 3}),
    ("local_steps", {"sync": "local_steps", "local_steps": 8}, Facts(stage=0, **ADAM),
     {"sync": "local_steps", "compress": "gradient"}),
    ("node_layout", {"hierarchy": "node"}, Facts(stage=0, supports_hierarchy=True, dp_world=8, world=8, **ADAM),
     {"layout": "node"}),
    ("auto_layout_one_rank", {}, Facts(stage=0, supports_hierarchy=True, dp_world=1, **ADAM), {"layout": "auto"}),
]


@pytest.mark.parametrize("name, block, facts, expected", SUPPORTED, ids=[c[0] for c in SUPPORTED])
def test_each_supported_class_passes_every_phase_and_resolves(name, block, facts, expected):
    DragonnConfig.from_ds_config({"dragonn": {"enabled": True, **block}})  # the config rows accept it
    cfg = _cfg(block)
    for phase in ("start", "engine", "layout"):
        assert refusal(cfg, facts, phase) is None, (phase, refusal(cfg, facts, phase))
    plan = resolve(cfg, facts)
    assert {k: getattr(plan, k) for k in expected} == expected
    assert plan.reasons["compress"] and plan.reasons["transactional"]


def test_the_plan_is_frozen_and_its_line_names_each_auto_and_why():
    plan = resolve(_cfg({}), Facts(stage=0, **ADAM))
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.compress = "gradient"
    line = plan.describe()
    assert "compress=momentum (an Adam-type optimizer)" in line and "warmup_steps=auto (" in line
    node = plan.with_layout(True, "partitioned")
    assert isinstance(node, Plan) and node.layout == "node" and node.exchange == "partitioned"
    assert "layout=node (resolved: several nodes" in node.describe() and plan.layout == "auto"


def test_the_momentum_mode_auto_reason_names_what_is_missing():
    plan = resolve(_cfg({"advanced": {"error_feedback": False}}), Facts(stage=0, **ADAM))
    assert plan.compress == "gradient" and plan.reasons["compress"] == "error feedback is off"


# --- DeepSpeed hook points and version ---------------------------------------------------------------------

def test_version_outside_the_tested_list_warns_naming_both():
    from ds_dragonn.engine.probes import TESTED_DEEPSPEED, version_warning
    assert version_warning(TESTED_DEEPSPEED[0]) is None
    warning = version_warning("0.18.0")
    assert "0.18.0" in warning and TESTED_DEEPSPEED[0] in warning


def test_hook_point_checks_read_signatures_not_source_text():
    """A reformatted method (same name and parameters, other text) passes; a renamed or re-signed one fails,
    naming it; DeepSpeed's instrument_w_nvtx wrapper is seen through."""
    from ds_dragonn.engine.probes import parameters, require_methods

    class Reformatted:
        def allreduce_bucket(self, bucket, dp_group, dp_world_size=None, new_option=False):
            return (bucket)  # other text, same behaviour

    require_methods(Reformatted, {"allreduce_bucket": ("bucket", "dp_group", "dp_world_size")}, "bypassed")

    class Resigned:
        def allreduce_bucket(self, tensors, group):
            pass

    with pytest.raises(RuntimeError, match=r"changed Resigned.allreduce_bucket .*'bucket'"):
        require_methods(Resigned, {"allreduce_bucket": ("bucket", "dp_group")}, "bypassed")
    with pytest.raises(RuntimeError, match="has no Resigned.allreduce_and_copy; bypassed"):
        require_methods(Resigned, {"allreduce_and_copy": ()}, "bypassed")
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    assert parameters(DeepSpeedZeroOptimizer_Stage3._DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads)[:2] == \
        ["params_to_reduce", "communication_data_type"]


def test_docs_config_md_lists_every_row_of_the_table():
    from pathlib import Path
    text = (Path(__file__).resolve().parents[1] / "docs" / "config.md").read_text()
    rows = {line.split("|")[1].strip().strip("`") for line in text.splitlines() if line.startswith("| `")}
    assert {rule.name for rule in RULES} <= rows


def test_initialize_warns_on_an_untested_deepspeed_version(monkeypatch):
    """An enabled block on an untested DeepSpeed: one warning naming it, then DeepSpeed runs (here: refuses the
    missing model); the tested version says nothing."""
    import deepspeed
    import deepspeed.utils.logging as ds_logging

    import ds_dragonn
    said = []
    monkeypatch.setattr(ds_logging, "print_dist", lambda msg, ranks=None: said.append(msg))
    cfg = {"train_batch_size": 1, "dragonn": {"enabled": True}}
    with pytest.raises(AssertionError, match="requires a model"):
        ds_dragonn.initialize(model=None, config=cfg)
    assert not [m for m in said if "not a tested version" in m]
    monkeypatch.setattr(deepspeed, "__version__", "0.18.0")
    with pytest.raises(AssertionError, match="requires a model"):
        ds_dragonn.initialize(model=None, config=cfg)
    assert [m for m in said if "DeepSpeed 0.18.0 is not a tested version (0.19.8)" in m]


@pytest.mark.parametrize("value", ["false", 0, "off", "False"])
def test_zero_switches_are_read_as_deepspeed_reads_them(value):
    """DeepSpeed's config models are pydantic: "false", 0, "off" are false. So is the row's test, at start and
    on the built optimizer."""
    for key, row in (("contiguous_gradients", "contiguous_gradients_off"), ("reduce_scatter", "reduce_scatter_off")):
        facts = _ds(zero_optimization={"stage": 2, key: value})
        assert refusal(_cfg({}), facts, "start")[0].name == row
    assert refusal(_cfg({}), _ds(zero_optimization={"stage": 2, "contiguous_gradients": "true"}), "start") is None
    built = Facts(stage=2, optimizer="DeepSpeedZeroOptimizer", hooked_optimizer=True, contiguous_gradients=False)
    assert refusal(_cfg({}), built, "engine")[0].name == "contiguous_gradients_off"


def test_zero1_bf16_fp32_accumulation_is_named_for_strings_and_on_the_built_engine():
    facts = _ds(zero_optimization={"stage": 1}, bf16={"enabled": "true"}, data_types={"grad_accum_dtype": "torch.float32"})
    assert refusal(_cfg({}), facts, "start")[0].name == "zero1_bf16_fp32_accum"
    built = Facts(stage=1, optimizer="BF16_Optimizer", hooked_optimizer=False, bf16_optimizer=True)
    found = refusal(_cfg({}), built, "engine")
    assert found[0].name == "zero1_bf16_fp32_accum" and "grad_accum_dtype" in found[1]


def test_triton_kernel_passes_on_cuda_and_under_the_interpreter(monkeypatch):
    cfg = _cfg({"advanced": {"kernel": "triton"}})
    assert refusal(cfg, Facts(device="cuda"), "engine") is None
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert refusal(cfg, Facts(device="cpu"), "engine") is None


def test_layout_choice_is_flat_for_one_rank_per_node_or_one_node_and_refuses_node_there():
    from ds_dragonn.plan import layout_choice
    assert layout_choice("auto", 2, 4, "") == (2, "")
    assert layout_choice("auto", 4, 4, "") == (None, "a single node of 4 ranks")
    assert layout_choice("auto", 1, 4, "") == (None, "one rank per node")
    assert layout_choice("auto", None, 4, "ranks are not numbered node by node") == \
        (None, "ranks are not numbered node by node")
    with pytest.raises(ValueError, match="a single node of 4 ranks. Use 'hierarchy': 'flat'"):
        layout_choice("node", 4, 4, "")
    with pytest.raises(ValueError, match="Set 'advanced.ranks_per_node'"):
        layout_choice("node", None, 4, "the launcher did not export LOCAL_SIZE")


@pytest.mark.parametrize("value", ["false", 0, "off", False])
def test_zero3_quantized_gradients_switched_off_as_deepspeed_reads_it_is_not_refused(value):
    facts = _ds(zero_optimization={"stage": 3, "zero_quantized_gradients": value})
    assert refusal(_cfg({}), facts, "start") is None
    assert refusal(_cfg({}), _ds(zero_optimization={"stage": 3, "zero_quantized_gradients": "true"}),
                   "start")[0].name == "zero3_quantized_gradients"


@pytest.mark.parametrize("types", ["fp32", ["fp32"], 3])
def test_a_data_types_that_is_not_an_object_is_left_to_deepspeed(types):
    facts = _ds(zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types=types)
    assert refusal(_cfg({}), facts, "start") is None  # (DeepSpeed refuses it by name)
