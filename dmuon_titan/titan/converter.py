"""The ``dmuon`` model converter: dedicates the Muon matrices on the meta model.

torchtitan runs converters after building the model on the meta device and before
``parallelize_fn`` (so before ``fully_shard``), which is exactly where ``dedicate_params`` must
run. The converter also checks, at start-up, that the rest of the job can work with DMuon.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.tools.logging import logger

from ..api import check_pipeline_schedule, dedicate_params, summarize_plan
from ..ops.ns_cost import orthogonalize_flops
from ..options import options_kwargs
from .errors import ConfigError
from .selection import TP_KEPT_WHOLE, describe_selection, muon_predicate

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

#: The train specs whose builders learn DMuon: every LLM torchtitan 0.2.2 ships.
MODEL_NAMES = ("llama3", "llama4", "qwen3", "deepseek_v3", "gpt_oss")

#: Attribute the converter sets on the model: the optimizer builder only receives
#: ``[optimizer]`` and the model parts, so the ``[dmuon]`` settings travel with the model.
JOB_ATTR = "_dmuon_titan_job"


@dataclass(frozen=True)
class DMuonJob:
    """What the converter decided for a model, for the optimizer builder."""

    config: object  # the [dmuon] section
    predicate: object  # (fqn, param) -> bool: the Muon matrices
    #: pipeline parallelism: each stage's part dedicates its own matrices in parallelize_fn
    per_stage: bool = False


def job_of(model_parts) -> DMuonJob | None:
    """The converter's :class:`DMuonJob` for these model parts, or ``None``."""
    return next((getattr(m, JOB_ATTR) for m in model_parts if hasattr(m, JOB_ATTR)), None)


def check_compatibility(job_config, parallel_dims) -> None:
    """Reject what DMuon does not support yet, naming the TOML key."""
    if not hasattr(job_config, "dmuon"):
        raise ConfigError(
            '[model] converters includes "dmuon" but [job] custom_config_module is not '
            '"dmuon_titan.titan.config" (it adds the [dmuon] section): add that line to [job]'
        )
    cfg = job_config.dmuon
    if job_config.model.name not in MODEL_NAMES:
        raise ConfigError(
            f"[model] name = {job_config.model.name!r}: DMuon serves torchtitan's language "
            f"models {list(MODEL_NAMES)} (their train specs learn the DMuon optimizer); use "
            "one of them or another optimizer"
        )
    if job_config.optimizer.name != "DMuon":
        raise ConfigError(
            f'[model] converters includes "dmuon" but [optimizer] name = '
            f'{job_config.optimizer.name!r}; set [optimizer] name = "DMuon"'
        )
    p = job_config.parallelism
    unsupported = {
        "parallelism.expert_tensor_parallel_degree": p.expert_tensor_parallel_degree,
    }
    for key, value in unsupported.items():
        if value not in (1, None):
            raise ConfigError(
                f"{key} = {value}: not supported with DMuon yet (data parallelism — FSDP, "
                "HSDP, DDP — and tensor, expert, context and pipeline parallelism are)"
            )
    if p.tensor_parallel_degree > 1:
        _check_tensor_parallel(job_config)
    if parallel_dims.pp_enabled:
        _check_pipeline(p)
    if p.expert_parallel_degree > 1 and p.expert_parallel_comm_backend != "standard":
        raise ConfigError(
            f"parallelism.expert_parallel_comm_backend = {p.expert_parallel_comm_backend!r}: "
            'DMuon serves expert parallelism with the "standard" backend only'
        )
    if cfg.mode == "dedicated":
        _check_quantization(job_config)
    if job_config.training.enable_cpu_offload:
        raise ConfigError("training.enable_cpu_offload = true: not supported with DMuon")
    if job_config.optimizer.early_step_in_backward:
        raise ConfigError("optimizer.early_step_in_backward = true: not supported with DMuon")
    if cfg.qk_clip_threshold > 0:
        _check_qk_clip(job_config, parallel_dims)


def _check_qk_clip(job_config, parallel_dims) -> None:
    """What QK-clip does not serve yet: the naive baseline, compiled blocks, and context
    parallelism's other sequence layouts (the tracking places rows as torch's head-tail
    layout does)."""
    key = f"[dmuon] qk_clip_threshold = {job_config.dmuon.qk_clip_threshold}"
    p = job_config.parallelism
    if p.context_parallel_degree > 1 and p.context_parallel_load_balancer != "headtail":
        raise ConfigError(
            f"{key} with parallelism.context_parallel_load_balancer = "
            f"{p.context_parallel_load_balancer!r}: QK-clip serves 'headtail' under context "
            "parallelism"
        )
    if job_config.dmuon.mode == "naive":
        raise ConfigError(f'{key} with [dmuon] mode = "naive": use mode = "dedicated"')
    if job_config.compile.enable and "model" in job_config.compile.components:
        raise ConfigError(
            f"{key} with compile.enable = true: the logit tracking is not compiled yet; "
            "compile the loss only, or turn the clip off"
        )


