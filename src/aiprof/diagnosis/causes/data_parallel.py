"""DATA_PARALLEL: ``torch.nn.DataParallel`` drives several GPUs from one process.

Mechanism: DataParallel runs in one process. Every step it copies the model to every GPU
(``replicate``: a broadcast of every parameter and buffer), splits the batch (``scatter``), runs
the replicas' forwards in one Python thread per GPU, which take turns on the GIL so that one host
dispatches and launches for all the GPUs, gathers the outputs on the first GPU and, in backward,
sums every replica's gradients there (``ReduceAddCoalesced``). DistributedDataParallel runs one
process per GPU: each host launches for its own GPU only, the parameters stay in place, and the
gradients are all-reduced while the backward pass runs. PyTorch's Performance Tuning Guide: use
DistributedDataParallel instead of DataParallel.

Evidence: DataParallel's autograd functions among the ops (``Broadcast``, the replication, and
``Gather``) in at least half of the steps, and kernels on at least two GPUs in this process.

Fix priced by the replay, which keeps each GPU's streams apart: every GPU's kernels as this trace
ran them, DataParallel's own copies (broadcast, scatter, gather and the gradients' reduce, forward
and backward) gone, and the host out of the way: its time removed, the step no shorter than this
process's host work per step spread over one process per GPU. The two approximations pull apart:
DDP's gradient all-reduce, which overlaps the backward pass, is not added (its exposed tail would
lower the saving); DataParallel's host work divided by the GPUs still holds the replication and the
threads' contention for the GIL, which DDP does not have (the v3b pair: 77.1 % predicted, 88.6 %
measured).
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.diagnosis.causes.common import biggest_node, ms, site_and_stack, steps_with
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.model import GPU_IDLE, Cause, Claim, Place

CODE = "DATA_PARALLEL"
#: torch.nn.parallel._functions' autograd functions, recorded as ops under these names: the
#: replication (Broadcast), the outputs' gather and the inputs' scatter, the gradients' sum, and
#: the backward functions of the first two
_REPLICATE, _GATHER = "Broadcast", "Gather"
_DP_FUNCTIONS = frozenset({"Broadcast", "Gather", "Scatter", "ReduceAddCoalesced", "BroadcastBackward",
                           "GatherBackward", "ScatterBackward", "ReduceAddCoalescedBackward"})
_BACKWARD_PREFIX = "autograd::engine::evaluate_function: "
#: DataParallel's functions in at least this share of the steps: it wraps the training loop's model
RECURRING_SHARE = 0.5
#: a process whose kernels run on fewer GPUs is no multi-GPU DataParallel (one GPU: it only calls
#: the module)
MIN_GPUS = 2


def _gpus(f: RankFacts) -> int:
    k = f.rt.kernels
    return len(np.unique(np.asarray(k["device"]))) if len(k) and "device" in k else 0


def _functions(f: RankFacts) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tree masks of DataParallel's function ops: all of them, the replications, the gathers."""
    def name(s: str) -> str:
        return s.removeprefix(_BACKWARD_PREFIX)
    every = f.node_mask(lambda s: name(s) in _DP_FUNCTIONS, (OP,))
    return every, f.node_mask(lambda s: s == _REPLICATE, (OP,)), f.node_mask(lambda s: s == _GATHER, (OP,))


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu or not f.graph.n_ops:
        return []
    gpus = _gpus(f)
    if gpus < MIN_GPUS:
        return []
    every, replicate, gather = _functions(f)
    need = max(1, RECURRING_SHARE * len(f.steps))
    if len(steps_with(f, replicate)) < need or len(steps_with(f, gather)) < need:
        return []
    g = f.graph
    e = f.edit(CODE)
    copies = f.actions_in(f.under(every))
    e.drop_op |= copies[g.o_action]
    e.gap_remove += np.maximum(g.gap, 0.0)
    e.cost_remove += g.cost
    per = f.n_steps
    host_ns = float(np.maximum(g.gap, 0.0).sum() + g.cost.sum()) / per
    e.min_step_ns = host_ns / gpus
    dropped = float(g.o_dur[e.drop_op].sum()) / per
    node = biggest_node(f, replicate)
    site, stack = site_and_stack(f, node)
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"torch.nn.DataParallel drives {gpus} GPUs from one process"
               f"{' at ' + site if site else ''}: the model replicated every step, one host launching "
               f"for all of them ({ms(host_ns)} of host work per step)"),
        mechanism=("DataParallel copies the model to every GPU each step, runs the replicas' forwards in Python "
                   "threads that take turns on the GIL, gathers the outputs on the first GPU and sums the gradients "
                   "there; one process dispatches and launches for every GPU."),
        remedy=("Use DistributedDataParallel, one process per GPU: launch with `torchrun --nproc-per-node "
                f"{gpus}`, call `dist.init_process_group(\"nccl\")` and `torch.cuda.set_device(local_rank)`, wrap "
                "`DDP(model.to(local_rank), device_ids=[local_rank])`, and give each rank its share of the data "
                "(DistributedSampler). PyTorch Performance Tuning Guide: DistributedDataParallel instead of "
                "DataParallel."),
        place=Place("python" if site else "op", site or "torch.nn.DataParallel", site, stack),
        evidence={"gpus": gpus, "host_us_per_step": host_ns / 1e3, "dp_copies_us_per_step": dropped / 1e3,
                  "replications_per_step": int(replicate.sum()) / per},
        edit=e, claims=[Claim(GPU_IDLE, f.rank, float(f.gaps.dur.sum()) / 1e3)] if len(f.gaps.dur) else [])]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect)
