"""The per-type decoding of the repacked layout, shared by the float GEMV kernels
(`repacked_gemv.py`'s one-row-group and several-rows kernels, `tiled_gemv.py`): one home
for how a word tile turns into weights and how a group's scales apply.

The kernels differ in their tile shapes ([G, T, R], [NB, G, T, R], activations of several
rows in front) and in where the planes' addresses come from, so they load the words and
compute the addresses; these helpers take loaded tiles of any shape and broadcast like
the operands they are given. Same expressions in the same order as the kernels had
inline (the sm_90 PTX of every kernel variant was the same before and after the move).

Per trip, for a word tile `w` (and `w_hi = w >> 16`):

    h_lo, h_hi = high_fields(h, KIND)           # Q5_0 / Q6_K: the high-bit plane
    for p in range(32 // T):                    # fields of a word: 4 (Q8_0) or 8
        f = decode_field(w, w_hi, h_lo, h_hi, p, KIND)
        ... ps += f * x_p (Q6_K: ps_hi for p >= 4), sx += x_p (Q4_1, Q4_K)
    d, m, s_lo, s_hi = group_scales(...)
    acc += scaled_sum(ps, ps_hi, sx, d, m, s_lo, s_hi, KIND)
"""

from __future__ import annotations

import triton
import triton.language as tl

from minivllm.kernels.triton.quant_fields import field, field_hi, i8_to_f32, u8_to_f32

# Kernel kinds (repacked_layout.K_*): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K = 0..5.


@triton.jit
def high_fields(h, KIND: tl.constexpr):
    """The high-bit words placed just above the nibbles of fields 0-3 and 4-7: Q6_K's
    int16 plane (already int32), Q5_0's group word (already shifted right by t)."""
    if KIND == 5:
        h_lo = h << 4
        h_hi = h << 2
    else:
        h_lo = h << 4
        h_hi = h >> 12
    return h_lo, h_hi


@triton.jit
def decode_field(w, w_hi, h_lo, h_hi, P: tl.constexpr, KIND: tl.constexpr, ONES=None):
    """Field P of every word as float32, the type's offset removed, before the group's
    scale (h_lo / h_hi: `high_fields`, ignored by the types without high bits). ONES: 15
    as a runtime number, or None (quant_fields.py says why a kernel passes it)."""
    if KIND == 3:  # Q8_0: 4 bytes per word, stored as q + 128
        if P < 2:
            f = field(w, P, 8, 128, ONES)
        else:
            f = field(w_hi, P - 2, 8, 128, ONES)
    elif KIND == 5:  # Q6_K: a nibble and 2 high bits, q - 32
        if P < 4:
            f = field_hi(w, h_lo, P, 2, 32, ONES)
        else:
            f = field_hi(w_hi, h_hi, P - 4, 2, 32, ONES)
    elif KIND == 2:  # Q5_0: a nibble and 1 high bit, q - 16
        if P < 4:
            f = field_hi(w, h_lo, P, 1, 16, ONES)
        else:
            f = field_hi(w_hi, h_hi, P - 4, 1, 16, ONES)
    elif KIND == 0:  # Q4_0: q - 8
        if P < 4:
            f = field(w, P, 4, 8, ONES)
        else:
            f = field(w_hi, P - 4, 4, 8, ONES)
    else:  # Q4_1, Q4_K: q (the min comes through the activation sum)
        if P < 4:
            f = field(w, P, 4, 0, ONES)
        else:
            f = field(w_hi, P - 4, 4, 0, ONES)
    return f


