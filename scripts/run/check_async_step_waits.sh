#!/usr/bin/env bash
# On one GPU: the async-step test (tests/distributed/test_gpu_one.py) as it is, then once per
# wait that Muon(async_step=True) relies on, with that wait taken out of a scratch copy of the
# package. The first run must pass and every other must fail; prints one line per run. Run
# from a checkout whose files it may change (they are restored at the end).
set -uo pipefail
cd "$(dirname "$0")/../.."
T=tests/distributed/test_gpu_one.py::test_the_asynchronous_step_is_waited_for_by_everything_that_reads_it
run() { echo "$1: $(python3 -m pytest -q "$T" -p no:cacheprovider 2>&1 | tail -1)"; }
files=(dmuon_titan/runtime/state.py dmuon_titan/optim/muon.py dmuon_titan/optim/captured.py
       dmuon_titan/state_dict.py)
for f in "${files[@]}"; do cp "$f" "$f.orig"; done
restore() { for f in "${files[@]}"; do cp "$f.orig" "$f"; done; }
cut() {  # cut FILE OLD NEW: replace every OLD by NEW (OLD must be there)
  python3 -c "import sys; p,a,b=sys.argv[1:]; s=open(p).read(); assert a in s, a; open(p,'w').write(s.replace(a,b))" "$@"
}
run "as it is (must pass)"
cut dmuon_titan/runtime/state.py "        if self.direct:
            self.wait_for_step()
            return" "        if self.direct:
            return"
cut dmuon_titan/runtime/state.py "            self.wait_for_step()
            if self.step_waits_armed" "            if self.step_waits_armed"
run "forwards do not wait, the root's nor the boundaries' (must fail)"; restore
cut dmuon_titan/optim/muon.py "        if not set_to_none:
            self.step_graph.wait()
" ""
run "zero_grad in place does not wait (must fail)"; restore
cut dmuon_titan/optim/captured.py "        self._held = [p.grad for p in params]" "        self._held = []"
run "a replay's gradients are not held until the next wait (must fail)"; restore
cut dmuon_titan/runtime/state.py "        hooks.register_state_dict_waits(self.root, self.wait_for_step)" ""
run "model.state_dict() does not wait (must fail)"; restore
cut dmuon_titan/state_dict.py "    optimizer.step_graph.wait()  # (a step in flight still writes its state)" ""
run "optimizer state-dict function does not wait (must fail)"; restore
cut dmuon_titan/runtime/state.py "    def wait_all_replicate_broadcasts(self) -> None:
        self.wait_for_step()" "    def wait_all_replicate_broadcasts(self) -> None:"
run "wait_all_replicate_broadcasts does not wait (must fail)"; restore
for f in "${files[@]}"; do rm "$f.orig"; done
