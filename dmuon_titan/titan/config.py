"""The ``[dmuon]`` TOML section, merged into torchtitan's JobConfig.

Used as ``[job] custom_config_module = "dmuon_titan.titan.config"``. torchtitan merges the
``JobConfig`` below into its own. Every value is validated when the section is built (TOML
or command line); a bad value exits with one line naming the key.

(No ``from __future__ import annotations`` here: torchtitan's merge needs real annotations.)
"""

import math
import re
from dataclasses import dataclass, field, fields, is_dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..ops.newton_schulz import NS_COEFFICIENT_SETS
from ..ops.update import ADJUST_LR_FNS
from ..options import DEFAULT_NS_BATCH_NUMEL, DedicateOptions, MuonOptions, OptionError
from ..plan.partition import DEFAULT_SMALL_PARAM_NUMEL
from .errors import ConfigError, check_torchtitan_version

MODES = ("dedicated", "naive")
HOOK_BOUNDARIES = ("block", "module")
NS_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass
class DMuon:
    mode: str = "dedicated"
    """How Muon is distributed. "dedicated": each Muon matrix lives whole on one owner rank,
    broadcast in forward, its gradient reduced to the owner, Newton-Schulz only there.
    "naive": every parameter stays on FSDP2 and every rank all-gathers each matrix and runs
    Newton-Schulz redundantly (same update rule; the reference and benchmark baseline)."""

    params: list[str] = field(default_factory=list)
    """Regular expressions (Python ``re.fullmatch`` on the parameter FQN, wrapper segments such
    as ``_checkpoint_wrapped_module`` removed) selecting the Muon parameters. Every pattern must
    match at least one parameter; every match must be a 2-D matrix or a 3-D expert stack
    ([experts, out, in] of a grouped-experts module), and not a tied weight. Default (empty):
    chosen from what the parameters are — the nn.Linear weights inside the transformer blocks
    (attention, feed-forward, shared experts) and the expert stacks go to Muon; embeddings,
    output head, norms, biases, routers' gates and tied weights stay on AdamW, and under
    tensor parallelism so do the matrices torchtitan's plan keeps whole on every tp rank
    (deepseek_v3's attention.wkv_a and wq_a) (``dmuon_titan.titan.selection``; the start-up
    log lists what went where)."""

    hook_boundary: str = "block"
    """Where a matrix's broadcast/reduce hooks live. "block": its transformer block
    (``layers.N``), one coalesced collective per owner per block; "module": its own module."""

    reshard_after_forward: bool = True
    """True (Z3): free non-owned matrices after forward and re-broadcast them before backward.
    False (Z2): keep them from forward until the block's backward (less traffic, more memory)."""

    collectives: str = "broadcast"
    """How a block's dedicated weights and gradients move between the shard ranks (results are
    identical either way). "broadcast": one broadcast from and one reduce to each owner, in
    turn. "gather": the owners' buckets padded to the largest, one all-gather and one
    reduce-scatter per block, every link busy at once. "auto": per block, the one with less
    traffic on the busiest link (gather on 2-3 ranks for llama3 blocks; see
    dmuon_titan/plan/collectives.py)."""

    replicate_async: bool = True
    """With replicas (HSDP, DDP): send each owner's updated matrices to the other replicas
    asynchronously after the step, waited for in the next forward of their block (hidden
    behind earlier blocks). False waits right away (debugging; bit-identical results)."""

    lr: float | None = None
    """Muon learning rate. Default: [optimizer] lr, which with adjust_lr_fn = "match_rms_adamw"
    gives Muon updates the RMS of AdamW's, so AdamW's tuned lr carries over."""

    weight_decay: float | None = None
    """Decoupled weight decay of the Muon matrices. Default: [optimizer] weight_decay."""

    momentum: float = 0.95
    """Momentum coefficient, in [0, 1)."""

    nesterov: bool = True
    """Use Nesterov momentum (torch.optim.Muon's default)."""

    ns_steps: int = 5
    """Newton-Schulz iterations, >= 1."""

    ns_coefficients: str = "jordan"
    """Named (a, b, c) schedule: "jordan" (3.4445, -4.7750, 2.0315) every iteration, or
    "polar_express" (Amsel et al. 2025, per-iteration coefficients)."""

    ns_dtype: str = "bfloat16"
    """dtype the Newton-Schulz iterations run in: "bfloat16" (torch.optim.Muon's), "float16"
    (3 more mantissa bits: a smaller NS error; the direction is normalized before the cast,
    an extra pass; docs/design_notes.md#float16-newton-schulz), "float32" or "float64"."""

    ns_algorithm: str = "plain"
    """How Newton-Schulz is computed: "plain" (torch.optim.Muon's iteration), "gram" (the same
    polynomial iterated on the m x m Gram matrix, with a restart: fewer FLOPs for wide
    matrices, equal in exact arithmetic; pair it with ns_dtype = "float16", where it is more
    accurate than plain bfloat16) or "auto" (per shape, whichever needs fewer FLOPs). On CUDA
    in bfloat16/float16, "gram" and "auto" compute their symmetric products (X Xᵀ, A²) by a
    Triton kernel that does half the FLOPs (dmuon_titan/ops/symmetric.py); in bfloat16 also with
    the division by the norm folded into the first products and plain iterations as
    X <- P X (no less accurate than plain bfloat16;
    docs/design_notes.md#polynomial-form-and-folded-normalization). "plain" stays
    torch.optim.Muon's exact operations."""

    ns_preconditioner: str = "frobenius"
    """How Newton-Schulz scales its input first: "frobenius" (divided by its Frobenius norm,
    torch.optim.Muon's) or "aol" (each row by 1/sqrt of its absolute row sum of X Xᵀ, fused
    with the first iteration: a nearer start; dmuon_titan/ops/newton_schulz.py)."""

    tp_ns: str = "auto"
    """With tensor_parallel_degree > 1, who runs each matrix's Newton-Schulz: "owner" (its
    owner rank alone, on the whole matrix), "shared" (the tensor-parallel ranks of the
    owner's row together, each on 1/tp of the matrix's columns: plain NS whatever
    ns_algorithm says, an m x m all-reduce and all-gather over the row per iteration) or
    "auto" ("shared" where it is estimated faster: models with too few matrices for
    dp x tp owners, e.g. llama3-70B at dp 128 x tp 8; dmuon_titan/plan/partition.py)."""

    ns_eps: float = 1e-7
    """Floor of the Frobenius norm that normalizes the matrix before Newton-Schulz."""

    adjust_lr_fn: str = "match_rms_adamw"
    """Per-matrix lr scaling: "match_rms_adamw" (0.2*sqrt(max(rows, cols))) or "original"
    (sqrt(max(1, rows/cols)))."""

    small_param_numel: int = DEFAULT_SMALL_PARAM_NUMEL
    """Matrices with at most this many elements are packed per block onto one owner."""

    ns_batch_numel: int = DEFAULT_NS_BATCH_NUMEL
    """Same-shape matrices of an owner are orthogonalized together (one batched Newton-Schulz)
    in chunks of at most this many elements; 0 runs one matrix at a time. Larger chunks run
    small matrices nearer the matmul rate and cost a few NS-dtype buffers of that size."""

    cuda_graph: bool = True
    """On one GPU (a single-rank job), run the Muon matrices' step as one captured CUDA graph
    after a first eager step: a small model's step is host-bound and Muon launches far more
    kernels than fused AdamW. The logged ``ns`` time is then 0 (inside the graph). false:
    always eager."""

    async_step: bool = True
    """With ``cuda_graph``: replay the captured step on a side stream, so the host prepares the
    next step (the trainer's batch copy waits for the compute stream alone) while the GPU runs
    Newton-Schulz; the next forward and backward, validation and state dicts wait for it on the
    GPU, checkpoint saves on the host. Same results. The logged ``optimizer`` time then ends
    when the side stream's step does. false: replayed on the compute stream."""

    qk_clip_threshold: float = 0.0
    """MuonClip (QK-clip): after each step, every attention head whose largest logit in that
    step's forwards exceeded this threshold has its wq and wk rows rescaled to bring it back
    to the threshold (Kimi K2 uses 100). 0: off."""

    def __post_init__(self) -> None:
        validate(self)

    @property
    def torch_ns_dtype(self) -> torch.dtype:
        return NS_DTYPES[self.ns_dtype]

    def dedicate_options(self) -> DedicateOptions:
        """The ``dedicate_params`` options these fields set."""
        return DedicateOptions(
            reshard_after_forward=self.reshard_after_forward,
            replicate_async=self.replicate_async,
            small_param_numel=self.small_param_numel,
            ns_algorithm=self.ns_algorithm,
            collectives=self.collectives,
            tp_ns=self.tp_ns,
        )

    def muon_options(self, optimizer) -> MuonOptions:
        """Muon's hyper-parameters: these fields, with defaults and the AdamW part from
        ``[optimizer]`` (``optimizer``, torchtitan's section)."""
        return MuonOptions(
            lr=optimizer.lr if self.lr is None else self.lr,
            momentum=self.momentum,
            nesterov=self.nesterov,
            ns_coefficients=self.ns_coefficients,
            ns_steps=self.ns_steps,
            eps=self.ns_eps,
            weight_decay=optimizer.weight_decay if self.weight_decay is None else self.weight_decay,
            adjust_lr_fn=self.adjust_lr_fn,
            ns_dtype=self.torch_ns_dtype,
            adamw_lr=optimizer.lr,
            adamw_betas=(optimizer.beta1, optimizer.beta2),
            adamw_eps=optimizer.eps,
            adamw_weight_decay=optimizer.weight_decay,
            adamw_foreach=optimizer.implementation == "foreach",
            adamw_fused=optimizer.implementation == "fused",
            ns_batch_numel=self.ns_batch_numel,
            ns_algorithm=self.ns_algorithm,
            cuda_graph=self.cuda_graph,
            async_step=self.async_step,
            ns_preconditioner=self.ns_preconditioner,
        )


