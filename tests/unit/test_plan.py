"""Partition planning: pure functions, no process group."""

import pytest

from dmuon_titan.plan import ParamSpec, plan_partition
from dmuon_titan.plan.cost import gram_ns_flops, ns_flops, orthogonalize_flops


def llama_shapes(dim: int, kv: int, ffn: int) -> dict[str, tuple[int, int]]:
    """The seven matrices of a llama3 block: width ``dim``, ``kv`` key/value features,
    ``ffn`` hidden features."""
    return {
        "attention.wq": (dim, dim),
        "attention.wk": (kv, dim),
        "attention.wv": (kv, dim),
        "attention.wo": (dim, dim),
        "feed_forward.w1": (ffn, dim),
        "feed_forward.w2": (dim, ffn),
        "feed_forward.w3": (ffn, dim),
    }


LLAMA3_8B = llama_shapes(4096, 1024, 14336)
LLAMA3_1B = llama_shapes(2048, 512, 8192)
LLAMA3_70B = llama_shapes(8192, 1024, 28672)


def llama_specs(shapes, n_layers):
    return [
        ParamSpec(f"layers.{i}.{name}.weight", shape, f"layers.{i}")
        for i in range(n_layers)
        for name, shape in shapes.items()
    ]


def test_ns_flops_counts_the_three_matmuls_on_the_wide_orientation():
    # 4096x14336, wide: X X^T = 2*m*m*n, A*A = 2*m^3, B*X = 2*m*m*n per iteration.
    m, n = 4096, 14336
    assert ns_flops((m, n), 5) == 5 * (2 * m * m * n + 2 * m**3 + 2 * m * m * n)
    assert ns_flops((n, m), 5) == ns_flops((m, n), 5)  # tall matrices are transposed first


@pytest.mark.parametrize("world_size", [8, 16])
def test_llama3_8b_balance_and_spread(world_size):
    specs = llama_specs(LLAMA3_8B, 32)
    plan = plan_partition(specs, world_size)
    assert plan.imbalance() <= 1.05
    per_boundary = {}
    for spec, owner in zip(plan.specs, plan.owners, strict=True):
        per_boundary.setdefault(spec.boundary, []).append(owner)
    for boundary, owners in per_boundary.items():
        assert len(set(owners)) == len(owners), f"{boundary} has two params on one owner: {owners}"


def test_llama3_1b_balance_on_8_ranks():
    assert plan_partition(llama_specs(LLAMA3_1B, 16), 8).imbalance() <= 1.05


def test_plan_is_deterministic_and_fingerprinted():
    specs = llama_specs(LLAMA3_8B, 4)
    a, b = plan_partition(specs, 3), plan_partition(list(specs), 3)
    assert a.owners == b.owners and a.fingerprint() == b.fingerprint()
    moved = plan_partition(specs[1:] + specs[:1], 3)
    assert moved.fingerprint() != a.fingerprint()  # order is part of the contract


def test_loads_add_up_and_every_rank_works():
    specs = llama_specs(LLAMA3_8B, 32)
    plan = plan_partition(specs, 8)
    loads = plan.load_per_rank()
    assert sum(loads) == sum(ns_flops(s.shape) for s in specs)
    assert min(loads) > 0


def test_small_params_of_a_boundary_share_one_owner():
    specs = [ParamSpec(f"b{b}.p{i}", (8, 8), f"b{b}") for b in range(3) for i in range(5)]
    specs.append(ParamSpec("b0.big", (512, 512), "b0"))
    plan = plan_partition(specs, 4, small_param_numel=64)
    for b in range(3):
        owners = {
            o
            for s, o in zip(plan.specs, plan.owners, strict=True)
            if s.boundary == f"b{b}" and s.numel <= 64
        }
        assert len(owners) == 1
    # With packing disabled they spread again over the three ranks not busy with b0.big.
    spread = plan_partition(specs, 4, small_param_numel=0)
    owners_b1 = {o for s, o in zip(spread.specs, spread.owners, strict=True) if s.boundary == "b1"}
    assert len(owners_b1) == 3


def test_single_rank_owns_everything():
    plan = plan_partition(llama_specs(LLAMA3_1B, 2), 1)
    assert set(plan.owners) == {0} and plan.imbalance() == 1.0


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        plan_partition([], 0)


