"""gradcomp: gradient compression for data-parallel PyTorch training.

Example:
    >>> import gradcomp
    >>> c = gradcomp.get_compressor("int8")
    >>> g = c.decompress(c.compress(grad))
    >>> gradcomp.all_reduce(grad, c)             # like dist.all_reduce, averaged, in place
    >>> gradcomp.ddp.register(ddp_model, "topk", ratio=0.01)
"""

from gradcomp import collectives, ddp, fsdp, ops, optim, planner, profiling, spawn
from gradcomp.collectives import all_reduce
from gradcomp.compressors import COMPRESSORS, Compressor, Context, get_compressor
from gradcomp.diloco import DiLoCo
from gradcomp.feedback import ErrorFeedback
from gradcomp.payload import Payload

__version__ = "0.1.0"

# all_reduce(t, "auto"): one shared planner.Auto, its measurements kept per group. Registered
# here, above both packages: the collectives take any chooser and never import the planner.
collectives.register_chooser("auto", planner.Auto)

__all__ = [
    "COMPRESSORS",
    "Compressor",
    "Context",
    "DiLoCo",
    "ErrorFeedback",
    "Payload",
    "all_reduce",
    "collectives",
    "ddp",
    "fsdp",
    "get_compressor",
    "ops",
    "optim",
    "planner",
    "profiling",
    "spawn",
]