def check_qk_clip_targets(model: nn.Module, predicate) -> list:
    """The attention modules QK-clip serves in ``model``, each with wq and wk selected for
    Muon; one config line otherwise."""
    from ..qk_clip import served_attention

    key = "[dmuon] qk_clip_threshold"
    try:
        served = served_attention(model)
    except ValueError as err:
        raise ConfigError(f"{key}: {err}") from None
    for a in served:
        for proj in (a.query_proj, a.key_proj):
            name = f"{a.name}.{proj}.weight"
            if not predicate(name, getattr(a.module, proj).weight):
                raise ConfigError(
                    f"{key}: [dmuon] params leaves {name!r} on AdamW; QK-clip rescales "
                    "Muon's query and key matrices (select them, or turn the clip off)"
                )
    return served


def _check_tensor_parallel(job_config) -> None:
    """What DMuon's tensor parallelism does not serve yet, refused naming the key."""
    p = job_config.parallelism
    if p.enable_async_tensor_parallel:
        raise ConfigError(
            "parallelism.enable_async_tensor_parallel = true: async TP fuses the colwise/"
            "rowwise matmuls with their collectives inside compiled graphs, which DMuon's "
            "tensor-parallel matrices are not tested with yet; set it false"
        )


def _check_pipeline(p) -> None:
    if p.pipeline_parallel_schedule_csv:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule_csv = {p.pipeline_parallel_schedule_csv!r}: "
            "not supported with DMuon yet (a schedule by name is); leave it empty"
        )
    from torch.distributed.pipelining.schedules import get_schedule_class

    try:
        check_pipeline_schedule(get_schedule_class(p.pipeline_parallel_schedule))
    except ValueError as err:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {p.pipeline_parallel_schedule!r}: {err}"
        ) from None


FLOAT8 = "quantize.linear.float8"


def _check_quantization(job_config) -> None:
    """float8 linears work with DMuon: the owner keeps the high-precision master, forward
    casts the broadcast weight to float8 as it would an FSDP2 one, and Muon gets the
    high-precision gradient. Refused, naming the key: other quantizers, float8 converting
    after DMuon dedicated (it swaps the modules whose weights DMuon holds), and float8
    all-gathers (dedicated weights are not all-gathered by FSDP2)."""
    converters = list(job_config.model.converters)
    quantizers = [c for c in converters if c.startswith("quantize.")]
    others = [c for c in quantizers if c != FLOAT8]
    if others:
        raise ConfigError(
            f"[model] converters = {converters}: {others} not supported with DMuon yet "
            f'("{FLOAT8}" is)'
        )
    if FLOAT8 not in quantizers:
        return
    if converters.index("dmuon") < converters.index(FLOAT8):
        raise ConfigError(
            f'[model] converters = {converters}: put "dmuon" after "{FLOAT8}" (float8 swaps '
            "the Linear modules, DMuon then dedicates the weights of the new ones)"
        )
    if job_config.quantize.linear.float8.enable_fsdp_float8_all_gather:
        raise ConfigError(
            "quantize.linear.float8.enable_fsdp_float8_all_gather = true: DMuon's matrices are "
            "not all-gathered by FSDP2 (their owners broadcast them, cast to float8 in "
            "forward); set it false"
        )


def dp_meshes(parallel_dims):
    """(shard mesh, replicate mesh) for torchtitan's data-parallel layout: FSDP (fsdp, None),
    HSDP (fsdp, dp_replicate), DDP (None, dp_replicate), one device (a one-rank mesh, None)."""
    shard = parallel_dims.get_optional_mesh("fsdp")
    replicate = parallel_dims.get_optional_mesh("dp_replicate")
    if shard is None and replicate is None:
        shard = _one_rank_mesh()
    return shard, replicate


_ONE_RANK_MESH = None


