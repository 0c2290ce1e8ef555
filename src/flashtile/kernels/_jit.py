"""What runs inside the kernels: the ``@triton.jit`` helpers every Triton kernel in flashtile shares,
each written once.

The launch order of a program's tile (``program_tile``), the sign of the scale folded into the query
tile, the online-softmax steps (exact and fused), 64-bit program offsets, tile loads and stores, and
the integer bookkeeping of the causal tile rules in ``flashtile.reference.causal``, written once so
that the forward and backward kernels count tiles the same way the reference does. What runs on the
host (launcher checks, device probes, the scale's split, TMA descriptors, the launch cache) lives in
``flashtile.kernels._host``.
"""

import triton
import triton.language as tl


@triton.jit
def program_tile(chunk, HEAVY_TILE_LAST: tl.constexpr, HEAVIEST_FIRST: tl.constexpr):
    """(tile, plane, batch) of this program in a (tiles, planes, batch) grid, as int32.

    The GPU starts programs about in launch order, the grid's first axis fastest. Under a causal mask
    the tiles of a head differ in work (the last query tile, or the first key tile, has the most); a long
    program that starts late keeps a few SMs busy while the rest idle (the tail). HEAVY_TILE_LAST flips
    the tile axis, so that each head's heaviest tile comes first in that head. HEAVIEST_FIRST goes
    further: it cuts the (plane, batch) pairs into chunks of ``chunk`` and renumbers the launch so
    that inside a chunk the tile index varies slowest: every head's heaviest tile starts before any
    head's second heaviest. Programs that run together then belong to different heads; the launcher
    sizes the chunk so that what one chunk's heads read still fits in L2 (``heaviest_first_chunk``).
    """
    # --8<-- [start:heaviest_first]
    tile = tl.program_id(0)
    plane = tl.program_id(1)
    b = tl.program_id(2)
    n_tiles = tl.num_programs(0)
    if HEAVIEST_FIRST:
        n_planes = tl.num_programs(1)
        # this program's place in the launch order
        rank = tile + n_tiles * (plane + n_planes * b)
        # the first (plane, batch) pair of its chunk
        first = rank // (chunk * n_tiles) * chunk
        # the last chunk may be smaller
        size = tl.minimum(chunk, n_planes * tl.num_programs(2) - first)
        within = rank - first * n_tiles
        tile = within // size
        pair = first + within % size
        plane = pair % n_planes
        b = pair // n_planes
    if HEAVY_TILE_LAST:
        tile = n_tiles - 1 - tile
    return tile, plane, b
    # --8<-- [end:heaviest_first]


# --8<-- [start:apply_sign]
@triton.jit
def apply_sign(q, SIGN: tl.constexpr):
    """sign · q for the query tile, exact in every dtype; 0 · q keeps a NaN in q
    (0 · NaN = NaN)."""
    if SIGN == -1:
        q = -q
    elif SIGN == 0:
        q = q * 0.0
    return q
# --8<-- [end:apply_sign]


# --8<-- [start:softmax_step]
@triton.jit
def online_softmax_step(acc, l, m, u, v, qk_scale, DOT_PRECISION: tl.constexpr):
    """Fold one key tile into the running (acc, l, m): the online-softmax update of
    Part A, in raw-dot units.

    u: (rows, BLOCK_K) fp32 raw dots of the tile, -inf where a key is hidden; v:
    (BLOCK_K, HEAD_DIM_PAD) value tile in the input dtype. Every kernel that walks key
    tiles (forward, decode) calls this one function, so the update and its -inf guard
    are written once.
    """
    # --8<-- [start:exact_update]
    m_new = tl.maximum(m, tl.max(u, 1))
    # A row that has seen only -inf scores so far (masked keys, or keys scoring -inf)
    # has m_new = -inf; subtracting it would give exp(-inf - (-inf)) = NaN. Subtracting
    # 0 instead gives p = 0 and alpha = 0. One select per row, in every tile: an
    # unmasked tile can hold -inf scores too.
    m_new_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # shrink what we had to the new max
    alpha = tl.math.exp2((m - m_new_safe) * qk_scale)
    # u - m first: exact for the max
    p = tl.math.exp2((u - m_new_safe[:, None]) * qk_scale)
    l = alpha * l + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    # P in the input dtype
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l, m_new
    # --8<-- [end:exact_update]
