"""Inference batches in slices: a graph on one device computing its batch a few images
at a time, each slice through the whole network before the next begins.

A batch's activations outgrow the caches: squeezenet1_1's first layer makes 3.2 MB an
image, 101 MB at batch 32, so every layer of the batched graph reads its input from
memory and writes its output there, while a slice of four images keeps them in the
last-level cache from one layer to the next. The slices are `microbatch`'s unrolled
graph (the data-parallel analysis over a group of slices: each batch-dependent node
once per slice, the outputs concatenated), with two changes for one device: a
broadcast that the analysis made whole and then sliced (a batch norm's per-channel
factors broadcast to the batch's shape) is made at the slice's shape, so it still
fuses into its readers; and the nodes run slice by slice (`_slice_by_slice`), not
layer by layer across the slices, which would find no more in the cache than the
batched graph (squeezenet1_1 in 8 slices, against the whole batch in the same run:
layer by layer 0.95 of its time, slice by slice 0.88).

Slices pay where layers wait on memory (1x1 convolutions of few channels, depthwise
ones, pools); a network whose convolutions are compute-bound gains little, and reads
its weights again for every slice (`slice_count` estimates both). On the 2-core Zen 4
(32 MB of L3), batch 32, whole against sliced: squeezenet1_1 (8 slices) 146 -> 128
ms, mobilenet_v2 (16) 149 -> 138; left whole, googlenet (level in slices) and
resnet18 (4% slower in slices of 3: its 47 MB of weights read again for each).
"""

from __future__ import annotations

from purinec.errors import PurinecError
from purinec.ir.graph import Graph, Node, Value, stable_topological_order
from purinec.ir.ops import FusionKind, Trait, get_op, op_has
from purinec.passes.cost import FLOPS_PER_BYTE, node_flops
from purinec.passes.parallel.pipeline import batch_sizes, microbatch
from purinec.passes.simplify import dce


def batch(graph: Graph) -> int | None:
    """The batch of ``graph``'s data inputs: the leading size they share, or None."""
    sizes = batch_sizes(graph)
    return sizes.pop() if len(sizes) == 1 else None


# Slices are taken where they would cut the estimated time (`_estimate`) to this share
# of the whole batch's or less. Estimates against measurements at batch 32 (2-core Zen 4,
# slices of 4, or 2 for mobilenet_v2): squeezenet1_1 0.82 (0.87 measured), mobilenet_v2
# 0.81 (0.93), googlenet 0.94 (level), resnet18 0.99 (1.04: its 47 MB of weights are
# read again for every slice).
WORTH_IT = 0.9


def slice_count(graph: Graph, budget: int) -> int:
    """How many slices ``graph``'s batch takes so that a slice's largest value (of
    those with the batch as their leading size) fits in ``budget`` bytes, where that
    is worth it (`WORTH_IT`); else 1."""
    images = batch(graph)
    if images is None or images < 2 or budget <= 0:
        return 1
    per_image = max((v.type.nbytes // images for node in graph.nodes for v in node.outputs
                     if v.type.rank and v.type.shape[0] == images), default=0)
    at_once = max(1, budget // per_image) if per_image else images
    count = -(-images // at_once)
    worth_it = count > 1 and _estimate(graph, count) <= WORTH_IT * _estimate(graph, 1)
    return count if worth_it else 1


def _estimate(graph: Graph, count: int) -> int:
    """The time of ``graph`` in ``count`` slices, in FLOP-equivalents (`node_work`'s
    rate): over the nodes that read and write memory (elementwise ones fuse into them),
    each node's FLOPs or its traffic, whichever is larger; whole (one slice), every
    value it reads and writes goes through memory, in slices only its weights, once a
    slice."""
    weights = {v for v in graph.inputs if v.role in ("param", "state")}
    total = 0
    for node in graph.nodes:
        op = get_op(node.op)
        if op.fusion < FusionKind.injective or op.has(Trait.view):
            continue
        weight_bytes = sum(v.type.nbytes for v in node.inputs if v in weights)
        traffic = (sum(v.type.nbytes for v in (*node.inputs, *node.outputs))
                   if count == 1 else count * weight_bytes)
        total += max(node_flops(node), FLOPS_PER_BYTE * traffic)
    return total


def in_slices(graph: Graph, count: int) -> Graph:
    """``graph``, an inference graph on one device, computing its batch in ``count``
    slices one after another (see the module's notes). As it is where ``count`` is 1;
    where it is laid out over devices or communicates; where an output is not one row
    per image (a loss over the batch would come out of the slices' partial sums, added
    in another order); or where the analysis cannot cut its batch."""
    images = batch(graph)
    if (count <= 1 or len(graph.devices()) > 1
            or any(op_has(node.op, Trait.communicates) for node in graph.nodes)
            or not all(v.type.rank and v.type.shape[0] == images for _, v in graph.outputs)):
        return graph
    try:
        sliced = microbatch(graph, count)
    except PurinecError:
        return graph
    return _slice_by_slice(dce(_broadcasts_sliced(sliced)))


def _broadcasts_sliced(graph: Graph) -> Graph:
    """Each slice of a broadcast along one of its broadcast axes made by a broadcast to
    the slice's shape (the whole one then has no reader)."""
    new = graph.clone()
    producer = {v: node for node in new.nodes for v in node.outputs}
    for node in new.nodes:
        source = producer.get(node.inputs[0]) if node.op == "slice" else None
        if source is not None and source.op == "broadcast_to" and \
                _broadcast_along(source, node.attrs["axis"]):
            node.op, node.inputs = "broadcast_to", list(source.inputs)
            node.attrs = {"shape": list(node.outputs[0].type.shape)}
    return new


def _broadcast_along(broadcast: Node, axis: int) -> bool:
    """Whether ``broadcast`` repeats its input along ``axis`` of its output."""
    x = broadcast.inputs[0].type
    lead = len(broadcast.attrs["shape"]) - x.rank
    return axis < lead or x.shape[axis - lead] == 1


def _slice_by_slice(graph: Graph) -> Graph:
    """``graph``'s nodes ordered slice by slice: a node belongs to the latest slice it
    reads (the k-th slice of each data input is slice k), or to none before them all."""
    new = graph.clone()
    index = {v: i for i, node in enumerate(new.nodes) for v in node.outputs}
    slices_of: dict[Value, int] = {}  # a data input's slices made so far
    slice_of: list[int] = []
    after: list[list[int]] = [[] for _ in new.nodes]
    for i, node in enumerate(new.nodes):
        producers = [index[v] for v in node.inputs if v in index]
        for producer in producers:
            after[producer].append(i)
        if node.op == "slice" and not producers:
            source = node.inputs[0]
            slice_of.append(slices_of.get(source, 0))
            slices_of[source] = slice_of[-1] + 1
        else:
            slice_of.append(max((slice_of[p] for p in producers), default=-1))
    order = stable_topological_order([(slice_of[i], i) for i in range(len(new.nodes))],
                                     after)
    new.nodes = [new.nodes[i] for i in order]
    return new