#: [dmuon] keys whose option has another name
_KEY_OF_OPTION = {"eps": "ns_eps"}


def _fail(key: str, value: Any, why: str) -> ConfigError:
    return ConfigError(f"[dmuon] {key} = {value!r}: {why}")


def validate(cfg: DMuon) -> None:
    """Check every field; raise ConfigError naming the first bad key. The fields that are
    ``dedicate_params``/``Muon`` options are checked by those options' own validation."""

    def choice(key: str, options) -> None:
        value = getattr(cfg, key)
        if value not in options:
            raise _fail(key, value, f"must be one of {list(options)}")

    choice("mode", MODES)
    choice("hook_boundary", HOOK_BOUNDARIES)
    choice("ns_coefficients", NS_COEFFICIENT_SETS)  # by name here
    choice("ns_dtype", NS_DTYPES)
    choice("adjust_lr_fn", [f for f in ADJUST_LR_FNS if f is not None])
    for key in ("lr", "weight_decay"):  # None: taken from [optimizer]
        value = getattr(cfg, key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0
        ):
            raise _fail(key, value, "must be a number >= 0")
    tau = cfg.qk_clip_threshold
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not 0 <= tau < math.inf:
        raise _fail("qk_clip_threshold", tau, "must be a number >= 0 (0: off)")
    if not isinstance(cfg.params, list) or not all(isinstance(p, str) for p in cfg.params):
        raise _fail(
            "params", cfg.params, "must be a list of regular expressions ([] for the default)"
        )
    for pattern in cfg.params:
        try:
            re.compile(pattern)
        except re.error as err:
            raise _fail("params", pattern, f"is not a valid regular expression ({err})") from None
    placeholder = SimpleNamespace(
        lr=0.0, weight_decay=0.0, beta1=0.9, beta2=0.95, eps=1e-8, implementation="fused"
    )
    try:
        cfg.dedicate_options()
        cfg.muon_options(placeholder)
    except OptionError as err:
        key = _KEY_OF_OPTION.get(err.field, err.field)
        raise _fail(key, err.value, err.why) from None


