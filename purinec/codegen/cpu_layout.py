"""The cpu target's choice of operand layouts: convolutions of small maps in inference
graphs computed pixel by filter, from weights rearranged into panels of filters
(`filters_in_panels`)."""

from __future__ import annotations

from purinec.codegen.cpu_conv import pixel_major_gain
from purinec.codegen.cpu_runtime import tiled_gemm_wanted
from purinec.ir.graph import Graph, Node, Value, updated_variables
from purinec.ir.types import DType

# Filters a panel, the first of these that divides a layer's filters: an AVX-512 tile's
# width (`cpu_gemm.NW`; four tiles with AVX2), or the widest tile's (`cpu_gemm.NV_LAST`
# vectors), or three vectors. The same on every machine, so that an artifact's IR is.
PANEL_WIDTHS = (64, 80, 48)
# A convolution turns pixel-major where that uses this much more of its tiles' lanes
# (`pixel_major_gain`), less what transposing each block's sums into the output costs
# (2-4% of the product): 7x7, 14x14 and 28x28 maps gain 1.3, 1.14 and 1.07 with a 3x3
# kernel; 56x56 1.04. resnet18's 3x3 layers of 28x28 took 0.90-0.94 of their time
# pixel by filter at batch 1 and 32 (alternating traces); googlenet's level.
PIXEL_MAJOR_MIN_GAIN = 1.05
# ... and has this many input channels: with fewer its taps are few, the layer cheap.
PIXEL_MAJOR_MIN_CHANNELS = 16


def filters_in_panels(graph: Graph) -> Graph:
    """``graph`` with each conv2d that `_pixel_major` picks computed as a conv2d_panels
    of its weight rearranged into panels of filters (`panel_width`), (O/V, C, kh, kw,
    V), where ``graph`` is an inference graph and products go to
    `purinec.codegen.cpu_gemm.tiled_sgemm` (`tiled_gemm_wanted`). The rearranging reads
    parameters alone, so a program runs it once and again only after the weights change
    (`purinec.program`'s weight-only part); a training iteration would run it at every
    step, and is left as it is."""
    if not tiled_gemm_wanted() or updated_variables(graph):
        return graph
    new = graph.clone()
    params = set(new.inputs_with_role("param"))
    in_panels: dict[Value, Value] = {}
    nodes = []
    for node in new.nodes:
        if node.op == "conv2d" and node.inputs[1] in params and _pixel_major(node):
            w = node.inputs[1]
            if w not in in_panels:
                made = _panels(new, node, w)
                nodes += made
                in_panels[w] = made[-1].outputs[0]
            node.op, node.inputs = "conv2d_panels", [node.inputs[0], in_panels[w]]
        nodes.append(node)
    new.nodes = nodes
    return new


def _pixel_major(node: Node) -> bool:
    x, w = node.inputs
    filters, channels = w.type.shape[:2]
    return (node.attrs["groups"] == 1 and x.type.dtype is DType.f32
            and panel_width(filters) is not None and channels >= PIXEL_MAJOR_MIN_CHANNELS
            and pixel_major_gain(node) >= PIXEL_MAJOR_MIN_GAIN)


def panel_width(filters: int) -> int | None:
    """The filters of a panel (`PANEL_WIDTHS`) for a layer of ``filters``, two panels
    or more (threads split one layer's few rows by filters: one panel of 48 filters
    went to them as two vectors and one, 10-30% slower than filter by pixel); None: no
    width fits."""
    return next((width for width in PANEL_WIDTHS
                 if filters % width == 0 and filters >= 2 * width), None)


def _panels(graph: Graph, conv: Node, w: Value) -> list[Node]:
    """The nodes rearranging ``w`` (O, C, kh, kw) into panels (`panel_width`)."""
    filters, channels, kh, kw = w.type.shape
    width = panel_width(filters)
    split = graph.make_node("reshape", [w], {"shape": [filters // width, width, channels,
                                                       kh, kw]},
                            names=[graph.fresh_name(f"{w.name}.filters")],
                            device=conv.device, loc=conv.loc)
    panels = graph.make_node("transpose", split.outputs, {"perm": [0, 2, 3, 4, 1]},
                             names=[graph.fresh_name(f"{w.name}.panels")],
                             device=conv.device, loc=conv.loc)
    return [split, panels]
