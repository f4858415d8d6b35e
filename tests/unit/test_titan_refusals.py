"""What the torchtitan plugin still refuses, each in one line naming the key, decided from the
config alone (before any collective). The launched-job form of these checks, for a few of
them, is ``tests/titan/test_titan.py::test_bad_config_exits_cleanly_under_torchrun``."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from torchtitan.config import ConfigManager

import dmuon_titan.titan  # noqa: F401  (registers the converter and the [dmuon] section)
from dmuon_titan.titan.config import ConfigError
from dmuon_titan.titan.converter import check_compatibility

TOY = Path(__file__).resolve().parents[2] / "configs" / "toy_dmuon.toml"


def _dims(**kw):
    dims = {"pp_enabled": False, "ep": 1, "tp": 1}
    dims.update(kw)
    return SimpleNamespace(**dims)


@pytest.mark.parametrize(
    "override, dims, key",
    [
        (
            [
                "--parallelism.tensor_parallel_degree",
                "2",
                "--parallelism.enable_async_tensor_parallel",
            ],
            {"tp": 2},
            "parallelism.enable_async_tensor_parallel = true",
        ),
        (
            ["--parallelism.expert_tensor_parallel_degree", "2"],
            {},
            "parallelism.expert_tensor_parallel_degree = 2",
        ),
        (
            [
                "--parallelism.expert_parallel_degree",
                "2",
                "--parallelism.expert_parallel_comm_backend",
                "deepep",
            ],
            {"ep": 2},
            "parallelism.expert_parallel_comm_backend = 'deepep'",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "InterleavedZeroBubble",
            ],
            {"pp_enabled": True},
            "parallelism.pipeline_parallel_schedule = 'InterleavedZeroBubble'",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "DualPipeV",
            ],
            {"pp_enabled": True},
            "parallelism.pipeline_parallel_schedule = 'DualPipeV'",
        ),
        (
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule_csv",
                "my_schedule.csv",
            ],
            {"pp_enabled": True},
            "parallelism.pipeline_parallel_schedule_csv = 'my_schedule.csv'",
        ),
        (
            ["--model.converters", "quantize.grouped_mm.float8,dmuon"],
            {},
            "['quantize.grouped_mm.float8'] not supported with DMuon",
        ),
        (["--training.enable_cpu_offload"], {}, "training.enable_cpu_offload = true"),
        (["--optimizer.early_step_in_backward"], {}, "optimizer.early_step_in_backward = true"),
        (
            [
                *("--dmuon.qk_clip_threshold", "100", "--parallelism.context_parallel_degree"),
                *("2", "--parallelism.context_parallel_load_balancer", "ptrr"),
            ],
            {},
            "context_parallel_load_balancer = 'ptrr': QK-clip serves 'headtail'",
        ),
        (
            ["--dmuon.qk_clip_threshold", "100", "--dmuon.mode", "naive"],
            {},
            'qk_clip_threshold = 100.0 with [dmuon] mode = "naive"',
        ),
        (
            ["--dmuon.qk_clip_threshold", "100", "--compile.enable"],
            {},
            "qk_clip_threshold = 100.0 with compile.enable = true",
        ),
    ],
    ids=[
        "async-tp",
        "etp",
        "ep-backend",
        "interleaved-zb",
        "dualpipev",
        "pp-csv",
        "grouped-mm-float8",
        "cpu-offload",
        "early-step",
        "qk-clip-cp-layout",
        "qk-clip-naive",
        "qk-clip-compile",
    ],
)
def test_still_refused_in_one_line(override, dims, key):
    config = ConfigManager().parse_args(["--job.config_file", str(TOY), *override])
    with pytest.raises(ConfigError) as err:
        check_compatibility(config, _dims(**dims))
    message = str(err.value)
    assert key in message and "\n" not in message, message


@pytest.mark.parametrize("schedule", ["1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"])
def test_pipeline_schedules_served(schedule):
    config = ConfigManager().parse_args(
        [
            "--job.config_file",
            str(TOY),
            "--parallelism.pipeline_parallel_degree",
            "2",
            "--parallelism.pipeline_parallel_schedule",
            schedule,
        ]
    )
    check_compatibility(config, _dims(pp_enabled=True))


def test_qk_clip_targets_are_muon_matrices_without_norms():
    """``check_qk_clip_targets`` on meta models: qwen3's query/key norms, and wq left on
    AdamW by ``[dmuon] params``, are one line naming the key; llama3's 6 attention modules
    are served."""
    import torch
    from torchtitan.protocols.train_spec import get_train_spec

    from dmuon_titan.titan.converter import check_qk_clip_targets
    from dmuon_titan.titan.selection import muon_predicate

    def meta(name):
        spec = get_train_spec(name)
        with torch.device("meta"):
            return spec.model_cls(spec.model_args["debugmodel"])

    llama = meta("llama3")
    assert len(check_qk_clip_targets(llama, muon_predicate([], llama))) == 6
    only_wk = muon_predicate([r"layers\.\d+\.attention\.wk\.weight"], llama)
    with pytest.raises(ConfigError, match=r"\[dmuon\] params leaves 'layers.0.attention.wq"):
        check_qk_clip_targets(llama, only_wk)
    qwen = meta("qwen3")
    with pytest.raises(ConfigError, match="query/key norms") as err:
        check_qk_clip_targets(qwen, muon_predicate([], qwen))
    assert "\n" not in str(err.value)
