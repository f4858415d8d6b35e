"""Which checkpoint keys a change of ``[dmuon] params`` explains (torchtitan adapter)."""

from dmuon_titan.titan.checkpoint import _parameter_of, _saved_by_dmuon, moved_since_save

FQNS = ["layers.0.w", "layers.0.w_gate", "norm.weight", "layers.1.w"]


def test_optimizer_keys_map_to_the_longest_matching_parameter():
    assert _parameter_of("optimizer.state.layers.0.w_gate.exp_avg", FQNS) == "layers.0.w_gate"
    assert _parameter_of("optimizer.state.layers.0.w.momentum_buffer", FQNS) == "layers.0.w"
    assert _parameter_of("optimizer.param_groups.norm.weight.lr", FQNS) == "norm.weight"
    assert _parameter_of("layers.0.w", FQNS) is None  # a model key
    assert _parameter_of("optimizer.state.gone.exp_avg", FQNS) is None


def test_moves_between_muon_and_adamw_are_read_from_the_saved_keys():
    saved = {
        "optimizer.state.layers.0.w.momentum_buffer",  # was Muon
        "optimizer.state.layers.0.w_gate.exp_avg",  # was AdamW
        "optimizer.state.layers.1.w.momentum_buffer",  # was Muon
        "optimizer.state.norm.weight.exp_avg",
        "optimizer.param_groups.layers.0.w.use_muon",
    }
    # now: layers.0.w on AdamW, layers.0.w_gate and layers.1.w on Muon
    to_muon, to_adamw = moved_since_save(saved, FQNS, {"layers.0.w_gate", "layers.1.w"})
    assert to_muon == ["layers.0.w_gate"] and to_adamw == ["layers.0.w"]
    assert moved_since_save(saved, FQNS, {"layers.0.w", "layers.1.w"}) == ([], [])
    assert _saved_by_dmuon(saved)
    assert not _saved_by_dmuon(saved - {"optimizer.param_groups.layers.0.w.use_muon"})