def test_costs_follow_the_ns_algorithm():
    specs = llama_specs(LLAMA3_8B, 1)
    plain = plan_partition(specs, 2)
    auto = plan_partition(specs, 2, ns_algorithm="auto")
    gram = plan_partition(specs, 2, ns_algorithm="gram")
    assert plain.costs == tuple(ns_flops(s.shape) for s in specs)
    assert gram.costs == tuple(gram_ns_flops(s.shape) for s in specs)
    by_name = {s.fqn.split(".", 2)[2]: c for s, c in zip(specs, auto.costs, strict=True)}
    # "auto": Gram for the wide/tall matrices, plain for the squares (Gram costs more there).
    assert by_name["feed_forward.w2.weight"] == gram_ns_flops((4096, 14336))
    assert by_name["attention.wk.weight"] == gram_ns_flops((1024, 4096))
    assert by_name["attention.wq.weight"] == ns_flops((4096, 4096))
    assert gram_ns_flops((4096, 4096)) > ns_flops((4096, 4096))
    assert auto.ns_algorithm == "auto" and plain.ns_algorithm == "plain"
    assert orthogonalize_flops((14336, 4096), "auto") == gram_ns_flops((4096, 14336))


def test_balancing_by_the_algorithm_that_runs_lowers_its_makespan():
    # One FFN matrix and three squares on 2 ranks. By plain-NS FLOPs the FFN matrix (5.5 TFLOP)
    # outweighs two squares (2 x 2.06), so it sits alone; under "auto" it costs 3.85 TFLOP
    # (Gram NS) and a square should join it.
    specs = [ParamSpec("ffn", (14336, 4096), "b0")]
    specs += [ParamSpec(f"sq{i}", (4096, 4096), f"b{i + 1}") for i in range(3)]
    plain = plan_partition(specs, 2)
    auto = plan_partition(specs, 2, ns_algorithm="auto")

    def makespan(owners):
        loads = [0, 0]
        for spec, owner in zip(specs, owners, strict=True):
            loads[owner] += orthogonalize_flops(spec.shape, "auto")
        return max(loads)

    assert sorted(plain.owners.count(r) for r in (0, 1)) == [1, 3]
    assert sorted(auto.owners.count(r) for r in (0, 1)) == [2, 2]
    assert makespan(auto.owners) < makespan(plain.owners)
    assert auto.fingerprint() != plain.fingerprint()


def test_bad_ns_algorithm_is_named():
    with pytest.raises(ValueError, match="ns_algorithm 'fast'"):
        plan_partition(llama_specs(LLAMA3_1B, 1), 2, ns_algorithm="fast")


# ---------------------------------------------------------------------- boundary collectives
def test_link_costs_of_the_two_layouts():
    from dmuon_titan.plan.collectives import link_cost

    # llama3-8B block on 2 ranks: the plan puts two FFN matrices, one 4096² and one 1024×4096
    # on one rank, the rest on the other; the busiest link carries every element in turn with
    # broadcasts, the larger bucket only with one all-gather.
    buckets = [138_412_032, 79_691_776]
    assert link_cost(buckets, 2, "broadcast") == 218_103_808
    assert link_cost(buckets, 2, "gather") == 138_412_032
    assert link_cost(buckets, 4, "gather") == 3 * 138_412_032
    assert link_cost(buckets, 1, "gather") == link_cost([], 4, "broadcast") == 0


@pytest.mark.parametrize(
    "buckets, group_size, expected",
    [
        ([138_412_032, 79_691_776], 2, "gather"),  # 138 M < 218 M on the busiest link
        ([100], 2, "broadcast"),  # one owner: equal traffic, padding would double the buffer
        ([100, 100, 100], 3, "gather"),  # 2 x 100 < 300
        ([100, 60, 60], 3, "gather"),  # 200 < 220
        ([100, 40, 40], 3, "broadcast"),  # 200 > 180
        ([100, 100, 100, 100], 4, "gather"),  # 300 < 400
        ([100, 30, 30, 30], 4, "broadcast"),  # 300 > 190
        ([50, 50], 1, "broadcast"),  # nothing moves on one rank
    ],
)
def test_auto_takes_the_layout_with_less_link_traffic(buckets, group_size, expected):
    from dmuon_titan.plan.collectives import choose_boundary_collectives

    assert choose_boundary_collectives(buckets, group_size, "auto") == expected
    for mode in ("broadcast", "gather"):
        assert choose_boundary_collectives(buckets, group_size, mode) == mode


def test_unknown_boundary_collectives():
    from dmuon_titan.plan.collectives import choose_boundary_collectives

    with pytest.raises(ValueError, match="collectives must be one of .* got 'ring'"):
        choose_boundary_collectives([1], 2, "ring")


