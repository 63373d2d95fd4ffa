"""Parallelism by graph rewriting, as in Purine: distributions, boxing, partition.

`parallelize` gives every value of a logical graph a distribution over a device group
(the strategy seeds the graph's inputs; op split signatures from the registry carry it
through every node) and inserts the boxing conversions; `partition` cuts the result into
the physical graph of one rank, which the runtime executes.
"""

from purinec.passes.parallel.boxing import conversion_cost, convert, explain
from purinec.passes.parallel.distribute import (STRATEGIES, USER_STRATEGIES, Parallel,
                                                parallelize, parse_devices)
from purinec.ir.graph import member_name
from purinec.passes.parallel.partition import partition
from purinec.passes.parallel.pipeline import assign_stages, microbatch

__all__ = ["STRATEGIES", "USER_STRATEGIES", "Parallel", "assign_stages", "conversion_cost", "convert", "explain",
           "member_name", "microbatch", "parallelize", "parse_devices", "partition"]
