"""CONV_LAYOUT_CONVERSION: convolutions fed channels-first (NCHW) tensors on a GPU whose fast
convolution kernels are channels-last (NHWC), so each convolution transposes its input, weight
and output.

Mechanism: on tensor-core GPUs cuDNN's fast convolution kernels (and cuDNN's engines for fp16 and
bf16 on Hopper) work in NHWC. Given PyTorch's default NCHW tensors, cuDNN converts the operands
to NHWC before the kernel and the result back after it, in forward and in both backward passes:
extra kernels that read and write every activation and gradient once more. PyTorch's Performance
Tuning Guide: "use channels_last memory format for computer vision models".

The same layout slows batch norm: ATen's NCHW batch-norm kernels spread their grid over the
channels (64 blocks for 64 channels on 132 SMs), its channels-last kernels over the whole tensor.

Evidence (GPU traces): layout conversion kernels (cuDNN's ``nchwToNhwc`` / ``nhwcToNchw``
families) launched by convolution ops, in at least ``RECURRING_SHARE`` of the steps; with them,
the job's NCHW batch-norm kernels (``at::native::batch_norm*`` families without
``channels_last``).

Fix priced: the conversion kernels and their launches removed; the NCHW batch-norm kernels with
their SM-time spread over every SM (SM_ARRAY_IDLE's work-conserving model, which they leave to
this cause). Measured on the channels pair, the channels-last batch-norm kernels ran 5.8x faster
than the NCHW ones, beyond that model, so the saving is a lower bound.
"""
from __future__ import annotations

import numpy as np

from aiprof.analysis.hotspots import OP
from aiprof.diagnosis.causes import idle_sms
from aiprof.diagnosis.causes.common import drop_kernels, ms
from aiprof.diagnosis.detector import Detector, Scope
from aiprof.diagnosis.facts import RankFacts
from aiprof.diagnosis.kernel_ops import kernel_ops
from aiprof.diagnosis.model import SLOW_KERNELS, Cause, Claim, Place

CODE = "CONV_LAYOUT_CONVERSION"
#: cuDNN's layout transposes around a convolution (lower-cased kernel-name fragments)
CONVERSION_WORDS = ("nchwtonhwc", "nhwctonchw")
#: ops that run convolutions: forward and backward
CONV_OPS = ("aten::cudnn_convolution", "aten::convolution", "aten::_convolution", "aten::conv2d", "aten::conv3d",
            "aten::conv1d", "aten::convolution_backward", "aten::cudnn_convolution_backward")
#: conversions in at least this share of the steps: the model's layout, not a one-off
RECURRING_SHARE = 0.5
#: conversions under at least this share of the convolution calls: the model's layout (a
#: channels_last model still has a converted 3-channel stem: 2 of ~60 calls a step, 0.7 %)
MIN_CONVERTED_SHARE = 0.5
#: ATen's batch-norm kernels; their channels-last versions carry this in their names
BATCH_NORM_WORD = "batch_norm"
CHANNELS_LAST_WORD = "channels_last"


def conversions(f: RankFacts) -> np.ndarray:
    """Mask over graph ops: layout conversion kernels launched under a convolution op."""
    g = f.graph
    out = np.zeros(g.n_ops, dtype=bool)
    if not g.n_ops:
        return out
    ko = kernel_ops(f)
    fam = ko.family_mask(lambda x: any(w in x.lower() for w in CONVERSION_WORDS))
    if not fam.any():
        return out
    conv_nodes = f.node_mask(lambda s: s in CONV_OPS, (OP,))
    under_conv = f.under(conv_nodes)
    ok = ko.op_node >= 0
    out[ok] = fam[ok] & under_conv[ko.op_node[ok]]
    return out


def nchw_batch_norm(f: RankFacts) -> np.ndarray:
    """Mask over graph ops: ATen's channels-first batch-norm kernels."""
    ko = kernel_ops(f)
    return ko.family_mask(lambda x: BATCH_NORM_WORD in x and CHANNELS_LAST_WORD not in x)


def detect(f: RankFacts) -> list[Cause]:
    if not f.has_gpu:
        return []
    conv = conversions(f)
    if not conv.any():
        return []
    g = f.graph
    ko = kernel_ops(f)
    calls = f.node_mask(lambda s: s in ("aten::cudnn_convolution", "aten::convolution_backward"), (OP,))
    converted = np.zeros(len(f.tree), dtype=bool)
    conv_calls = f.tree.nearest(ko.op_node[conv], OP)  # the innermost op: cudnn's own call
    for node in set(conv_calls.tolist()):
        for a in f.tree.ancestors(node):
            if calls[a]:
                converted[a] = True
                break
    if converted.sum() < MIN_CONVERTED_SHARE * max(int(calls.sum()), 1):
        return []
    starts = g.o_ts[conv]
    idx = f.steps.index_of(starts)
    steps = sorted({int(f.steps.number[i]) for i in idx[idx >= 0]})
    if len(steps) < max(1, RECURRING_SHARE * len(f.steps)):
        return []
    e = f.edit(CODE)
    drop_kernels(e, g, conv)
    bn = nchw_batch_norm(f)
    fill = idle_sms.grid_fill(f)
    bn &= ~np.isnan(fill)
    if bn.any():
        e.op_dur[bn] = idle_sms.spread_durations(f, bn, np.minimum(fill[bn], 1.0))
    region = np.zeros(len(f.tree), dtype=bool)
    nodes = ko.op_node[bn]
    region[nodes[nodes >= 0]] = True
    per = f.n_steps
    ns = float(g.o_dur[conv].sum())
    bn_ns = float(g.o_dur[bn].sum())
    bn_saved = bn_ns - float(e.op_dur[bn].sum()) if bn.any() else 0.0
    # the conversion family that took the most time (the first such family on a tie)
    top = ko.family_labels[int(np.argmax(np.bincount(ko.family_code[conv], weights=g.o_dur[conv],
                                                     minlength=len(ko.family_labels))))]
    return [Cause(
        code=CODE, rank=f.rank,
        title=(f"{ms(ns / per)} per step in {int(conv.sum()) / per:.0f} layout conversions around convolutions "
               f"(NCHW tensors transposed to NHWC and back, e.g. {top.rsplit('::', 1)[-1]})"
               + (f", and {ms(bn_ns / per)} in channels-first batch-norm kernels" if bn.any() else "")),
        mechanism=("The GPU's fast convolution kernels work on channels-last (NHWC) tensors; given PyTorch's default "
                   "channels-first (NCHW) ones, cuDNN transposes the operands before each convolution and the result "
                   "after it, in forward and backward: one more pass over every activation and gradient."),
        remedy=("Use the channels_last memory format: model = model.to(memory_format=torch.channels_last) and each "
                "input batch x = x.to(memory_format=torch.channels_last) (PyTorch Performance Tuning Guide: "
                "channels_last for computer vision models)."),
        place=Place("op", "aten::cudnn_convolution", "", [], steps),
        evidence={"conversion_kernels": int(conv.sum()), "conversions_per_step": int(conv.sum()) / per,
                  "conversion_us_per_step": ns / per / 1e3, "kernel_family": top,
                  "nchw_batch_norm_kernels_per_step": int(bn.sum()) / per,
                  "nchw_batch_norm_us_per_step": bn_ns / per / 1e3},
        edit=e, region=f.under(region), claims=[Claim(SLOW_KERNELS, f.rank, (ns + bn_saved) / 1e3)])]


DETECTOR = Detector(CODE, Scope.RANK, reads=("graph", "rt", "steps", "tree"), detect=detect)
