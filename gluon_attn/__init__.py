"""gluon-attn: persistent, warp-specialized attention kernels in Triton's Gluon, and the harness
that measures them against cuDNN, FlashAttention-2 and FlexAttention."""
from . import ops as _ops  # noqa: F401  (registers the torch.library custom ops)
from .api import attention, attention_varlen
from .merge import merge_attentions
from .neighborhood import na1d, na2d, na3d
from .problem import DTYPES, Inputs, Problem, make_inputs
from .reference import TOLERANCES, attention_reference, check_accuracy

__all__ = ["attention", "attention_varlen", "merge_attentions", "na1d", "na2d", "na3d", "DTYPES", "Inputs", "Problem", "TOLERANCES", "attention_reference", "check_accuracy", "make_inputs"]
__version__ = "0.1.0"