@dataclass
class JobConfig:
    dmuon: DMuon = field(default_factory=DMuon)


# ------------------------------------------------------------------ clean unknown-key errors
def check_toml_keys(cls: type, data: dict, section: str = "") -> None:
    """Unknown TOML sections or keys: one line naming them and the valid ones."""
    if not is_dataclass(cls) or not isinstance(data, dict):
        return
    known = {f.name: f.type for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        where = f"[{section}]" if section else "the top level"
        raise ConfigError(
            f"unknown key(s) {unknown} in {where} of the TOML file; valid: {sorted(known)}"
        )
    for name, value in data.items():
        check_toml_keys(known[name], value, f"{section}.{name}" if section else name)


def _install_toml_key_check() -> None:
    """torchtitan raises a bare ValueError with a traceback on every rank for an unknown
    TOML key; check first and exit with one line instead. Installed when torchtitan imports
    this module (before it reads the TOML sections)."""
    from torchtitan.config.manager import ConfigManager

    original = ConfigManager._dict_to_dataclass
    if getattr(original, "_dmuon_checked", False):
        return

    def _dict_to_dataclass(self, cls, data):
        if is_dataclass(cls) and "job" in {f.name for f in fields(cls)}:
            check_toml_keys(cls, data)
        return original(self, cls, data)

    _dict_to_dataclass._dmuon_checked = True
    ConfigManager._dict_to_dataclass = _dict_to_dataclass


check_torchtitan_version()
_install_toml_key_check()
