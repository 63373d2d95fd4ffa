"""The cpu target's choice of operand layouts: convolutions of small maps in inference
graphs computed pixel by filter, from weights rearranged into panels of filters
(`filters_in_panels`)."""

from __future__ import annotations

from purinec.codegen.cpu_conv import pixel_major_gain
from purinec.codegen.cpu_gemm import VW
from purinec.codegen.cpu_runtime import tiled_gemm_wanted
from purinec.ir.graph import Graph, Node, Value, updated_variables
from purinec.ir.types import DType

# Filters a panel, the first of these that divides a layer's filters: an AVX-512 tile's
# width (`cpu_gemm.NW`; four tiles with AVX2), or the widest tile's (`cpu_gemm.NV_LAST`
# vectors), or three vectors. The same on every machine, so that an artifact's IR is.
PANEL_WIDTHS = (64, 80, 48)
# A 1x1 convolution turns pixel-major where that uses this much more of its tiles'
# lanes (`pixel_major_gain`), less what transposing each block's sums into the output
# costs (2-4% of the product): both ways the product reads the image in place.
# Kernels alone, 2 threads, filter by pixel against pixel by filter (us, b1): 48 ->
# 192 filters of 13x13 (gain 1.02) 18 / 20, 64 -> 256 of 56x56 (1.0) 465 / 517, 512
# -> 1024 of 7x7 (1.23) 297 / 250.
PIXEL_MAJOR_MIN_GAIN = 1.05
# A window's product filter by pixel also copies the image into phase planes (or an
# im2col matrix) and each row of its output out of the planes' wider rows, which pixel
# by filter does not: it turns pixel-major where that uses its lanes no worse. The same
# kernels, 3x3 unless said: 128 -> 128 of 28x28 (gain 1.04) 2239 / 2113, 64 -> 192 of
# 56x56 (1.02) 4078 / 4061, 64 -> 128 of 112x112 at stride 2 (1.02) 2353 / 2236, 32
# -> 128 of 27x27 (1.05) 271 / 257, 32 -> 128 5x5 of 56x56 (1.04) 2941 / 2872, 16 ->
# 128 of 56x56 (1.02) 535 / 541; at batch 32 the same or better (0.90-0.99). With
# AVX2's tiles (6 pixels by 16 filters against 4 by 64) pixel by filter lost where it
# gained little (AVX2 emulated on the same cores, gain 1.04: 32 -> 128 of 27x27 336 /
# 377, 96 -> 128 of 28x28 at batch 32 26.5 / 28.8 ms), so there windows keep the
# rule of 1x1 products.
PIXEL_MAJOR_MIN_GAIN_WINDOWS = 1.0 if VW == 16 else PIXEL_MAJOR_MIN_GAIN
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
            and pixel_major_gain(node) >= _least_gain(w.type.shape[2:]))


def _least_gain(kernel: tuple[int, ...]) -> float:
    """The gain (`pixel_major_gain`) a convolution with this kernel turns pixel-major at."""
    return PIXEL_MAJOR_MIN_GAIN if tuple(kernel) == (1, 1) else PIXEL_MAJOR_MIN_GAIN_WINDOWS


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
