"""Every `torch.ops.specpass.*` op: the ones the passes emit where a kernel of ours beats Inductor's
formulation, and the ones the loop samples with. One module each; importing this package registers all.

    index, top, lse, value = torch.ops.specpass.top1_lse(logits, log, dtype, scale, scalar, divide, rounding)
    # logits [R, V], any float dtype; the rest optional: a prologue folded into the read,
    #   s = x * t (x / t with divide), x the fp32 logits, t = scale[row] ([R] or [1] fp32) or fp32(scalar),
    #   correctly rounded in fp32, then rounded to `rounding` (a 16-bit dtype) if given: what
    #   torch computes for (logits.float() / t).to(rounding). Without them s = x. Passes fold the
    #   casts and temperature before a softmax into these (passes/argmax/prologue.py), so s is never stored.
    # index [R] int64: softmax(s)'s arg-max: the first index of the row's maximum, as
    #                  torch.argmax of s; 0 where the maximum is +inf or NaN
    #                  (softmax is NaN everywhere there, and argmax of NaNs is 0)
    # top   [R] fp32:  the maximum (NaN counts as +inf)
    # lse   [R] fp32:  log(sum(exp(s))); NaN where top is +inf
    # value [R] dtype: the probability at the arg-max, exp(top - lse); with log, top - lse,
    #                  computed in fp32 and rounded to `dtype` (default fp32) to nearest even

    token = torch.ops.specpass.sample(logits, temperature, key, floor)       # top1.py
    # a Gumbel-max draw from softmax(x / T) over x >= floor, the noise counter.gumbel(key, column)
    threshold = torch.ops.specpass.floor(logits, temperature, top_k, top_p)  # floor.py
    # [R] fp32: each row's top-k / top-p cut, one sort per row

    out = torch.ops.specpass.attend_split(q, k, v, mask, scale)
    # q [B, T, hq, d], k [B, S, hk, d], v [B, S, hk, dv] (any strides), mask [B, 1, T, S] bool
    #   (broadcast axes as stride 0 are fine), hk dividing hq -> [B, T, hq, dv]: attention of query
    #   head j against K/V head j // (hq / hk) over the slots the mask shows, the scale given.

    y = torch.ops.specpass.exact_linear(x, w, b)   # exact.py: exact mode's row-invariant ops (its docstring)
    y = torch.ops.specpass.gemv(x, w, b)           # gemv.py: a linear of a few rows in one pass over w
    y = torch.ops.specpass.gemv_group(x, [w0, w1, w2], [])   # ... the linears of one input in one launch

The value is written by the kernel, in the dtype its user wants, so that a sampled token and its
(log-)probability need no second kernel; at a token t the log-probability is logits[t] - lse. On
CUDA it is one pass over the row in Triton (kernels/triton_top1.py, imported on first use: Triton
is not needed elsewhere); elsewhere it is the same thing written in torch ops, which the tests
compare it with. `sample` runs the same kernel over x / T plus Gumbel noise (counter.py: counter-based random
numbers, a leaf module beside their Triton twin). `attend_split`
is split-KV attention (flash-decoding) for a few query rows per request against a long cache, on
CUDA kernels/triton_attention.py; elsewhere the folded SDPA (`attend_folded`). All are custom ops
with a fake implementation: Inductor calls each as one extern kernel, CUDA graphs capture it.
"""

# registers torch.ops.specpass.{exact_*, floor, gemv, gemv_group, top1_lse, sample}
from specpass.kernels import exact, floor, gemv, top1  # noqa: F401
from specpass.kernels.attention import SPLIT_MAX_ROWS, attend_folded, attend_split, attend_split_refusal

__all__ = ["SPLIT_MAX_ROWS", "attend_folded", "attend_split", "attend_split_refusal"]
