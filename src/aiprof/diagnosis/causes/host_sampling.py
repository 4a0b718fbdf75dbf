"""HOST_SAMPLING: the logits are copied to the host and the next token is sampled there.

Mechanism: copying a [sequences, vocabulary] logits tensor to the host each iteration moves
megabytes over PCIe and blocks until the forward is done; the sampling (softmax, top-k,
multinomial, in torch on the CPU or in numpy) then runs on the host before the next launch,
while the GPU waits. Sampling on the GPU copies only the token ids (a few bytes per sequence).

Evidence: device-to-host copies of at least one row of logits (the vocabulary × 2 bytes) in at
least half of the model's iterations; the host sampling ops (no GPU work below them) after them.
Fix priced: each such copy moves only the token ids (8 bytes per row: its time scaled by the
bytes, never below the trace's fastest device-to-host copy), and the host sampling ops' time goes
(a GPU argmax/multinomial is a few microseconds of GPU work).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.diagnosis.causes import serving_common as sc
from aiprof.diagnosis.causes.common import (
    idle_claim,
    ms,
    site_and_stack,
    torch_work_below,
)
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import Cause, Place

CODE = "HOST_SAMPLING"
# Copies in at least this share of the model's iterations make the pattern (not a one-off read).
MIN_ITERATION_SHARE = 0.5
_SAMPLING = ("aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::topk", "aten::multinomial", "aten::argmax",
             "aten::sort", "aten::cumsum", "aten::exponential_", "aten::div", "aten::where")
TOKEN_ID_BYTES = 8


def detect(f: RankFacts) -> list[Cause]:
    sv = sc.serving(f)
    g = f.graph
    m = f.rt.memops
    if sv is None or not f.has_gpu or not g.n_ops or not len(m) or sv.vocab <= 0:
        return []
    names = m.strings("name")
    d2h = np.array(["DtoH" in s or "Device -> Pageable" in s or "Device -> Pinned" in s for s in names.labels] + [False])
    mem = np.nonzero(g.o_table == 1)[0]
    nbytes = np.zeros(g.n_ops)
    nbytes[mem] = np.maximum(m["bytes"][g.o_row[mem]], 0)
    is_d2h = np.zeros(g.n_ops, dtype=bool)
    is_d2h[mem] = d2h[names.codes[g.o_row[mem]]]
    big = is_d2h & (nbytes >= 2 * sv.vocab)
    if not big.any():
        return []
    busy = ~sc.step_mask(f, ("idle",))
    st = f.steps.index_of(g.a_ts[g.o_action[big]])
    with_copy = np.unique(st[st >= 0])
    win_busy = busy & np.isin(f.steps.number, g.step_number)
    if len(with_copy) < MIN_ITERATION_SHARE * max(int(win_busy.sum()), 1):
        return []
    e = f.edit(CODE)
    floor = float(g.o_dur[is_d2h].min())
    rows = np.maximum(nbytes[big] / (2 * sv.vocab), 1)
    e.op_dur[big] = np.maximum(g.o_dur[big] * np.minimum(1.0, rows * TOKEN_ID_BYTES / nbytes[big]), floor)
    # host sampling ops that launched nothing, in the iterations with a logits copy
    tree = f.tree
    steps = np.zeros(len(f.steps), dtype=bool)
    steps[with_copy] = True
    host_ops = (f.node_mask(lambda s: s in _SAMPLING, (OP,)) & ~torch_work_below(f) & sc.nodes_in(f, steps)
                if len(tree) else np.zeros(0, dtype=bool))
    if host_ops.any():
        e.gap_remove += f.gap_time_in(f.union_of_nodes(host_ops))
    acts = np.unique(g.o_action[big])
    node = int(f.action_nodes()[acts[0]]) if len(acts) else -1
    site, stack = site_and_stack(f, node)
    region = f.under(np.isin(np.arange(len(tree)), f.action_nodes()[acts])) | (f.under(host_ops) if len(tree) else host_ops)
    per = max(len(with_copy), 1)
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"the logits go to the host every iteration: {int(big.sum()) / per:.0f} copies of "
               f"{nbytes[big].sum() / per / 1e6:.1f} MB per iteration ({ms(float(g.o_dur[big].sum()) / per)}), "
               f"then {int(host_ops.sum())} sampling op(s) run on the CPU"),
        mechanism=("Copying [sequences, vocabulary] logits to the host blocks until the forward is done and moves "
                   "megabytes; sampling on the CPU then delays the next launch while the GPU waits."),
        remedy=(f"Sample on the GPU and copy only the token ids: torch.argmax / torch.multinomial on the device logits "
                f"(the logits processors too), then next_tokens.cpu() or a non-blocking copy, at {site or 'the copy'}."),
        place=Place("python" if site else "op", "logits copy to host", site, stack),
        evidence={"copies": int(big.sum()), "bytes_per_iteration": float(nbytes[big].sum() / per),
                  "copy_us_per_iteration": float(g.o_dur[big].sum()) / per / 1e3, "host_sampling_ops": int(host_ops.sum()),
                  "vocab": sv.vocab},
        edit=e, region=region, claims=idle_claim(f, region))]


DETECTOR = Detector(CODE, Scope.RANK, reads=("extra", "graph", "has_gpu", "rt", "steps", "tree"), detect=detect)
