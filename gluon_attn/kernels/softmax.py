"""The online-softmax step of both forwards, per S block, in the log2 domain with the softmax scale folded into the
exp2 argument: the rows' running max with its -inf guard and the rescale factor alpha (``running_max``), then the
running sum (``running_sum``). The sm_90a forward calls them on its wgmma accumulator, the sm_100a softmax
partitions on the two column halves they read from tensor memory; between the two calls each arch takes the
exponentials its own way (a register tile for the PV wgmma; column chunks stored back to tensor memory).

Each is a call of its own on purpose: ptxas schedules within the ranges the inlined calls' line info marks, and
this cut keeps the sm_100a builds' SASS as it was with the step written out in place (NOTES v107)."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def running_max(m_i, s, qk_scale, MASKED: gl.constexpr, s1=None):
    """The rows' new running max ``m_new`` (of ``m_i`` and the block's scores ``s``, and of ``s1`` where the block
    comes as two column halves), the max ``m_exp`` their exponentials use, and ``alpha = exp2(m_i - m_exp)``, the
    factor for what was summed and accumulated before. On a MASKED block a row may have seen no key yet (max -inf):
    ``m_exp`` is then 0, so that its exponentials come out 0, not NaN."""
    s_max = gl.max(s, 1)
    if s1 is not None:
        s_max = gl.maximum(s_max, gl.max(s1, 1))
    m_new = gl.maximum(m_i, s_max * qk_scale)
    m_exp = m_new
    if MASKED:
        m_exp = gl.where(m_new == -float("inf"), 0.0, m_new)
    return m_new, m_exp, gl.exp2(m_i - m_exp)


@gluon.jit
def running_sum(l_i, alpha, p_sum):
    """The rows' running sum after a block whose exponentials sum to ``p_sum``."""
    return l_i * alpha + p_sum