def _one_rank_mesh():
    """This rank alone, as a mesh (no data parallelism: one device, or only pipeline
    stages). Made from a (world, 1) mesh so that every rank takes part in creating it."""
    global _ONE_RANK_MESH
    if _ONE_RANK_MESH is None:
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.tools import utils

        world = dist.get_world_size() if dist.is_initialized() else 1
        mesh = init_device_mesh(utils.device_type, (world, 1), mesh_dim_names=("_rest", "fsdp"))
        _ONE_RANK_MESH = mesh["fsdp"]
    return _ONE_RANK_MESH


def check_stacks(job_config, parallel_dims, model: nn.Module, predicate) -> None:
    """What expert stacks (3-D Muon parameters) do not work with yet, refused in one line."""
    stacks = [n for n, p in model.named_parameters() if p.ndim == 3 and predicate(n, p)]
    if not stacks:
        return
    if parallel_dims.tp > 1 and parallel_dims.ep == 1:  # (torchtitan then shards experts by TP)
        raise ConfigError(
            f"parallelism.tensor_parallel_degree = {parallel_dims.tp}: [dmuon] params selects "
            f"expert stacks ({stacks[0]!r}, ...), which DMuon combines with tensor "
            "parallelism only through expert parallelism; set expert_parallel_degree > 1, "
            "leave them out of [dmuon] params, or use degree 1"
        )
    if job_config.dmuon.mode == "naive":
        raise ConfigError(
            f'[dmuon] mode = "naive" steps 2-D matrices only, and [dmuon] params selects '
            f'expert stacks ({stacks[0]!r}, ...): use mode = "dedicated" or leave them out'
        )
    ckpt = job_config.checkpoint
    for key in ("initial_load_in_hf", "last_save_in_hf"):
        if getattr(ckpt, key, False):
            raise ConfigError(
                f"checkpoint.{key} = true: torchtitan's Hugging Face conversion does not take "
                "DMuon's expert-stack pieces yet; use DCP checkpoints"
            )


def dedicate(model: nn.Module, job_config, parallel_dims, predicate, stage: str = "") -> None:
    """``dedicate_params`` on ``model`` (the whole model, or one pipeline stage's part,
    named by ``stage``) over torchtitan's data-parallel meshes, and the plan's log line."""
    cfg = job_config.dmuon
    boundary = (lambda m: True) if cfg.hook_boundary == "module" else None
    shard_mesh, replicate_mesh = dp_meshes(parallel_dims)
    expert_mesh = parallel_dims.get_optional_mesh("ep") if parallel_dims.ep > 1 else None
    tp_mesh = parallel_dims.get_optional_mesh("tp") if parallel_dims.tp > 1 else None
    options = options_kwargs(cfg.dedicate_options())
    if stage:  # a stage keeps its weights for all the step's microbatches (prepare_pipeline_stage)
        options["reshard_after_forward"] = False
    try:
        dedicated = dedicate_params(
            model,
            shard_mesh,
            predicate,
            hook_boundary_predicate=boundary,
            replicate_mesh=replicate_mesh,
            expert_mesh=expert_mesh,
            tp_mesh=tp_mesh,
            allow_empty=bool(stage),
            **options,
        )
        if dedicated is None:  # (a stage without Muon matrices: nothing selected)
            logger.info(f"DMuon: {stage} holds no Muon matrix: AdamW steps all its parameters")
            return
    except ValueError as err:  # (dedicate_params checks its input before any collective)
        raise ConfigError(f"{_key_of(str(err), parallel_dims)}: {err}") from None
    _log_plan(model, job_config, options, expert_mesh, stage)