# --8<-- [end:softmax_step]


# --8<-- [start:fused_step]
# |shift| below this: the rounding of a shift is at most 1/2 in the exponent
SHIFT_LIMIT = tl.constexpr(2.0**24)


@triton.jit
def multiply_subtract(x, scale, shift, INTERPRETED: tl.constexpr):
    """x * scale - shift with the product unrounded: one fused multiply-add on the GPU,
    where Triton lets the compiler contract a multiply and a subtract (in the loop this
    form ran faster than an explicit tl.fma, sweeps/forward-fused-step-variants.json;
    tl.fma is kept for the per-row delta; the GPU tests at scores of 4e5 and 4e6 fail if
    the contraction is ever lost). The interpreter rounds the product first, so there it
    is taken in float64 (exact for two float32 factors) and the difference rounded once.
    """
    if INTERPRETED:
        return (x.to(tl.float64) * scale - shift).to(tl.float32)
    return x * scale - shift


@triton.jit
def fused_softmax_step(acc, l, m, shift, largest, u, v, qk_scale,
                       DOT_PRECISION: tl.constexpr,
                       INTERPRETED: tl.constexpr):  # fmt: skip
    """``online_softmax_step`` with one multiply-add per score instead of a subtract and
    a multiply.

    p = exp2(u * qk_scale - shift) where shift = fl(m * qk_scale) is the row max in
    exponent units, rounded once per row, and u * qk_scale - shift is one fused
    multiply-add, the product unrounded. (acc, l) are then kept relative to 2^shift
    rather than 2^(m * qk_scale): the row's largest score gives 2^delta with
    delta = m * qk_scale - shift, the rounding of the shift, exact, and at most half a
    unit in its last place. Every tile rescales by the shifts as rounded and used, so
    delta cancels in o = acc / l, and the caller takes it out of l for lse and the stats
    (``delta_of_shift``). That holds while 2^delta is harmless: |shift| < SHIFT_LIMIT
    keeps |delta| <= 1/2, and ``largest`` collects each row's largest |shift| so that
    the caller can check that once, at the end.

    shift carries -inf for a row that has seen only -inf so far, so that alpha = 0 for
    it, as with m.
    """
    # --8<-- [start:fused_update]
    m_new = tl.maximum(m, tl.max(u, 1))
    # rounded once: the kernel's only rounding of the row max
    shift_new = m_new * qk_scale
    # the -inf guard of online_softmax_step
    shift_safe = tl.where(m_new == float("-inf"), 0.0, shift_new)
    # both shifts as rounded and used: their roundings cancel
    alpha = tl.math.exp2(shift - shift_safe)
    p = tl.math.exp2(multiply_subtract(u, qk_scale, shift_safe[:, None], INTERPRETED))
    l = alpha * l + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    # a NaN shift is never largest
    largest = tl.where(tl.abs(shift_safe) > largest, tl.abs(shift_safe), largest)
    return acc, l, m_new, shift_new, largest
    # --8<-- [end:fused_update]


@triton.jit
def exact_product_minus(x, scale, shift, INTERPRETED: tl.constexpr):
    """x * scale - shift through an explicit fused multiply-add (float64 in the
    interpreter): exact whenever the result is the rounding error of
    fl(x * scale) = shift, as delta is."""
    if INTERPRETED:
        return (x.to(tl.float64) * scale - shift).to(tl.float32)
    return tl.fma(x, scale, -shift)


@triton.jit
def delta_of_shift(m, shift, l, qk_scale, INTERPRETED: tl.constexpr):
    """delta = m * qk_scale - shift, exact (0 for a row that saw no key). The fused
    path's p carry a factor 2^delta, and so does its l: l * exp2(-delta) is l relative
    to 2^(m * qk_scale), the units of lse, the stats and the backward."""
    return tl.where(l == 0.0, 0.0, exact_product_minus(m, qk_scale, shift, INTERPRETED))
# --8<-- [end:fused_step]


# --8<-- [start:program_offset]
@triton.jit
def program_offset(index, stride):
    """index * stride in 64 bits. Program ids and tl.arange are int32, and so is a
    stride below 2**31; their product silently wraps once a tensor passes 2**31 elements
    unless one side is widened first. The cast is assigned, not just called:
    ``index.to(tl.int64)`` alone does nothing.
    """
    index = index.to(tl.int64)
    return index * stride