def test_boundary_collectives_group_matrices_by_owner_column():
    from dmuon_titan.plan import ParamSpec
    from dmuon_titan.plan.collectives import boundary_collectives
    from dmuon_titan.plan.partition import Plan

    specs = (
        ParamSpec("a.x", (10, 10), "a"),
        ParamSpec("a.y", (10, 6), "a"),
        ParamSpec("b.x", (10, 10), "b"),
        ParamSpec("b.y", (10, 1), "b"),
    )
    # 2 replicas x 2 shards: owners 0..3, column = owner % 2
    plan = Plan(4, specs, owners=(0, 3, 2, 1), costs=(1, 1, 1, 1))
    # a: column 0 holds 100, column 1 holds 60 -> 100 < 160: gather
    # b: column 0 holds 100, column 1 holds 10 -> 100 < 110: gather; on 3 shards not
    assert boundary_collectives(plan, 2, "auto") == {"a": "gather", "b": "gather"}
    assert boundary_collectives(plan, 4, "auto") == {"a": "broadcast", "b": "broadcast"}
    assert boundary_collectives(plan, 2, "broadcast") == {"a": "broadcast", "b": "broadcast"}
    # a: both matrices in column 0 (owners 0 and 2, two replicas): one bucket, broadcast
    one_column = Plan(4, specs, owners=(0, 2, 1, 2), costs=(1, 1, 1, 1))
    assert boundary_collectives(one_column, 2, "auto") == {"a": "broadcast", "b": "gather"}
    # 2 shards x tp 2: slots (shard · 2 + tp), column = (owner // 2) % 2; owners 0 and 1 are
    # both column 0 (one bucket: broadcast), not columns 0 and 1
    tp = Plan(4, specs, owners=(0, 1, 0, 2), costs=(1, 1, 1, 1), tp_size=2)
    assert boundary_collectives(tp, 2, "auto") == {"a": "broadcast", "b": "gather"}


# ---------------------------------------------------------------- expert stacks (3-D)
def test_stack_pieces_are_torch_chunk_cuts():
    import torch

    from dmuon_titan.plan.partition import stack_pieces

    for experts in (1, 2, 4, 7, 8, 64, 256):
        for world in (1, 2, 3, 4, 8, 16):
            pieces = stack_pieces(experts, world)
            assert len(pieces) == world
            assert pieces[0][0] == 0 and pieces[-1][1] == experts
            assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:], strict=False))
            # DTensor's Shard(0) cut: torch.chunk's sizes, then empty pieces.
            sizes = [len(c) for c in torch.arange(experts).chunk(world)]
            assert [b - a for a, b in pieces] == sizes + [0] * (world - len(sizes))


def test_a_64_expert_layer_is_spread_over_every_rank():
    from dmuon_titan.plan.partition import SHARDED

    specs = [
        ParamSpec(f"layers.{i}.moe.experts.{w}", (64, 768, 256), f"layers.{i}")
        for i in range(4)
        for w in ("w1", "w2", "w3")
    ]
    plan = plan_partition(specs, 8)
    assert set(plan.owners) == {SHARDED}
    assert plan.imbalance() == pytest.approx(1.0)  # 8 experts of each stack per rank
    assert orthogonalize_flops((64, 768, 256)) == 64 * ns_flops((768, 256))


def test_stacks_load_the_ranks_before_the_matrices_are_placed():
    # 3 experts on 2 ranks: rank 0 gets 2, rank 1 one; the one matrix goes to rank 1.
    specs = [
        ParamSpec("layers.0.moe.experts.w1", (3, 64, 64), "layers.0"),
        ParamSpec("layers.0.attention.wq", (64, 64), "layers.0"),
    ]
    plan = plan_partition(specs, 2, small_param_numel=0)
    assert plan.owners[1] == 1
    assert plan.load_per_rank() == [2 * ns_flops((64, 64)), 2 * ns_flops((64, 64))]


def test_deepseek_v3_scale_plan_is_quick_and_balanced():
    """58 MoE layers x 256 experts x 3 stacks (DeepSeek-V3-like shapes) and their attention,
    on 64 ranks: planned in well under a second, balanced, each stack one unit."""
    import time

    specs = []
    for i in range(58):
        b = f"layers.{i}"
        specs += [
            ParamSpec(f"{b}.moe.experts.{w}", s, b)
            for w, s in (
                ("w1", (256, 2048, 7168)),
                ("w2", (256, 7168, 2048)),
                ("w3", (256, 2048, 7168)),
            )
        ]
        specs += [
            ParamSpec(f"{b}.attention.wq_b", (24576, 1536), b),
            ParamSpec(f"{b}.attention.wkv_b", (32768, 512), b),
            ParamSpec(f"{b}.attention.wo", (7168, 16384), b),
        ]
    start = time.perf_counter()
    plan = plan_partition(specs, 64)
    assert time.perf_counter() - start < 1.0
    assert plan.imbalance() < 1.05