def _log_plan(
    model: nn.Module, job_config, options: dict, expert_mesh: DeviceMesh | None, stage: str
) -> None:
    """The dedicated plan's log lines: ranks left without a Muon matrix, then its summary."""
    cfg = job_config.dmuon
    training = job_config.training
    summary = summarize_plan(
        model,
        TORCH_DTYPE_MAP[training.mixed_precision_param],
        TORCH_DTYPE_MAP[training.mixed_precision_reduce],
        ns_dtype=cfg.torch_ns_dtype,
        ns_steps=cfg.ns_steps,
        ns_preconditioner=cfg.ns_preconditioner,
    )
    loads = summary["ns_flops_per_rank"]
    where = f"{stage}: " if stage else ""
    _warn_idle_ranks(summary, where)
    # The yardstick of the benchmarks (T_floor): plain NS of every matrix, whatever runs.
    plain = sum(orthogonalize_flops(p["shape"], "plain") for p in summary["params"])
    z = "Z3" if options["reshard_after_forward"] else "Z2"
    tp = f" x {summary['tp_size']} tensor-parallel" if summary["tp_size"] > 1 else ""
    ns = f"NS {cfg.ns_algorithm} in {cfg.ns_dtype}"
    if any(p["shared_ns"] for p in summary["params"]):
        tp += ", Newton-Schulz shared by each owner's tensor-parallel row"
        ns = f"NS plain (shared by the tp rows) in {cfg.ns_dtype}"
    logger.info(
        f"DMuon: {where}{summary['num_params']} matrices on {summary['world_size']} ranks "
        f"({_count(summary['replicate_size'], 'replica')} x "
        f"{_count(summary['shard_size'], 'shard')}{tp}"
        f"{f', experts cut by expert parallelism {expert_mesh.size()}' if expert_mesh else ''}), "
        f"{len(summary['boundaries'])} hook boundaries, NS GFLOP per rank "
        f"{[round(x / 1e9, 1) for x in loads]} (imbalance {summary['imbalance']:.3f}; "
        f"plain-NS GFLOP {plain / 1e9:.1f} in all), "
        f"{summary['bytes_per_rank_per_step']['total'] / 2**20:.1f} MiB per rank per step "
        f"({z}, {_layouts(summary['boundaries'])}); {ns}"
    )


def _warn_idle_ranks(summary: dict, where: str) -> None:
    """Warn when the plan (``summary``) leaves ranks without a Muon matrix to own."""
    loads = summary["ns_flops_per_rank"]
    idle = [rank for rank, load in enumerate(loads) if load == 0]
    if idle:
        logger.warning(
            f"DMuon: {where}ranks {idle} of {len(loads)} own no Muon matrix "
            f"({summary['num_params']} matrices): their Newton-Schulz share is zero and the "
            "others carry it; [dmuon] small_param_numel = 0 gives every matrix its own owner"
        )


def _key_of(message: str, parallel_dims) -> str:
    """The config key a ``dedicate_params`` refusal is about: the expert- or tensor-parallel
    degree it names, else the selection of Muon matrices."""
    if "expert-parallel degree" in message:
        return f"parallelism.expert_parallel_degree = {parallel_dims.ep}"
    if "tensor-parallel degree" in message or "tp_mesh" in message:
        return f"parallelism.tensor_parallel_degree = {parallel_dims.tp}"
    return "[dmuon] params"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'s' if n != 1 else ''}"


class DMuonConverter:
    """``[model] converters = ["dmuon"]``."""

    def __init__(self, job_config, parallel_dims) -> None:
        check_compatibility(job_config, parallel_dims)
        self.job_config = job_config
        self.parallel_dims = parallel_dims

    def convert(self, model: nn.Module) -> None:
        cfg = self.job_config.dmuon
        kept_whole = ()
        if self.parallel_dims.tp > 1:
            kept_whole = TP_KEPT_WHOLE.get(self.job_config.model.name, ())
        predicate = muon_predicate(cfg.params, model, kept_whole)
        if kept_whole and not cfg.params:
            logger.info(
                f"DMuon: tensor parallelism keeps {', '.join(kept_whole)} whole on every tp "
                "rank (torchtitan's NoParallel): they stay on AdamW"
            )
        check_stacks(self.job_config, self.parallel_dims, model, predicate)
        if cfg.qk_clip_threshold > 0:
            served = check_qk_clip_targets(model, predicate)
            logger.info(
                f"DMuon QK-clip: threshold {cfg.qk_clip_threshold:g} on {len(served)} attention "
                f"modules ({served[0].name}, ...)"
            )
        # Under pipeline parallelism torchtitan deep-copies this model into one part per
        # stage after the converters ran: each part dedicates its own matrices, over its
        # stage's data-parallel mesh, in parallelize_fn (parallelize.py).
        per_stage = self.parallel_dims.pp_enabled and cfg.mode == "dedicated"
        setattr(model, JOB_ATTR, DMuonJob(cfg, predicate, per_stage))
        logger.info(describe_selection(model, predicate))
        if cfg.mode == "naive":
            logger.info("DMuon naive mode: every parameter stays on FSDP2")
            return
        if not per_stage:
            dedicate(model, self.job_config, self.parallel_dims, predicate)

    def post_optimizer_hook(self, model) -> None:
        pass


def _layouts(boundaries: list[dict]) -> str:
    """How the boundaries' weights move, e.g. "32 by all-gather" or "4 by broadcast"."""
    counts = Counter(b["collectives"] for b in boundaries)
    return ", ".join(f"{n} by {'all-gather' if k == 'gather' else k}" for k, n in counts.items())