@triton.jit
def load(ptr, ok, other, MASKED: tl.constexpr, EVICT: tl.constexpr):
    """tl.load under `ok` (other where false), or, MASKED off (a tile known to lie inside
    the matrix), without a mask: no predicates, no zeroing of the registers. EVICT: 0 no
    hint, 1 evict_first (streamed once: weights), 2 evict_last (reused: activations); a
    number passed explicitly, because Triton 3.6 hands a jit helper's *string* constexpr
    default over as a plain str and fails to compile ("'str' object has no attribute 'type'")."""
    if EVICT == 1:
        if MASKED:
            v = tl.load(ptr, mask=ok, other=other, eviction_policy="evict_first")
        else:
            v = tl.load(ptr, eviction_policy="evict_first")
    elif EVICT == 2:
        if MASKED:
            v = tl.load(ptr, mask=ok, other=other, eviction_policy="evict_last")
        else:
            v = tl.load(ptr, eviction_policy="evict_last")
    else:
        if MASKED:
            v = tl.load(ptr, mask=ok, other=other)
        else:
            v = tl.load(ptr)
    return v


@triton.jit
def group_scales(a_ptr, b_ptr, c_ptr, e_ptr, gr, sb, ok, KIND: tl.constexpr, MASKED: tl.constexpr = True):
    """(d, m, s_lo, s_hi) as float32 for the tile's groups: `gr` addresses the
    per-(group, row) planes, `sb` the per-(super-block, row) ones (K-quants). Q4_1: d, m;
    Q4_K: d, dmin, sc, mn; Q6_K: d, -, sc of elements 0-15, sc of 16-31; others: d."""
    if KIND == 5:
        s_lo = i8_to_f32(load(c_ptr + gr, ok, 0, MASKED, 0))
        s_hi = i8_to_f32(load(e_ptr + gr, ok, 0, MASKED, 0))
        d = load(a_ptr + sb, ok, 0.0, MASKED, 0).to(tl.float32)
        m = d
    elif KIND == 4:
        d = load(a_ptr + sb, ok, 0.0, MASKED, 0).to(tl.float32)
        m = load(b_ptr + sb, ok, 0.0, MASKED, 0).to(tl.float32)
        s_lo = u8_to_f32(load(c_ptr + gr, ok, 0, MASKED, 0))
        s_hi = u8_to_f32(load(e_ptr + gr, ok, 0, MASKED, 0))
    elif KIND == 1:
        d = load(a_ptr + gr, ok, 0.0, MASKED, 0).to(tl.float32)
        m = load(b_ptr + gr, ok, 0.0, MASKED, 0).to(tl.float32)
        s_lo = d
        s_hi = d
    else:
        d = load(a_ptr + gr, ok, 0.0, MASKED, 0).to(tl.float32)
        m = d
        s_lo = d
        s_hi = d
    return d, m, s_lo, s_hi


@triton.jit
def scaled_sum(ps, ps_hi, sx, d, m, s_lo, s_hi, KIND: tl.constexpr):
    """A trip's contribution: the field sums `ps` (Q6_K: elements 0-15 in `ps`, 16-31 in
    `ps_hi`) under the group's scales; `sx` the activations' sum (Q4_1, Q4_K mins)."""
    if KIND == 5:
        y = (ps * s_lo + ps_hi * s_hi) * d
    elif KIND == 4:  # (d * sc) * q - (dmin * mn)
        y = ps * (d * s_lo) - (m * s_hi) * sx
    elif KIND == 1:  # d * q + m
        y = ps * d + m * sx
    else:  # Q4_0, Q5_0, Q8_0: d * (q - offset), the offset already subtracted
        y = ps * d
    return y


# --- the tiled kernels' shared steps (tiled_gemv.py, q8_gemv.py) ----------------------------


@triton.jit
def word_tile(q_ptr, nb, nb_ok, gg, g_hi, t4, r4, N_GROUPS: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
              MASKED: tl.constexpr = True):
    """(words, mask, per-(group, row) offsets) of a [NB, G, T, R] tile: row groups `nb`,
    groups `gg` below g_hi (MASKED off: the caller knows the tile is inside the matrix).
    16-byte loads (ld.global.v4 in the sm_90 PTX), evict-first: each weight byte is read
    once per call."""
    ok = nb_ok & (gg < g_hi)
    gr = (nb * N_GROUPS + gg) * RR + r4 + t4 * 0  # per-(group, row) planes, in the tile's shape
    return trip_words(q_ptr, nb, ok, gg, t4, r4, N_GROUPS, T, RR, MASKED), ok, gr