# ---------------------------------------------------------------------- tp_ns


@pytest.mark.parametrize("dp", [8, 32, 128])
def test_shared_ns_balances_llama3_70b_at_dp_x_tp8(dp):
    """llama3-70B's 560 matrices over dp × 8 slots: whole owners leave slots idle at dp 128
    (imbalance 3.4); sharing each matrix's NS over its owner's tp row balances every layout
    within 1.05. Each row's T slots carry 1/T of each of its matrices; owners inside a row
    are balanced by elements (the masters and momenta they keep), as far as whole matrices
    allow."""
    specs = llama_specs(LLAMA3_70B, 80)
    owner = plan_partition(specs, dp * 8, tp_size=8, tp_ns="owner")
    shared = plan_partition(specs, dp * 8, tp_size=8, tp_ns="shared")
    assert not owner.shared and all(shared.shared)
    assert shared.imbalance() <= 1.05
    if dp == 128:
        assert owner.imbalance() > 3
    loads = shared.load_per_rank()
    for row in range(dp):  # a row's ranks share its work evenly
        assert len(set(loads[row * 8 : (row + 1) * 8])) == 1
    kept, largest = [0] * (dp * 8), [0] * dp
    for spec, slot in zip(shared.specs, shared.owners, strict=True):
        kept[slot] += spec.numel
        largest[slot // 8] = max(largest[slot // 8], spec.numel)
    for row in range(dp):  # (at dp 128 a row has 4-5 matrices for its 8 slots)
        part = kept[row * 8 : (row + 1) * 8]
        assert max(part) <= max(largest[row], 1.3 * sum(part) / 8), (row, part)
    assert sum(loads) == pytest.approx(sum(shared.costs), rel=1e-6)


def test_tp_ns_auto_shares_only_where_it_is_estimated_faster():
    """auto: whole owners while they balance (dp 8 × tp 8) or while the row's m×m traffic
    would cost more than the imbalance (dp 64), shared at dp 128; never without TP."""
    specs = llama_specs(LLAMA3_70B, 80)
    assert not plan_partition(specs, 64, tp_size=8, tp_ns="auto").shared
    assert not plan_partition(specs, 512, tp_size=8, tp_ns="auto").shared
    assert all(plan_partition(specs, 1024, tp_size=8, tp_ns="auto").shared)
    assert not plan_partition(specs, 1024, tp_size=1, tp_ns="shared").shared


def test_shared_ns_is_part_of_the_fingerprint_and_bad_tp_ns_is_named():
    specs = llama_specs(LLAMA3_70B, 2)
    owner = plan_partition(specs, 8, tp_size=2, tp_ns="owner")
    shared = plan_partition(specs, 8, tp_size=2, tp_ns="shared")
    assert owner.fingerprint() != shared.fingerprint()
    with pytest.raises(ValueError, match="unknown tp_ns 'row'"):
        plan_partition(specs, 8, tp_size=2, tp_ns="row")
    with pytest.raises(ValueError, match="tp_size 3 must divide world_size 8"):
        plan_partition(specs, 8, tp_size=3)


def test_shared_batches_are_cut_the_same_on_every_rank(monkeypatch):
    """SharedNewtonSchulz's batches: same-shape matrices of the row in plan order, cut at
    SHARED_BATCH_NUMEL elements of m×m or block per matrix (at least one each)."""
    from types import SimpleNamespace

    from dmuon_titan.runtime import shared_ns

    monkeypatch.setattr(shared_ns, "SHARED_BATCH_NUMEL", 2 * 64 * 64)
    params = [
        SimpleNamespace(
            index=i, shape=shape, shared_ns=True, in_owner_row=True, owner_tp_rank=i % 2
        )
        for i, shape in enumerate([(64, 128)] * 5 + [(256, 64)] * 2 + [(64, 128)])
    ]
    comm = SimpleNamespace(mesh=SimpleNamespace(tp_size=2, tp_rank=0))
    batches = shared_ns.SharedNewtonSchulz(params, comm).batches
    assert [[p.index for p in b] for b in batches] == [[0, 1], [2, 3], [4, 7], [5], [6]]
