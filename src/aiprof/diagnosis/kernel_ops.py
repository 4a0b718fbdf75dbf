"""Per GPU op of the replay graph: the host op that launched it and what the op's recorded shapes
say about it (its largest input, in elements and bytes), and, for an op run by autograd's
backward, the forward op it differentiates. Shared by the detectors of GPU-kernel mechanisms
(unfused elementwise chains, eager attention); computed once per rank and kept in ``f.extra``."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from aiprof import npx
from aiprof.analysis.hotspots import OP
from aiprof.analysis.kernels import kernel_family
from aiprof.analysis.rankdiff import parse_dims
from aiprof.analysis.roofline import DTYPE_BYTES
from aiprof.diagnosis.facts import RankFacts

#: autograd's backward functions are recorded as ops named after their node ("MulBackward0"),
#: with the sequence number of the forward op that created the node
BACKWARD_SUFFIXES = ("Backward0", "Backward1", "Backward2")


def _is_backward(name: str) -> bool:
    """A backward function's op. One function, not a lambda per call: RankFacts.node_mask keys
    its cache by the predicate, and backward_node_seq is called once per chain and site."""
    return name.endswith(BACKWARD_SUFFIXES)


@dataclass
class KernelOps:
    """Arrays per graph op (GPU op of the replay graph, in launch order)."""

    op_node: np.ndarray  # tree node of the innermost host op that launched it (-1: none)
    numel: np.ndarray  # elements of that op's largest tensor input (0: unknown)
    nbytes: np.ndarray  # bytes of that input
    family_code: np.ndarray  # per graph op, its kernel family's index in family_labels
    family_labels: list[str]  # the distinct families; "" (memory ops, no kernel) is code 0

    def family_mask(self, pred: Callable[[str], bool]) -> np.ndarray:
        """Graph ops whose kernel family satisfies ``pred``: asked once per distinct family (a
        rank has a few hundred families for tens of thousands of ops). A new array each call."""
        ok = np.array([bool(pred(x)) for x in self.family_labels] + [False], dtype=bool)
        return ok[self.family_code]


def largest_input(dims: str, types: str) -> tuple[int, int]:
    """(elements, bytes) of the largest tensor input of an op call recorded with shapes."""
    best, item = 0, 0
    for d, t in zip(parse_dims(dims), parse_dims(types)):
        if not isinstance(d, list) or not d or not all(isinstance(x, int) for x in d):
            continue
        n = int(np.prod(d, dtype=np.int64))
        if n > best:
            best, item = n, DTYPE_BYTES.get(t, 0) if isinstance(t, str) else 0
    return best, best * item


def kernel_ops(f: RankFacts) -> KernelOps:
    """The launching op of every graph op, with its largest input (see the module docstring)."""
    got = f.extra.get("_kernel_ops")
    if got is not None:
        return got
    g, t, o = f.graph, f.tree, f.rt.ops
    n = g.n_ops
    node = np.full(n, -1, np.int64)
    if n:
        an = f.action_nodes()[g.o_action]
        node = t.nearest(an, OP) if len(t) else node
    numel = np.zeros(n, np.int64)
    nbytes = np.zeros(n, np.int64)
    ok = node >= 0
    if ok.any() and len(o) and "input_dims" in o and "input_types" in o:
        rows = t.row[node[ok]]
        dims, types = o.strings("input_dims"), o.strings("input_types")
        ux, uy, inv = npx.unique_pairs(dims.codes[rows], types.codes[rows])
        sizes = np.array([largest_input(dims.labels[a], types.labels[b]) for a, b in zip(ux.tolist(), uy.tolist())],
                         dtype=np.int64).reshape(-1, 2)
        numel[ok] = sizes[inv, 0]
        nbytes[ok] = sizes[inv, 1]
    # families per distinct kernel name (a rank has tens of thousands of ops, a few hundred names);
    # memory ops and ops without a kernel are family "" (code 0)
    index = {"": 0}
    code = np.zeros(n, np.int64)
    k = f.rt.kernels
    if n and len(k):
        names = k.strings("name")
        kern = np.nonzero(g.o_table == 0)[0]
        uniq, inv = np.unique(names.codes[g.o_row[kern]], return_inverse=True)
        fam = [index.setdefault(kernel_family(names.labels[c]), len(index)) for c in uniq.tolist()]
        code[kern] = np.asarray(fam, np.int64)[inv]
    got = f.extra["_kernel_ops"] = KernelOps(node, numel, nbytes, code, list(index))
    return got


def forward_of(f: RankFacts) -> dict[int, int]:
    """Sequence number -> the forward op node that recorded it (the outermost op carrying it on
    the thread that ran forward), for linking backward functions to their forward ops."""
    got = f.extra.get("_forward_of")
    if got is not None:
        return got
    t, o = f.tree, f.rt.ops
    out: dict[int, int] = {}
    if len(t) and len(o) and "seq" in o:
        ops = np.nonzero(t.kind == OP)[0]
        seq = o["seq"][t.row[ops]]
        keep = (seq >= 0) & ~f.node_mask(_is_backward, (OP,))[ops]
        ops, seq = ops[keep], seq[keep]
        # each sequence number's first op in tree order (outermost first), in that order
        uniq, first = np.unique(seq, return_index=True)
        by_first = np.argsort(first, kind="stable")
        out = dict(zip(uniq[by_first].tolist(), ops[first[by_first]].tolist()))
    f.extra["_forward_of"] = out
    return out


def backward_node_seq(f: RankFacts, nodes: np.ndarray) -> np.ndarray:
    """For each tree node: the sequence number of the backward function it runs under (its
    nearest ancestor op named ``...BackwardN``), -1 outside backward."""
    t, o = f.tree, f.rt.ops
    out = np.full(len(nodes), -1, np.int64)
    if not len(t) or not len(o) or "seq" not in o:
        return out
    is_bw = f.node_mask(_is_backward, (OP,))
    cur = np.asarray(nodes, np.int64).copy()
    active = cur >= 0
    while active.any():
        idx = np.nonzero(active)[0]
        hit = is_bw[cur[idx]]
        out[idx[hit]] = o["seq"][t.row[cur[idx[hit]]]]
        nxt = t.parent[cur[idx]]
        cur[idx] = nxt
        active[idx] = ~hit & (nxt >= 0)
    return out
