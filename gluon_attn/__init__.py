"""gluon-attn: persistent, warp-specialized attention kernels in Triton's Gluon, and the harness
that measures them against cuDNN, FlashAttention-2 and FlexAttention."""
from .api import attention
from .problem import DTYPES, Inputs, Problem, make_inputs
from .reference import TOLERANCES, attention_reference, check_accuracy

__all__ = ["attention", "DTYPES", "Inputs", "Problem", "TOLERANCES", "attention_reference", "check_accuracy", "make_inputs"]
__version__ = "0.1.0"