@triton.jit
def trip_bits(q_ptr, b_ptr, nb, ok, gg, t4, r4, N_GROUPS: tl.constexpr, KIND: tl.constexpr, T: tl.constexpr,
              RR: tl.constexpr, MASKED: tl.constexpr, SPREAD_T: tl.constexpr):
    """A trip's quantized bits as loaded, (words, high-bit plane), for row groups `nb`,
    groups `gg` (where `ok`): Q6_K's 2-bit plane in the words' shape, Q5_0's fifth-bit word
    of each (group, row) (SPREAD_T: in the words' shape, else along T by broadcast later);
    the words again for the types without one (unused). Nothing here depends on an earlier
    kernel, so an EARLY trip loads all of it before its PDL wait (`tiled_gemv`); the scales
    stay after it (held from before the wait, the [NB, G, T, R] tile's four scale planes
    would cost 4x the words' registers)."""
    w = trip_words(q_ptr, nb, ok, gg, t4, r4, N_GROUPS, T, RR, MASKED)
    h = w
    if KIND == 5:
        h = load(b_ptr + ((nb * N_GROUPS + gg) * T + t4) * RR + r4, ok, 0, MASKED, 1).to(tl.int32)
    elif KIND == 2:
        if SPREAD_T:
            h = load(b_ptr + (nb * N_GROUPS + gg) * RR + r4 + t4 * 0, ok, 0, MASKED, 0)
        else:
            h = load(b_ptr + (nb * N_GROUPS + gg) * RR + r4, ok, 0, MASKED, 0)
    return w, h


@triton.jit
def trip_words(q_ptr, nb, ok, gg, t4, r4, N_GROUPS: tl.constexpr, T: tl.constexpr, RR: tl.constexpr,
               MASKED: tl.constexpr):
    """The weight words of row groups `nb`, groups `gg` (where `ok`), in the broadcast shape
    of nb, gg, t4 and r4: the one address rule of the repacked layout's word plane."""
    return load(q_ptr + ((nb * N_GROUPS + gg) * T + t4) * RR + r4, ok, 0, MASKED, 1)


@triton.jit
def store_rows(y, bias_ptr, out_ptr, pid_n, pid_s, pid_m, N, stride_om, stride_os, RR: tl.constexpr,
               BLOCK_NB: tl.constexpr, IS_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """A program's [NB, R] row sums: + bias and rounded once into out[M, N], or, split, as
    float32 partials into the workspace [SPLIT, M, N] (summed afterwards by `split_sum.slice_sum`)."""
    nb2 = pid_n * BLOCK_NB + tl.arange(0, BLOCK_NB)[:, None]
    rows = nb2 * RR + tl.arange(0, RR)[None, :]
    r_ok = rows < N
    if not IS_SPLIT:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows, mask=r_ok, other=0.0)
        tl.store(out_ptr + pid_m.to(tl.int64) * stride_om + rows, y.to(out_ptr.dtype.element_ty), mask=r_ok)
    else:
        tl.store(out_ptr + pid_s.to(tl.int64) * stride_os + pid_m.to(tl.int64) * stride_om + rows, y, mask=r_ok)


@triton.jit
def tile_and_row(M):
    """(row-group tile, activation row) of this program. Axis 0 runs over tiles x rows with
    a tile's M rows adjacent, so the programs that read one weight tile are scheduled side
    by side and the tile comes from DRAM about once, the other rows' reads finding it in L2
    (with the rows on an axis of their own, each row's programs swept the whole weight
    before the next row's began: M reads of it from DRAM). At M = 1 the order is the tiles'
    own. Which program computes a row never changes its sums."""
    pid = tl.program_id(0)
    return pid // M, pid % M