# --8<-- [end:program_offset]


# --8<-- [start:tiles]
@triton.jit
def load_tile(ptr, stride_t, stride_d, rows, cols, n_rows, head_dim):
    """Load the (len(rows), len(cols)) tile ptr[rows, cols], zero outside
    [0, n_rows) x [0, head_dim).

    ``ptr`` already points at the (batch, head) slice. Rows and columns are widened to
    int64 before they meet a stride: row * stride_t, or col * stride_d when the head dim
    is an outer axis of the storage, overflows int32 once a tensor passes 2**31
    elements.
    """
    offsets = (rows.to(tl.int64)[:, None] * stride_t
               + cols.to(tl.int64)[None, :] * stride_d)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < head_dim)
    return tl.load(ptr + offsets, mask=mask, other=0.0)


@triton.jit
def store_tile(ptr, stride_t, stride_d, rows, cols, n_rows, head_dim, value):
    """Store ``value`` into ptr[rows, cols] inside [0, n_rows) x [0, head_dim), cast to
    ptr's dtype."""
    offsets = (rows.to(tl.int64)[:, None] * stride_t
               + cols.to(tl.int64)[None, :] * stride_d)
    mask = (rows[:, None] < n_rows) & (cols[None, :] < head_dim)
    tl.store(ptr + offsets, value.to(ptr.dtype.element_ty), mask=mask)
# --8<-- [end:tiles]


