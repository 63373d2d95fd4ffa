"""The fused node: a group of ops that runs as one kernel (made by purinec.passes.fuse)."""

from __future__ import annotations

from purinec.errors import VerifyError
from purinec.ir.ops.registry import Attr, FusionKind, OpDef, get_op, register


def _from_body(what: str):
    def refuse(*args, **kwargs):
        raise VerifyError(f"op fused: a fused node's {what} come from its body, one member "
                          f"at a time; fused nodes are made by purinec.passes.fuse (or "
                          f"Graph.add_fused), not by Graph.add_node")
    return refuse


def _members_flops(node) -> int:
    """Fusing saves memory traffic, not arithmetic: the members' FLOPs, one by one."""
    return sum(get_op(member.op).flops(member) for member in node.body)


# A fused group is one node holding its members (`Node.body`); the registry entry gives
# its attribute schema and arity so the generic paths (printer, parser, complete_attrs)
# work, while types and values come from the body: `infer`/`reference` refuse, and the
# verifier, `infer_shapes` and the reference target walk the members instead. Opaque: a
# fused node never fuses again, and the memory planner aliases nothing across it.
register(OpDef("fused", (), _from_body("output types"), _from_body("results"),
               FusionKind.opaque, attrs={"kernel": Attr("str")},
               variadic=True,  # with no fixed inputs: any number, none included
               flops=_members_flops,
               doc="a fused group: its members run as one kernel named by `kernel`"))
