"""The split-KV decoder's two Triton kernels (:func:`tuner.experts.split_kv_decode`).

A baseline, not a Foldwise kernel: the flash-decoding scheme written the plain way, in base 2
(``qk_scale`` carries log2(e)), one query row per (batch, head).
"""

import triton
import triton.language as tl


@triton.jit
def decode_partial(q_ptr, k_ptr, v_ptr, max_ptr, sum_ptr, out_ptr, n, heads, chunk, qk_scale,
                   sq_b, sq_h, sq_m, sq_d, sk_b, sk_h, sk_n, sk_d, sv_b, sv_h, sv_n, sv_e,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr,
                   D: tl.constexpr, E: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    parts = tl.num_programs(1)
    b = row // heads
    h = row % heads
    offs_d = tl.arange(0, BLOCK_D)
    offs_e = tl.arange(0, BLOCK_E)
    mask_d = offs_d < D
    mask_e = offs_e < E
    # the query row is loop-invariant: loaded once
    q = tl.load(q_ptr + b * sq_b + h * sq_h + offs_d * sq_d, mask=mask_d, other=0.0).to(tl.float32)
    k_base = k_ptr + b * sk_b + h * sk_h
    v_base = v_ptr + b * sv_b + h * sv_h
    start = part * chunk
    end = tl.minimum(start + chunk, n)
    m_i = -float("inf")
    l_i = 0.0
    acc = tl.zeros([BLOCK_E], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k = tl.load(k_base + offs_n[:, None] * sk_n + offs_d[None, :] * sk_d,
                    mask=mask_n[:, None] & mask_d[None, :], other=0.0)
        # scores over d, in the log2 domain
        s = tl.sum(k.to(tl.float32) * q[None, :], axis=1) * qk_scale
        s = tl.where(mask_n, s, -float("inf"))
        # running max over the chunk's keys
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new)
        # running sum of exp, rescaled to the new max
        l_i = l_i * alpha + tl.sum(p, axis=0)
        v = tl.load(v_base + offs_n[:, None] * sv_n + offs_e[None, :] * sv_e,
                    mask=mask_n[:, None] & mask_e[None, :], other=0.0)
        # running p @ v, rescaled to the new max
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    slot = row * parts + part
    tl.store(max_ptr + slot, m_i)
    tl.store(sum_ptr + slot, l_i)
    tl.store(out_ptr + slot * E + offs_e, acc, mask=mask_e)


@triton.jit
def decode_combine(max_ptr, sum_ptr, part_ptr, out_ptr, parts, heads, so_b, so_h, so_m, so_e,
                   BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, E: tl.constexpr):
    row = tl.program_id(0)
    b = row // heads
    h = row % heads
    offs_s = tl.arange(0, BLOCK_S)
    offs_e = tl.arange(0, BLOCK_E)
    mask_s = offs_s < parts
    mask_e = offs_e < E
    mx = tl.load(max_ptr + row * parts + offs_s, mask=mask_s, other=-float("inf"))
    # the row's max over the parts' maxima; each part rescaled to it
    top = tl.max(mx, axis=0)
    weight = tl.where(mask_s, tl.exp2(mx - top), 0.0)
    # the row's sum of exp
    total = tl.sum(tl.load(sum_ptr + row * parts + offs_s, mask=mask_s, other=0.0) * weight, axis=0)
    part = tl.load(part_ptr + (row * parts + offs_s[:, None]) * E + offs_e[None, :],
                   mask=mask_s[:, None] & mask_e[None, :], other=0.0)
    # the output row: the parts' p @ v, rescaled and summed
    o = tl.sum(part * weight[:, None], axis=0) / total
    tl.store(out_ptr + b * so_b + h * so_h + offs_e * so_e, o.to(out_ptr.dtype.element_ty), mask=mask_e)