# --8<-- [start:tile_counts]
@triton.jit
def last_key_tile(q_end, Tk, BLOCK_K: tl.constexpr, offset):
    """Number of key tiles a query tile ending at q_end needs:
    ``reference.causal.last_key_tile``, with the same arguments in the same order.

    The last row q_end - 1 sees keys up to q_end - 1 + offset. Clamping that to -1 makes
    the count 0 for a tile that sees nothing, and keeps every division on non-negative
    numbers (Triton's // on integers truncates toward zero like C, it does not floor
    like Python).
    """
    last_visible_key = tl.maximum(q_end - 1 + offset, -1)
    return tl.minimum(tl.cdiv(Tk, BLOCK_K), (last_visible_key + BLOCK_K) // BLOCK_K)


@triton.jit
def full_key_tiles(q_start, Tk, BLOCK_K: tl.constexpr, offset):
    """Number of leading key tiles that are FULL for every row of a query tile starting
    at q_start.

    Key tile t is full when its last column (t + 1) * BLOCK_K - 1 is visible from the
    first row, (t + 1) * BLOCK_K - 1 <= q_start + offset, and lies inside the keys,
    (t + 1) * BLOCK_K <= Tk.
    """
    # keys visible from row q_start
    first_row_sees = tl.maximum(q_start + offset + 1, 0)
    return tl.minimum(first_row_sees // BLOCK_K, Tk // BLOCK_K)


@triton.jit
def first_query_row(k_start, offset):
    """The first query row that sees key k_start (i >= k_start - offset), clamped at
    row 0."""
    return tl.maximum(k_start - offset, 0)
# --8<-- [end:tile_counts]


# --8<-- [start:band_tiles]
@triton.jit
def first_key_tile(q_start, Tk, BLOCK_K: tl.constexpr, lo):
    """Index of the first key tile a query tile starting at q_start needs under the band
    lo <= j - i <= hi: ``reference.masks.first_key_tile``, with the same arguments in
    the same order. Its first row sees keys from q_start + lo on (key 0 when that is
    negative); past the last key, the number of key tiles, so that the run
    first_key_tile .. last_key_tile is empty."""
    # clamped first: // on a negative int truncates
    first_visible_key = tl.maximum(q_start + lo, 0)
    return tl.where(first_visible_key > Tk - 1, tl.cdiv(Tk, BLOCK_K),
                    first_visible_key // BLOCK_K)


@triton.jit
def band_full_key_tiles(q_start, q_end, Tk, BLOCK_K: tl.constexpr, lo, hi, first, end):
    """(full_first, full_end): the key tiles of the run first .. end - 1 that are FULL
    for every row of the query tile [q_start, q_end), as
    ``reference.masks.classify_band_tile`` says, clamped into the run.

    Key tile t is FULL when its lowest diagonal, t * BLOCK_K - (q_end - 1), is >= lo
    (t >= full_first), its highest, (t + 1) * BLOCK_K - 1 - q_start, is <= hi, and it
    ends inside the keys (t < full_end). The FULL tiles are one contiguous run inside
    the visited one; the tiles on either side of it are DIAGONAL.
    """
    full_first = tl.cdiv(tl.maximum(q_end - 1 + lo, 0), BLOCK_K)
    full_end = tl.minimum(tl.maximum(q_start + hi + 1, 0) // BLOCK_K, Tk // BLOCK_K)
    full_first = tl.minimum(tl.maximum(full_first, first), end)
    # no FULL tile: an empty run at full_first
    full_end = tl.minimum(tl.maximum(full_end, full_first), end)
    return full_first, full_end


@triton.jit
def band_query_tiles(k_start, Tq, Tk, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, lo,
                     hi):  # fmt: skip
    """(first, full_first, full_end, end) in query tiles, for the key tile starting at
    k_start: the query tiles first .. end - 1 see some key of it (the others are SKIP),
    full_first .. full_end - 1 see all of it (FULL), and the rest of the run is
    DIAGONAL. The transpose of ``first_key_tile`` and ``band_full_key_tiles``, for the
    dK/dV kernel, which owns a key tile and walks query tiles.

    Row i sees a key of [k_start, k_last] when k_start - hi <= i <= k_last - lo; it sees
    every one when k_last - hi <= i and i <= k_start - lo. A ragged last key tile (keys
    past Tk) is never FULL.
    """
    n = tl.cdiv(Tq, BLOCK_Q)
    k_last = tl.minimum(k_start + BLOCK_K, Tk) - 1  # the tile's last real key
    first = tl.minimum(tl.maximum(k_start - hi, 0) // BLOCK_Q, n)
    end = tl.minimum(tl.cdiv(tl.maximum(k_last - lo + 1, 0), BLOCK_Q), n)
    end = tl.maximum(end, first)
    full_first = tl.cdiv(tl.maximum(k_start + BLOCK_K - 1 - hi, 0), BLOCK_Q)
    full_end = tl.minimum(tl.maximum(k_start - lo + 1, 0) // BLOCK_Q, Tq // BLOCK_Q)
    # padding keys: masked on every query tile
    full_end = tl.where(k_start + BLOCK_K > Tk, 0, full_end)
    full_first = tl.minimum(tl.maximum(full_first, first), end)
    full_end = tl.minimum(tl.maximum(full_end, full_first), end)
    return first, full_first, full_end, end


@triton.jit
def in_band(rows, keys, lo, hi):
    """Which (row, key) pairs the band keeps, lo <= j - i <= hi:
    ``reference.masks.band_keeps`` on index tiles already shaped to broadcast (a column
    of rows against a row of keys, or the transpose). Written as two bounds per row,
    i + lo <= j <= i + hi, so that only the compares are tiles: j - i would be a whole
    tile of ints, registers the kernels do not have to spare."""
    return (keys >= rows + lo) & (keys <= rows + hi)
# --8<-- [end:band_tiles]


# --8<-- [start:soft_cap]
# |y| under this: the odd series, which keeps tanh's relative accuracy
TANH_SERIES_BELOW = tl.constexpr(0.3)


@triton.jit
def tanh(y):
    """tanh in float32, within a few units in the last place, on the GPU and in the
    interpreter alike (Triton has no tanh of its own, and the interpreter runs no
    libdevice).

    For |y| >= 0.3, tanh |y| = (1 - e) / (1 + e) with e = exp(-2 |y|): e lies in
    (0, 0.55], so 1 - e loses at most a bit or two, and e -> 0 gives 1 at any |y|,
    infinite included. Below 0.3 that subtraction would cancel (1 - e ~ 2 |y|), so the
    Taylor series to y^11 takes over: its next term is under 2e-9 of tanh there. NaN
    stays NaN (it fails the comparison and reaches exp2).
    """
    a = tl.abs(y)
    e = tl.math.exp2(a * -2.8853900817779268)  # exp(-2|y|) = 2^(-2 log2(e) |y|)
    far = (1.0 - e) / (1.0 + e)
    a2 = a * a
    # y - y^3/3 + 2y^5/15 - ..., Horner
    series = -17.0 / 315 + a2 * (62.0 / 2835 + a2 * (-1382.0 / 155925))
    series = a * (1.0 + a2 * (-1.0 / 3 + a2 * (2.0 / 15 + a2 * series)))
    t = tl.where(a < TANH_SERIES_BELOW, series, far)
    return tl.where(y < 0, -t, t)


@triton.jit
def soft_cap(u, unit, softcap):
    """(s, t) for raw dots u: s = softcap * tanh(x / softcap) of the scaled scores
    x = unit * u (natural units: ``reference.forward.softcap_scores``), and
    t = tanh(x / softcap), whose 1 - t^2 the backward multiplies dS by. The kernels then
    run the softmax on s with qk_scale = log2(e): m and l are in natural units, and the
    cap is applied in the units the reference applies it in."""
    t = tanh(u * unit / softcap)
    return softcap * t, t
# --8<-- [end:soft_cap]


# --8<-- [start:varlen_program]
@triton.jit
def varlen_program(CU_Q, CU_K, ORDER, b, total_q, total_k, alignment, left, right,
                   BLOCK: tl.constexpr, OWN_KEYS: tl.constexpr,
                   HEAVY_TILE_LAST: tl.constexpr):  # fmt: skip
    """(tile, q_doc, k_doc, Tq, Tk, offset, band_lo, band_hi) of a program of packed
    documents: document ``doc`` owns queries CU_Q[doc] .. CU_Q[doc + 1] - 1 and keys
    CU_K[doc] .. CU_K[doc + 1] - 1, and is attended as a sequence of its own, with its
    own Tq, Tk, diagonal offset and band.

    The grid is (tiles of the longest document, heads, documents); the program's third
    index b picks its document from ORDER (``_host.document_order``: the documents with
    the most pairs launch first, so the longest ones do not start last and leave a
    tail). ``tile`` is this program's query tile (its key tile with OWN_KEYS, for the
    dK/dV kernel), -1 for a program past its document's tiles. HEAVY_TILE_LAST numbers
    the tiles from the document's own last one (the causal forward's and dQ's heaviest),
    so each document's heaviest tile takes program 0 and the idle programs come last.
    total_q and total_k are the packed tensors' token counts. ``alignment`` is 0
    (upper_left) or 1 (lower_right): offset = alignment * (Tk - Tq). (left, right) is
    the window, -1 unbounded, the right side already capped at 0 under causal by the
    launcher; the band lo <= j - i <= hi is ``reference.masks.window_band``'s for this
    document's Tq and Tk.
    """
    # The launcher checked cu_seqlens on the host; the clamps keep every read and write
    # inside the packed tensors even for values it could not see (a write behind torch's
    # back after the check): a document then runs on the tokens that exist, and nothing
    # outside (total_q, total_k) is ever touched.
    doc = tl.load(ORDER + b)
    q_doc = tl.minimum(tl.maximum(tl.load(CU_Q + doc), 0), total_q)
    Tq = tl.minimum(tl.maximum(tl.load(CU_Q + doc + 1), q_doc), total_q) - q_doc
    k_doc = tl.minimum(tl.maximum(tl.load(CU_K + doc), 0), total_k)
    Tk = tl.minimum(tl.maximum(tl.load(CU_K + doc + 1), k_doc), total_k) - k_doc
    if OWN_KEYS:
        n_tiles = tl.cdiv(Tk, BLOCK)
    else:
        n_tiles = tl.cdiv(Tq, BLOCK)
    tile = tl.program_id(0)
    if HEAVY_TILE_LAST:
        tile = n_tiles - 1 - tile  # negative past the document's tiles
    tile = tl.where((tile >= 0) & (tile < n_tiles), tile, -1)
    offset = alignment * (Tk - Tq)
    band_lo = tl.where(left == -1, -Tq, tl.maximum(offset - left, -Tq))
    band_hi = tl.where(right == -1, Tk, tl.minimum(offset + right, Tk))
    return tile, q_doc, k_doc, Tq, Tk, offset, band_lo, band_hi
# --8<-- [end:varlen_program]
