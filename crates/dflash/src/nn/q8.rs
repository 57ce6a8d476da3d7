//! Quantized matrices on the CPU with our own product: `x [m, k] f32 @ w [n, k]^T` where `w`
//! is Q8_0 (blocks of 32 int8 weights with one scale; the GGUF type slow CPU block types are
//! requantized to at load) or Q4 (Q4_0 / Q4_1 kept as stored: 32 4-bit weights with a scale and
//! a minimum, ~1/3 fewer bytes per token than their Q8_0 requantization), times activations
//! quantized to 8 bits per block of 32.
//!
//! Why not candle's: for rows whose length is not a multiple of 256 (SmolLM2: 576) candle
//! multiplies Q8_0 matrices with a per-block AVX2 dot that converts both f16 scales on every
//! block and quantizes activations with scalar code; a profile of the demo put ~60% of a
//! decode step there (docs/perf.md). Here the scales are converted to f32 once at load, the
//! activation is quantized once per call by ggml's rules (`d = amax / 127` kept as f16; the
//! quants by llama.cpp's x86 rounding for Q4 matrices, by ggml's portable one for the others:
//! [`Rule`]), and the int8 products go through AVX-512 VNNI
//! (`vpdpbusd`) where the CPU has it, else AVX2 (`vpmaddubsw` + `vpmaddwd`; e.g. AMD Zen 2/3),
//! on weights repacked at load into tiles of 16 rows (see [`QMatrix`]): one loaded tile block
//! serves up to four activation rows. Every path gives the reference's bits ([`Simd`]).
//!
//! Batch invariance: a row of the output is computed by the same code, in the same order,
//! whatever the number of rows of x, so a verify's logits equal the decode steps' bit for bit
//! (what greedy DFlash relies on).

use crate::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;

const QK: usize = 32;

/// Weight rows per tile of the interleaved layout (one 512-bit register holds 4 quants of each).
const TR: usize = 16;

/// The block type of a [`QMatrix`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// Q8_0: `w = q * d`, q int8.
    Q8,
    /// Q4_1 (and Q4_0, whose `(q - 8) * d` is `q * d + m` with `m = -8 d`): `w = q * d + m`,
    /// q in 0..16. `s16`: the activation's `d * sum(q)` rounded to f16, as ggml's Q8_1 stores
    /// it (what llama.cpp and candle multiply Q4_1 by); Q4_0 (ggml sums `(q - 8) * x`
    /// exactly): kept in f32.
    Q4 { s16: bool },
    /// Q6_K as stored: `w = d * sc_h * (q - 32)`, q in 0..64 (kept unsigned in the Q8 layout),
    /// one f16 `d` per 256 weights and an int8 scale per 16 (a 32-weight block's two halves);
    /// the block's sum is `sc_0 * (S_0 - 32 X_0) + sc_1 * (S_1 - 32 X_1)` in int32 (S_h the
    /// half's `q * x` sum, X_h its activation sum), exact.
    Q6,
}

impl Kind {
    /// Quant bytes of one tile's block (16 rows x 32 weights).
    fn tile_block_bytes(self) -> usize {
        match self {
            Kind::Q8 | Kind::Q6 => TR * QK,
            Kind::Q4 { .. } => TR * QK / 2,
        }
    }
}

/// One row's block of 32 weights as the layout stores it: quants as unsigned bytes (Q8:
/// `q + 128`; Q4: 0..16), the scale and (Q4_1) the minimum, f16 as in the file.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Block {
    q: [u8; QK],
    d: f16,
    m: f16,
    /// Q6: the two halves' int8 scales (0 otherwise).
    sc: [i8; 2],
}

/// A stored matrix: rows, columns and its bytes.
type Stored<'a> = (usize, usize, std::borrow::Cow<'a, [u8]>);

/// A CPU matrix `[rows, cols]`'s stored bytes, when its rows are whole blocks of `elems`
/// weights of `bytes` bytes each; None otherwise.
fn stored_blocks(q: &QTensor, elems: usize, bytes: usize) -> Result<Option<Stored<'_>>> {
    if !q.device().is_cpu() {
        return Ok(None);
    }
    let Ok((rows, cols)) = q.shape().dims2() else {
        return Ok(None);
    };
    if cols % elems != 0 {
        return Ok(None);
    }
    let data = q.data()?;
    Ok((data.len() == rows * (cols / elems) * bytes).then_some((rows, cols, data)))
}

/// A quantized weight `[rows, cols]` multiplied by dflash's own int8 product.
///
/// Layout (llama.cpp's repacked "x8" layouts are the model): rows in tiles of 16 (the last
/// padded with zero rows), and within a tile, per block of 32 columns, the 16 rows' quants
/// interleaved 4 at a time: Q8 byte `64 g + 4 j + u` of a tile's block is row j's weight `4 g +
/// u` (g < 8), so one 64-byte load is 4 weights of each of the 16 rows, and one `vpdpbusd`
/// against the activation's 4 bytes broadcast adds 4 products to each row's sum. Q4 packs two
/// such groups per byte: byte `64 c + 4 j + u` holds row j's weight `4 c + u` in its low nibble
/// and `16 + 4 c + u` in its high one (c < 4). Scales (and minimums) per (tile, block) as 16
/// f32, one register. A loaded tile block serves every activation row of the call.
#[derive(Debug, Clone)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    kind: Kind,
    /// Quants, tile-major, then block, then the interleaved rows.
    q: Vec<u8>,
    /// Per (tile, block): the 16 rows' scales (f16 as stored: a decode step reads 2 bytes
    /// a block instead of 4).
    d: Vec<f16>,
    /// Per (tile, block): the 16 rows' minimums (Q4_1; empty otherwise: Q4_0's `-8 d` is
    /// formed in f32, exactly).
    m: Vec<f16>,
    /// Per (tile, block): Q6's half scales, the 16 rows' first halves' then their second
    /// halves' (empty otherwise).
    sc: Vec<i8>,
}

impl QMatrix {
    /// From a CPU Q8_0, Q5_0, Q4_0, Q4_1 or Q6_K tensor `[rows, cols]`; None for any other
    /// type or device.
    pub fn from_qtensor(q: &QTensor) -> Result<Option<Self>> {
        if q.dtype() == GgmlDType::Q6K {
            return Self::from_q6k(q);
        }
        let (kind, block) = match q.dtype() {
            GgmlDType::Q8_0 => (Kind::Q8, 2 + QK),
            // Q5_0's `(q - 16) * d` with q < 32 is a Q8_0 block with the same scale: exact
            GgmlDType::Q5_0 => (Kind::Q8, 2 + 4 + QK / 2),
            GgmlDType::Q4_0 => (Kind::Q4 { s16: false }, 2 + QK / 2),
            GgmlDType::Q4_1 => (Kind::Q4 { s16: true }, 4 + QK / 2),
            _ => return Ok(None),
        };
        let Some((rows, cols, data)) = stored_blocks(q, QK, block)? else {
            return Ok(None);
        };
        let kb = cols / QK;
        let h = |b: &[u8], i: usize| f16::from_le_bytes([b[i], b[i + 1]]);
        let q5 = q.dtype() == GgmlDType::Q5_0;
        Ok(Some(Self::build(rows, cols, kind, |row, b| {
            let raw = &data[(row * kb + b) * block..][..block];
            let mut q = [0u8; QK];
            match kind {
                Kind::Q8 if q5 => {
                    // ggml: d, 32 high bits, then byte j: element j (low nibble) and j + 16
                    let qh = u32::from_le_bytes([raw[2], raw[3], raw[4], raw[5]]);
                    for (j, &byte) in raw[6..].iter().enumerate() {
                        let lo = (byte & 15) as u32 | ((qh >> j) & 1) << 4;
                        let hi = (byte >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
                        // (v - 16) + 128
                        q[j] = (lo + 112) as u8;
                        q[j + QK / 2] = (hi + 112) as u8;
                    }
                    Block {
                        q,
                        d: h(raw, 0),
                        m: f16::ZERO,
                        sc: [0; 2],
                    }
                }
                Kind::Q8 => {
                    for (o, &v) in q.iter_mut().zip(&raw[2..]) {
                        *o = v ^ 0x80; // i8 v + 128
                    }
                    Block {
                        q,
                        d: h(raw, 0),
                        m: f16::ZERO,
                        sc: [0; 2],
                    }
                }
                Kind::Q4 { s16 } => {
                    // ggml: byte j holds element j (low nibble) and j + 16 (high)
                    let qs = &raw[if s16 { 4 } else { 2 }..];
                    for (j, &byte) in qs.iter().enumerate() {
                        q[j] = byte & 15;
                        q[j + QK / 2] = byte >> 4;
                    }
                    let m = if s16 { h(raw, 2) } else { f16::ZERO };
                    Block {
                        q,
                        d: h(raw, 0),
                        m,
                        sc: [0; 2],
                    }
                }
                Kind::Q6 => unreachable!("Q6_K is read by from_q6k"),
            }
        })))
    }

    /// From a CPU Q6_K tensor `[rows, cols]` (cols a multiple of 256): ggml's block of 256 is
    /// `ql[128]` (low 4 bits), `qh[64]` (high 2 bits), `scales[16]` (int8, one per 16
    /// weights), `d` (f16); weight `128 n + 32 u + l` (n < 2, u < 4, l < 32) is `d *
    /// scales[8 n + 2 u + l / 16] * (q - 32)` with q's low bits from `ql[64 n + l + 32 (u %
    /// 2)]` (the high nibble for u >= 2) and its high bits `(qh[32 n + l] >> 2 u) & 3`.
    fn from_q6k(q: &QTensor) -> Result<Option<Self>> {
        const SB: usize = 256;
        const BYTES: usize = 210;
        let Some((rows, cols, data)) = stored_blocks(q, SB, BYTES)? else {
            return Ok(None);
        };
        let nsb = cols / SB;
        Ok(Some(Self::build(rows, cols, Kind::Q6, |row, b| {
            let raw = &data[(row * nsb + b / 8) * BYTES..][..BYTES];
            let (ql, qh, scales) = (&raw[..128], &raw[128..192], &raw[192..208]);
            let k = b % 8; // this 32-weight block within the 256
            let (n, u) = (k / 4, k % 4);
            let mut qv = [0u8; QK];
            for (l, o) in qv.iter_mut().enumerate() {
                let lo = ql[64 * n + l + 32 * (u % 2)];
                let lo = if u >= 2 { lo >> 4 } else { lo & 15 };
                let hi = (qh[32 * n + l] >> (2 * u)) & 3;
                *o = lo | (hi << 4);
            }
            let sc = |i: usize| scales[8 * n + 2 * u + i] as i8;
            Block {
                q: qv,
                d: f16::from_le_bytes([raw[208], raw[209]]),
                m: f16::ZERO,
                sc: [sc(0), sc(1)],
            }
        })))
    }

    /// The tiled layout of `rows x cols` weights whose block `b` of row `row` is `block(row, b)`.
    fn build(rows: usize, cols: usize, kind: Kind, block: impl Fn(usize, usize) -> Block) -> Self {
        let kb = cols / QK;
        let tiles = rows.div_ceil(TR);
        let tbb = kind.tile_block_bytes();
        let q4 = matches!(kind, Kind::Q4 { .. });
        let mins = kind == Kind::Q4 { s16: true };
        let mut q = vec![0u8; tiles * kb * tbb];
        let mut d = vec![f16::ZERO; tiles * kb * TR];
        let mut m = vec![f16::ZERO; if mins { tiles * kb * TR } else { 0 }];
        let q6 = kind == Kind::Q6;
        let mut sc = vec![0i8; if q6 { tiles * kb * TR * 2 } else { 0 }];
        for row in 0..rows {
            let (t, j) = (row / TR, row % TR);
            for b in 0..kb {
                let blk = block(row, b);
                let tb = t * kb + b;
                let dst = &mut q[tb * tbb..][..tbb];
                for (i, &v) in blk.q.iter().enumerate() {
                    if q4 {
                        let (hi, i) = (i / (QK / 2), i % (QK / 2));
                        dst[64 * (i / 4) + 4 * j + i % 4] |= v << (4 * hi);
                    } else {
                        dst[64 * (i / 4) + 4 * j + i % 4] = v;
                    }
                }
                d[tb * TR + j] = blk.d;
                if mins {
                    m[tb * TR + j] = blk.m;
                }
                if q6 {
                    sc[tb * 2 * TR + j] = blk.sc[0];
                    sc[tb * 2 * TR + TR + j] = blk.sc[1];
                }
            }
        }
        Self {
            rows,
            cols,
            kind,
            q,
            d,
            m,
            sc,
        }
    }

    /// Row `row`'s block `b`, read back from the layout.
    fn block(&self, row: usize, b: usize) -> Block {
        let kb = self.cols / QK;
        let (t, j) = (row / TR, row % TR);
        let tb = t * kb + b;
        let tbb = self.kind.tile_block_bytes();
        let src = &self.q[tb * tbb..][..tbb];
        let mut q = [0u8; QK];
        for (i, o) in q.iter_mut().enumerate() {
            *o = match self.kind {
                Kind::Q8 | Kind::Q6 => src[64 * (i / 4) + 4 * j + i % 4],
                Kind::Q4 { .. } => {
                    let (hi, i) = (i / (QK / 2), i % (QK / 2));
                    (src[64 * (i / 4) + 4 * j + i % 4] >> (4 * hi)) & 15
                }
            };
        }
        Block {
            q,
            d: self.d[tb * TR + j],
            m: self.m.get(tb * TR + j).copied().unwrap_or(f16::ZERO),
            sc: if self.kind == Kind::Q6 {
                [self.sc[tb * 2 * TR + j], self.sc[tb * 2 * TR + TR + j]]
            } else {
                [0; 2]
            },
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Bytes held (quants incl. the last tile's padding, f16 scales and minimums).
    pub fn bytes(&self) -> usize {
        self.q.len() + (self.d.len() + self.m.len()) * 2 + self.sc.len()
    }

    /// Whether this product is used for a CPU matrix of width `cols` (any multiple of 32:
    /// faster than candle's Q8_0 kernels at 1 and 16 rows on every shape of the demo,
    /// `examples/q8_bench.rs`, docs/perf.md).
    pub fn preferred_for(cols: usize) -> bool {
        cols > 0 && cols.is_multiple_of(QK)
    }

    /// Several matrices of one width and kind stacked along the rows (bit-exact: rows are
    /// independent); None when they differ.
    pub fn stack(parts: &[&QMatrix]) -> Option<QMatrix> {
        let first = parts.first()?;
        let (cols, kind) = (first.cols, first.kind);
        if parts.iter().any(|p| p.cols != cols || p.kind != kind) {
            return None;
        }
        let mut at = Vec::new(); // (part, row) of each stacked row
        for (i, p) in parts.iter().enumerate() {
            at.extend((0..p.rows).map(|r| (i, r)));
        }
        Some(Self::build(at.len(), cols, kind, |row, b| {
            let (i, r) = at[row];
            parts[i].block(r, b)
        }))
    }

    /// How this matrix's activations are quantized: Q4_0 / Q4_1 by llama.cpp's x86 rule
    /// ([`Rule::X86`]: against the llama.cpp fixture, SmolLM2's Q4_1 largest divergence gap
    /// 0.245 -> 0.085), the others by ggml's portable one (Gemma-3-270M's Q5_0 / Q8_0 / Q6_K:
    /// largest gap 0.084 with it, 0.254 with the x86 rule; docs/perf.md, session 47). That is
    /// the fixture's near-ties, not llama.cpp's arithmetic: b11434 on x86 quantizes Q5_0 /
    /// Q8_0 activations by the x86 rule too (with it and llama.cpp's 8-lane summation order
    /// our products give its bits, session 51), and Q6_K's to Q8_K (256 a block).
    fn rule(&self) -> Rule {
        match self.kind {
            Kind::Q4 { .. } => Rule::X86,
            _ => Rule::Portable,
        }
    }

    /// The activation rows as this matrix multiplies them: the block sums `d * sum(q)`
    /// rounded to f16 for Q4_1 (as ggml's Q8_1 stores them, what llama.cpp and candle
    /// multiply Q4_1 by); for Q6 each block's first-half quant sum.
    fn prepare(&self, x: &mut QRows) {
        if let Kind::Q4 { s16: true } = self.kind {
            for v in &mut x.s {
                *v = f16::from_f32(*v).to_f32();
            }
        }
        if self.kind == Kind::Q6 {
            x.h0 =
                x.q.chunks_exact(QK)
                    .map(|b| b[..QK / 2].iter().map(|&v| v as i32).sum())
                    .collect();
        }
    }

    /// `x [.., cols]` (any float dtype, CPU) -> `[.., rows]` f32.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let k = *dims.last().unwrap_or(&0);
        if k != self.cols {
            return Err(crate::Error::input(format!(
                "q8 matmul: input width {k}, weight width {}",
                self.cols
            )));
        }
        // the activations in place when they are f32 and contiguous already (a copy otherwise)
        let x = x.to_dtype(DType::F32)?;
        let x = if x.is_contiguous() {
            x
        } else {
            x.contiguous()?
        };
        let mut xr = {
            let (st, l) = x.storage_and_layout();
            let candle_core::Storage::Cpu(c) = &*st else {
                return Err(crate::Error::input(
                    "q8 matmul: the input is not on the CPU",
                ));
            };
            let xv = &c.as_slice::<f32>()?[l.start_offset()..l.start_offset() + x.elem_count()];
            quantize_rows(xv, k, self.rule())
        };
        let m = x.elem_count() / k.max(1);
        self.prepare(&mut xr);
        let n = self.rows;
        // every (row, column) is written below, so the buffer starts uninitialized
        let mut out: Vec<f32> = Vec::with_capacity(m * n);
        let out_ptr = out.as_mut_ptr() as usize;
        let simd = simd_level();
        candle_core::utils::barrier_pool().execute_chunked(n.div_ceil(TR), |range| {
            let out = out_ptr as *mut f32;
            let mut tile = [[0f32; TR]; ROWS_PER_PASS];
            let rpp = rows_per_pass(simd);
            for t in range {
                let nr = (n - t * TR).min(TR);
                for r0 in (0..m).step_by(rpp) {
                    let nx = (m - r0).min(rpp);
                    tile_rows(simd, self, t, &xr, r0, nx, &mut tile);
                    for (r, vals) in tile.iter().take(nx).enumerate() {
                        for (j, v) in vals.iter().take(nr).enumerate() {
                            // SAFETY: each (row, t * TR + j) is written by exactly one chunk.
                            unsafe { *out.add((r0 + r) * n + t * TR + j) = *v };
                        }
                    }
                }
            }
        });
        // SAFETY: the tiles cover columns 0..n of rows 0..m, each written once above.
        unsafe { out.set_len(m * n) };
        let mut od = dims;
        *od.last_mut().expect("rank >= 1") = n;
        Ok(Tensor::from_vec(out, od, &Device::Cpu)?)
    }
}

/// Most activation rows multiplied against one loaded tile block before the next is loaded
/// (their accumulators stay in registers): see [`rows_per_pass`].
const ROWS_PER_PASS: usize = 8;

/// Activation rows per pass over a tile at a SIMD level: 8 with AVX-512 (32 registers: a Q4
/// block unpacked once serves 8 rows), 4 otherwise (AVX2's 16 registers). A row's arithmetic
/// does not depend on it (exact int32 block sums, then the same fma order per row).
fn rows_per_pass(simd: Simd) -> usize {
    match simd {
        Simd::Avx512 => ROWS_PER_PASS,
        _ => 4,
    }
}

/// Activation rows quantized per block of 32 (row-major): quants, scales, `d * sum(q)` per
/// block (what a Q4 weight's minimum multiplies; see [`QMatrix::prepare`]) and the exact
/// `sum(q)` (what the Q8 weights' `+ 128` offset multiplies).
struct QRows {
    q: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    sum: Vec<i32>,
    /// Per block, the first 16 quants' sum (what a Q6 weight's first half needs; filled by
    /// [`QMatrix::prepare`] for Q6 only, empty otherwise).
    h0: Vec<i32>,
}

/// An activation quantization rule per block of 32 (both keep `d = amax / 127` as f16).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Rule {
    /// ggml's portable reference (`quantize_row_q8_0_ref`): `q = round(x * (1 / d))`, halves
    /// away from zero; `s = d * sum(q)` with `d` as rounded.
    Portable,
    /// llama.cpp's x86 code (`quantize_row_q8_0` / `q8_1` with AVX2): `q = x * (127 / amax)`
    /// rounded half to even (`127 / amax` is one ulp from `1 / d` for some amax: at 11, 5.5
    /// quantizes to 64, not 63); `s = d * sum(q)` with `d` before its f16 rounding.
    X86,
}

/// Per block of 32, by `rule`: `d` (f16-rounded), the quants, `d * sum(q)` (ggml's Q8_1 `s`,
/// rounded to f16 where a Q4_1 matrix multiplies it: [`QMatrix::prepare`]) and `sum(q)`.
fn quantize_rows(x: &[f32], k: usize, rule: Rule) -> QRows {
    debug_assert_eq!(x.len() % k, 0);
    let nb = x.len() / QK;
    let mut r = QRows {
        q: vec![0i8; x.len()],
        d: vec![0f32; nb],
        s: vec![0f32; nb],
        sum: vec![0i32; nb],
        h0: vec![],
    };
    let simd = simd_level();
    // rows split over the pool when there are enough of them (a verify block, a prompt): each
    // row's blocks are its own, so the bits do not depend on the split
    let (bpr, rows) = (k / QK, x.len() / k.max(1));
    let ptrs = (
        r.q.as_mut_ptr() as usize,
        r.d.as_mut_ptr() as usize,
        r.s.as_mut_ptr() as usize,
        r.sum.as_mut_ptr() as usize,
    );
    super::cpu_ops::for_items(rows, k, |i| {
        // SAFETY: row i's quants and blocks, inside the buffers and written by this item only.
        let blocks = unsafe {
            use std::slice::from_raw_parts_mut as part;
            QBlocks {
                q: part((ptrs.0 as *mut i8).add(i * k), k),
                d: part((ptrs.1 as *mut f32).add(i * bpr), bpr),
                s: part((ptrs.2 as *mut f32).add(i * bpr), bpr),
                sum: part((ptrs.3 as *mut i32).add(i * bpr), bpr),
            }
        };
        quantize_blocks_with(simd, rule, &x[i * k..(i + 1) * k], blocks);
    });
    r
}

/// Where [`quantize_blocks_with`] writes: the quants and per-block values of some rows.
struct QBlocks<'a> {
    q: &'a mut [i8],
    d: &'a mut [f32],
    s: &'a mut [f32],
    sum: &'a mut [i32],
}

impl QRows {
    #[cfg(test)]
    fn blocks(&mut self) -> QBlocks<'_> {
        QBlocks {
            q: &mut self.q,
            d: &mut self.d,
            s: &mut self.s,
            sum: &mut self.sum,
        }
    }
}

/// [`quantize_rows`]'s blocks with the given path (every path gives the same bits).
fn quantize_blocks_with(simd: Simd, rule: Rule, x: &[f32], r: QBlocks<'_>) {
    let x86 = rule == Rule::X86;
    #[cfg(target_arch = "x86_64")]
    match (simd, x86) {
        // SAFETY: the level is one the CPU has (simd_level / simd_levels); r holds the blocks.
        (Simd::Avx512, false) => return unsafe { x86::quantize_blocks::<false>(x, r) },
        (Simd::Avx512, true) => return unsafe { x86::quantize_blocks::<true>(x, r) },
        (Simd::Avx2, false) => return unsafe { x86::quantize_blocks_avx2::<false>(x, r) },
        (Simd::Avx2, true) => return unsafe { x86::quantize_blocks_avx2::<true>(x, r) },
        (Simd::Scalar, _) => {}
    }
    let _ = simd;
    match x86 {
        false => quantize_blocks_scalar::<false>(x, r),
        true => quantize_blocks_scalar::<true>(x, r),
    }
}

/// One block's scale from its largest magnitude under [`Rule`] (`X86`: the x86 rule):
/// (`d` rounded to f16, the multiplier, the `d` that `s` is made with).
fn block_scale<const X86: bool>(amax: f32) -> (f32, f32, f32) {
    let dd = amax / 127.0;
    let d16 = f16::from_f32(dd).to_f32();
    match X86 {
        // `amax != 0` as C reads it (true for NaN)
        true => (d16, if amax != 0.0 { 127.0 / amax } else { 0.0 }, dd),
        false => (d16, if dd != 0.0 { 1.0 / dd } else { 0.0 }, d16),
    }
}

/// [`quantize_rows`]'s reference (the SIMD paths give the same bits).
fn quantize_blocks_scalar<const X86: bool>(x: &[f32], r: QBlocks<'_>) {
    for (b, (xs, qs)) in x.chunks_exact(QK).zip(r.q.chunks_exact_mut(QK)).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let (dd, id, ds) = block_scale::<X86>(amax);
        let mut sum = 0i32;
        for (o, v) in qs.iter_mut().zip(xs) {
            let y = v * id;
            *o = if X86 { y.round_ties_even() } else { y.round() } as i8;
            sum += *o as i32;
        }
        r.d[b] = dd;
        r.s[b] = ds * sum as f32;
        r.sum[b] = sum;
    }
}

/// Tile `t` of `w` times activation rows `r0..r0 + nx` of `x` (nx <= ROWS_PER_PASS): `out[r][j]`
/// = row `t * 16 + j` of the product for activation row `r0 + r` (padding rows give 0). `simd`
/// from [`simd_level`].
fn tile_rows(
    simd: Simd,
    w: &QMatrix,
    t: usize,
    x: &QRows,
    r0: usize,
    nx: usize,
    out: &mut [[f32; TR]; ROWS_PER_PASS],
) {
    #[cfg(target_arch = "x86_64")]
    {
        macro_rules! by_rows {
            ($f:ident, $q4:literal) => {
                match nx {
                    1 => x86::$f::<$q4, 1>(w, t, x, r0, out),
                    2 => x86::$f::<$q4, 2>(w, t, x, r0, out),
                    3 => x86::$f::<$q4, 3>(w, t, x, r0, out),
                    4 => x86::$f::<$q4, 4>(w, t, x, r0, out),
                    5 => x86::$f::<$q4, 5>(w, t, x, r0, out),
                    6 => x86::$f::<$q4, 6>(w, t, x, r0, out),
                    7 => x86::$f::<$q4, 7>(w, t, x, r0, out),
                    _ => x86::$f::<$q4, 8>(w, t, x, r0, out),
                }
            };
        }
        macro_rules! by_rows4 {
            ($f:ident, $q4:literal) => {
                match nx {
                    1 => x86::$f::<$q4, 1>(w, t, x, r0, out),
                    2 => x86::$f::<$q4, 2>(w, t, x, r0, out),
                    3 => x86::$f::<$q4, 3>(w, t, x, r0, out),
                    _ => x86::$f::<$q4, 4>(w, t, x, r0, out),
                }
            };
        }
        let q4 = matches!(w.kind, Kind::Q4 { .. });
        macro_rules! q6_rows {
            ($f:ident) => {
                match nx {
                    1 => x86::$f::<1>(w, t, x, r0, out),
                    2 => x86::$f::<2>(w, t, x, r0, out),
                    3 => x86::$f::<3>(w, t, x, r0, out),
                    4 => x86::$f::<4>(w, t, x, r0, out),
                    5 => x86::$f::<5>(w, t, x, r0, out),
                    6 => x86::$f::<6>(w, t, x, r0, out),
                    7 => x86::$f::<7>(w, t, x, r0, out),
                    _ => x86::$f::<8>(w, t, x, r0, out),
                }
            };
        }
        if w.kind == Kind::Q6 {
            // SAFETY: as below; x.h0 is filled (QMatrix::prepare).
            match simd {
                Simd::Avx512 => return unsafe { q6_rows!(tile_rows_q6) },
                Simd::Avx2 if nx <= 4 => return unsafe { q6_rows!(tile_rows_q6_avx2) },
                _ => {}
            }
            return tile_rows_scalar(w, t, x, r0, nx, out);
        }
        // SAFETY: the level is one the CPU has (simd_level / simd_levels); t < tiles,
        // r0 + nx <= x's rows (nx <= rows_per_pass(simd)).
        match (simd, q4) {
            (Simd::Avx512, false) => return unsafe { by_rows!(tile_rows, false) },
            (Simd::Avx512, true) => return unsafe { by_rows!(tile_rows, true) },
            (Simd::Avx2, false) if nx <= 4 => return unsafe { by_rows4!(tile_rows_avx2, false) },
            (Simd::Avx2, true) if nx <= 4 => return unsafe { by_rows4!(tile_rows_avx2, true) },
            _ => {}
        }
    }
    let _ = simd;
    tile_rows_scalar(w, t, x, r0, nx, out)
}

/// The reference, in the SIMD path's order: per (weight row, activation row) and block, the
/// exact int32 sum of `q_w * q_x` (Q8: `(q + 128) * q_x - 128 sum(q_x)`), then `acc =
/// fma(sum, d_w * d_x, acc)` in block order; a Q4 weight's minimum adds `m * (d_x sum(q_x))`
/// to a second sum, added at the end. Same bits as the SIMD path.
fn tile_rows_scalar(
    w: &QMatrix,
    t: usize,
    x: &QRows,
    r0: usize,
    nx: usize,
    out: &mut [[f32; TR]; ROWS_PER_PASS],
) {
    let k = w.cols;
    let kb = k / QK;
    let q4 = matches!(w.kind, Kind::Q4 { .. });
    if w.kind == Kind::Q6 {
        for (r, o) in out.iter_mut().enumerate().take(nx) {
            let xr = r0 + r;
            for (j, v) in o.iter_mut().enumerate() {
                let row = t * TR + j;
                if row >= w.rows {
                    *v = 0.0;
                    continue;
                }
                let mut acc = 0f32;
                for b in 0..kb {
                    let blk = w.block(row, b);
                    let xb = xr * kb + b;
                    let xq = &x.q[xb * QK..][..QK];
                    let half = |h: usize| -> i32 {
                        let s: i32 = (0..QK / 2)
                            .map(|i| blk.q[16 * h + i] as i32 * xq[16 * h + i] as i32)
                            .sum();
                        let xs = if h == 0 {
                            x.h0[xb]
                        } else {
                            x.sum[xb] - x.h0[xb]
                        };
                        blk.sc[h] as i32 * (s - 32 * xs)
                    };
                    let sum = half(0) + half(1);
                    acc = (sum as f32).mul_add(blk.d.to_f32() * x.d[xb], acc);
                }
                *v = acc;
            }
        }
        return;
    }
    for (r, o) in out.iter_mut().enumerate().take(nx) {
        let xr = r0 + r;
        for (j, v) in o.iter_mut().enumerate() {
            let row = t * TR + j;
            if row >= w.rows {
                *v = 0.0;
                continue;
            }
            let (mut acc, mut macc) = (0f32, 0f32);
            for b in 0..kb {
                let blk = w.block(row, b);
                let xb = xr * kb + b;
                let xq = &x.q[xb * QK..][..QK];
                let mut sum: i32 = if q4 { 0 } else { -128 * x.sum[xb] };
                for (&a, &c) in blk.q.iter().zip(xq) {
                    sum += a as i32 * c as i32;
                }
                let d = blk.d.to_f32();
                acc = (sum as f32).mul_add(d * x.d[xb], acc);
                if q4 {
                    // Q4_0: m = -8 d, exact in f32
                    let m = if w.kind == (Kind::Q4 { s16: true }) {
                        blk.m.to_f32()
                    } else {
                        -8.0 * d
                    };
                    macc = m.mul_add(x.s[xb], macc);
                }
            }
            *v = if q4 { acc + macc } else { acc };
        }
    }
}

/// Whether a GGUF matrix of type `dt` and width `cols` keeps its stored weights on the CPU
/// (multiplied by [`QMatrix`]) instead of being requantized to Q8_0: Q4_0 / Q4_1 (as
/// stored), Q5_0 (its exact values in the Q8 layout: 34 bytes a block instead of 22, see
/// [`kept_block_bytes`]), Q6_K at widths of whole super-blocks (its 6-bit values and
/// per-16 scales exactly: 36 bytes a block of 32 instead of 26.25), a width this product is
/// preferred for
/// ([`QMatrix::preferred_for`]), a SIMD path available (AVX-512 VNNI or AVX2; the scalar one
/// is a reference, not a fast path), and neither `DFLASH_Q8=0` nor `DFLASH_Q4=0`.
pub fn keeps_as_stored(dt: GgmlDType, cols: usize) -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    (matches!(dt, GgmlDType::Q4_0 | GgmlDType::Q4_1 | GgmlDType::Q5_0)
        || (dt == GgmlDType::Q6K && cols.is_multiple_of(256)))
        && QMatrix::preferred_for(cols)
        && enabled()
        && *ON.get_or_init(|| simd_level() != Simd::Scalar && crate::switches::get().q4)
}

/// Bytes a block of 32 weights of GGUF type `dt` takes once loaded by [`QMatrix`] (the stored
/// size, except Q5_0 held in the Q8 layout).
pub fn kept_block_bytes(dt: GgmlDType) -> usize {
    match dt {
        GgmlDType::Q5_0 => 2 + QK,
        // quants, the f16 scale repeated per block, two int8 half scales
        GgmlDType::Q6K => QK + 2 + 2,
        dt => dt.type_size() * QK / dt.block_size(),
    }
}

/// Whether `Linear` uses this product at all (`DFLASH_Q8=0` keeps candle's for every type).
pub fn enabled() -> bool {
    crate::switches::get().q8
}

/// The instruction sets the int8 product runs on. Every path gives the same bits (exact
/// int32 block sums, then the same f32 operations in the same order).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// The reference (also what runs where neither below is available).
    Scalar,
    /// AVX2 + FMA + F16C: `vpmaddubsw` / `vpmaddwd` on 8 rows a register (Q8 by the sign trick:
    /// `|w| * sign(x, w)`, no saturation), two registers a tile.
    Avx2,
    /// AVX-512 F/BW/VNNI + FMA: `vpdpbusd` on the 16 rows of a tile.
    Avx512,
}

impl Simd {
    pub fn name(self) -> &'static str {
        match self {
            Simd::Scalar => "scalar",
            Simd::Avx2 => "avx2",
            Simd::Avx512 => "avx512-vnni",
        }
    }
}

/// The fastest path this CPU has (checked once; `DFLASH_Q8_SCALAR=1` forces the scalar one).
pub fn simd_level() -> Simd {
    static L: std::sync::OnceLock<Simd> = std::sync::OnceLock::new();
    *L.get_or_init(|| {
        if crate::switches::get().q8_scalar {
            return Simd::Scalar;
        }
        *simd_levels().last().unwrap_or(&Simd::Scalar)
    })
}

/// Every path this CPU can run, slowest first (tests compare them all with the reference).
pub(crate) fn simd_levels() -> Vec<Simd> {
    let mut v = vec![Simd::Scalar];
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            v.push(Simd::Avx2);
        }
        if is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512vnni")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("fma")
        {
            v.push(Simd::Avx512);
        }
    }
    v
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{block_scale, QBlocks, QMatrix, QRows, QK, ROWS_PER_PASS, TR};
    use std::arch::x86_64::*;

    /// [`super::quantize_blocks_scalar`], 16 values a register: the same max, the same
    /// products; `X86`: rounding half to even (the conversion's, asked for explicitly), else
    /// half away from zero as `f32::round` (truncate, then step away from zero where the exact
    /// remainder is at least one half).
    ///
    /// # Safety
    /// AVX-512 F/BW; `r` holds `x.len() / 32` blocks.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub unsafe fn quantize_blocks<const X86: bool>(x: &[f32], r: QBlocks<'_>) {
        let sign = _mm512_set1_ps(-0.0);
        let half = _mm512_set1_ps(0.5);
        let one = _mm512_set1_ps(1.0);
        let nb = x.len() / QK;
        // 16 blocks at a time: their largest magnitudes first, then their scales in one pass of
        // vector divisions and f16 roundings (`block_scale`'s operations, lane by lane: the same
        // bits), then the quants
        let mut b0 = 0;
        while b0 < nb {
            let g = (nb - b0).min(16);
            let mut amax = [0f32; 16];
            for (t, a) in amax.iter_mut().enumerate().take(g) {
                let p = x.as_ptr().add((b0 + t) * QK);
                let (v0, v1) = (_mm512_loadu_ps(p), _mm512_loadu_ps(p.add(16)));
                *a = _mm512_reduce_max_ps(_mm512_max_ps(
                    _mm512_andnot_ps(sign, v0),
                    _mm512_andnot_ps(sign, v1),
                ));
            }
            let am = _mm512_loadu_ps(amax.as_ptr());
            let dd = _mm512_div_ps(am, _mm512_set1_ps(127.0));
            // `dd != 0.0` / `amax != 0.0` as Rust reads them (true for NaN): unordered not-equal
            let id = if X86 {
                let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(am, _mm512_setzero_ps());
                _mm512_maskz_div_ps(nz, _mm512_set1_ps(127.0), am)
            } else {
                let nz = _mm512_cmp_ps_mask::<_CMP_NEQ_UQ>(dd, _mm512_setzero_ps());
                _mm512_maskz_div_ps(nz, one, dd)
            };
            let d16 = _mm512_cvtph_ps(_mm512_cvtps_ph::<
                { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
            >(dd));
            let (mut ids, mut ds) = ([0f32; 16], [0f32; 16]);
            _mm512_storeu_ps(ids.as_mut_ptr(), id);
            _mm512_storeu_ps(ds.as_mut_ptr(), d16);
            let mut sums = [0i32; 16];
            for t in 0..g {
                let b = b0 + t;
                let p = x.as_ptr().add(b * QK);
                let idv = _mm512_set1_ps(ids[t]);
                let mut sum = _mm512_setzero_si512();
                for h in 0..2 {
                    let y = _mm512_mul_ps(_mm512_loadu_ps(p.add(16 * h)), idv);
                    let q = if X86 {
                        _mm512_cvt_roundps_epi32::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                            y,
                        )
                    } else {
                        let tr =
                            _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                        let frac = _mm512_andnot_ps(sign, _mm512_sub_ps(y, tr));
                        let away = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, half);
                        let step = _mm512_or_ps(_mm512_and_ps(y, sign), one); // +-1, y's sign
                        _mm512_cvttps_epi32(_mm512_mask_add_ps(tr, away, tr, step))
                    };
                    sum = _mm512_add_epi32(sum, q);
                    _mm_storeu_si128(
                        r.q.as_mut_ptr().add(b * QK + 16 * h) as *mut __m128i,
                        _mm512_cvtepi32_epi8(q),
                    );
                }
                sums[t] = _mm512_reduce_add_epi32(sum);
            }
            // `s` with `d` before its f16 rounding (x86 rule) or after (portable)
            let sv = _mm512_mul_ps(
                if X86 { dd } else { d16 },
                _mm512_cvtepi32_ps(_mm512_loadu_si512(sums.as_ptr() as *const _)),
            );
            let mut ss = [0f32; 16];
            _mm512_storeu_ps(ss.as_mut_ptr(), sv);
            r.d[b0..b0 + g].copy_from_slice(&ds[..g]);
            r.s[b0..b0 + g].copy_from_slice(&ss[..g]);
            r.sum[b0..b0 + g].copy_from_slice(&sums[..g]);
            b0 += g;
        }
    }

    /// [`super::tile_rows`] with AVX-512: per block, the tile's 8 groups of 4 weights of 16
    /// rows (Q4: 4 loads, split into nibbles) against each activation row's 4-byte groups
    /// broadcast (`vpdpbusd`: u8 weights x i8 activations, 16 exact int32 sums), then one
    /// conversion and one fma per (block, activation row) for all 16 rows.
    ///
    /// # Safety
    /// The CPU must have AVX-512 F/BW/VNNI and FMA; `w.kind` is Q4 iff `Q4`; `t` < the
    /// tile count; rows `r0..r0 + R` exist in `x`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub unsafe fn tile_rows<const Q4: bool, const R: usize>(
        w: &QMatrix,
        t: usize,
        x: &QRows,
        r0: usize,
        out: &mut [[f32; TR]; ROWS_PER_PASS],
    ) {
        let kb = w.cols / QK;
        let tbb = w.kind.tile_block_bytes();
        let mins = !w.m.is_empty();
        let lo = _mm512_set1_epi8(0x0f);
        let mut acc = [_mm512_setzero_ps(); R];
        let mut macc = [_mm512_setzero_ps(); R];
        let qp = w.q.as_ptr();
        let xq = x.q.as_ptr();
        for b in 0..kb {
            let tb = t * kb + b;
            let p = qp.add(tb * tbb);
            let mut g = [_mm512_setzero_si512(); 8];
            if Q4 {
                for c in 0..4 {
                    let v = _mm512_loadu_si512(p.add(64 * c) as *const _);
                    g[c] = _mm512_and_si512(v, lo);
                    g[c + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), lo);
                }
            } else {
                for (c, gc) in g.iter_mut().enumerate() {
                    *gc = _mm512_loadu_si512(p.add(64 * c) as *const _);
                }
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(tb * TR) as *const _));
            let mv = if !Q4 {
                _mm512_setzero_ps()
            } else if mins {
                _mm512_cvtph_ps(_mm256_loadu_si256(w.m.as_ptr().add(tb * TR) as *const _))
            } else {
                _mm512_mul_ps(dv, _mm512_set1_ps(-8.0)) // Q4_0: exact
            };
            for r in 0..R {
                let xb = (r0 + r) * kb + b;
                let xp = xq.add(xb * QK) as *const i32;
                let mut s = if Q4 {
                    _mm512_setzero_si512()
                } else {
                    _mm512_set1_epi32(-128 * *x.sum.get_unchecked(xb))
                };
                for (c, gc) in g.iter().enumerate() {
                    s = _mm512_dpbusd_epi32(s, *gc, _mm512_set1_epi32(xp.add(c).read_unaligned()));
                }
                let sc = _mm512_mul_ps(dv, _mm512_set1_ps(*x.d.get_unchecked(xb)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), sc, acc[r]);
                if Q4 {
                    macc[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(*x.s.get_unchecked(xb)), macc[r]);
                }
            }
        }
        for r in 0..R {
            let v = if Q4 {
                _mm512_add_ps(acc[r], macc[r])
            } else {
                acc[r]
            };
            _mm512_storeu_ps(out[r].as_mut_ptr(), v);
        }
    }

    /// [`tile_rows`] for Q6 weights (see [`super::Kind::Q6`]): per block two `vpdpbusd`
    /// chains (the halves), each corrected by `32 X_h` and multiplied by its rows' int8 scales
    /// in int32, then one fma per row as the other kinds.
    ///
    /// # Safety
    /// As [`tile_rows`]; `w.kind` is Q6 and `x.h0` is filled.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,fma")]
    pub unsafe fn tile_rows_q6<const R: usize>(
        w: &QMatrix,
        t: usize,
        x: &QRows,
        r0: usize,
        out: &mut [[f32; TR]; ROWS_PER_PASS],
    ) {
        let kb = w.cols / QK;
        let tbb = w.kind.tile_block_bytes();
        let mut acc = [_mm512_setzero_ps(); R];
        let qp = w.q.as_ptr();
        let xq = x.q.as_ptr();
        for b in 0..kb {
            let tb = t * kb + b;
            let p = qp.add(tb * tbb);
            let mut g = [_mm512_setzero_si512(); 8];
            for (c, gc) in g.iter_mut().enumerate() {
                *gc = _mm512_loadu_si512(p.add(64 * c) as *const _);
            }
            let dv = _mm512_cvtph_ps(_mm256_loadu_si256(w.d.as_ptr().add(tb * TR) as *const _));
            let scp = w.sc.as_ptr().add(tb * 2 * TR);
            let sc0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(scp as *const _));
            let sc1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(scp.add(TR) as *const _));
            for (r, acc_r) in acc.iter_mut().enumerate() {
                let xb = (r0 + r) * kb + b;
                let xp = xq.add(xb * QK) as *const i32;
                let x0 = *x.h0.get_unchecked(xb);
                let x1 = *x.sum.get_unchecked(xb) - x0;
                let mut s0 = _mm512_set1_epi32(-32 * x0);
                let mut s1 = _mm512_set1_epi32(-32 * x1);
                for c in 0..4 {
                    s0 = _mm512_dpbusd_epi32(
                        s0,
                        g[c],
                        _mm512_set1_epi32(xp.add(c).read_unaligned()),
                    );
                    s1 = _mm512_dpbusd_epi32(
                        s1,
                        g[c + 4],
                        _mm512_set1_epi32(xp.add(c + 4).read_unaligned()),
                    );
                }
                let s = _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1));
                let scl = _mm512_mul_ps(dv, _mm512_set1_ps(*x.d.get_unchecked(xb)));
                *acc_r = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scl, *acc_r);
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            _mm512_storeu_ps(o.as_mut_ptr(), *a);
        }
    }

    /// [`tile_rows_q6`] with AVX2 (8 rows a register, two registers per tile row): the half
    /// sums by `vpmaddubsw` (q < 64 and |x| <= 127: a pair is at most 16,002, no saturation)
    /// and `vpmaddwd`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C; as [`tile_rows_q6`] otherwise.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_rows_q6_avx2<const R: usize>(
        w: &QMatrix,
        t: usize,
        x: &QRows,
        r0: usize,
        out: &mut [[f32; TR]; ROWS_PER_PASS],
    ) {
        let kb = w.cols / QK;
        let tbb = w.kind.tile_block_bytes();
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let qp = w.q.as_ptr();
        let xq = x.q.as_ptr();
        for b in 0..kb {
            let tb = t * kb + b;
            let p = qp.add(tb * tbb);
            let scp = w.sc.as_ptr().add(tb * 2 * TR);
            for h in 0..2usize {
                // rows 8h .. 8h + 8 of the tile
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(
                    w.d.as_ptr().add(tb * TR + 8 * h) as *const _
                ));
                let sc0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(scp.add(8 * h) as *const _));
                let sc1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(scp.add(TR + 8 * h) as *const _));
                let g: [__m256i; 8] =
                    std::array::from_fn(|c| _mm256_loadu_si256(p.add(64 * c + 32 * h) as *const _));
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xb = (r0 + r) * kb + b;
                    let xp = xq.add(xb * QK) as *const i32;
                    let x0 = *x.h0.get_unchecked(xb);
                    let x1 = *x.sum.get_unchecked(xb) - x0;
                    let mut s0 = _mm256_set1_epi32(-32 * x0);
                    let mut s1 = _mm256_set1_epi32(-32 * x1);
                    for c in 0..4 {
                        let xa = _mm256_set1_epi32(xp.add(c).read_unaligned());
                        let xb2 = _mm256_set1_epi32(xp.add(c + 4).read_unaligned());
                        s0 = _mm256_add_epi32(
                            s0,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(g[c], xa), ones),
                        );
                        s1 = _mm256_add_epi32(
                            s1,
                            _mm256_madd_epi16(_mm256_maddubs_epi16(g[c + 4], xb2), ones),
                        );
                    }
                    let s =
                        _mm256_add_epi32(_mm256_mullo_epi32(s0, sc0), _mm256_mullo_epi32(s1, sc1));
                    let scl = _mm256_mul_ps(dv, _mm256_set1_ps(*x.d.get_unchecked(xb)));
                    acc_r[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), scl, acc_r[h]);
                }
            }
        }
        for (o, a) in out.iter_mut().zip(&acc) {
            for (h, ah) in a.iter().enumerate() {
                _mm256_storeu_ps(o.as_mut_ptr().add(8 * h), *ah);
            }
        }
    }

    /// [`quantize_blocks`] with AVX2, 8 values a register: the same max, products and
    /// rounding (`X86`: half to even; else truncate, then step away from zero where the
    /// remainder is at least one half).
    ///
    /// # Safety
    /// AVX2; `r` holds `x.len() / 32` blocks.
    #[target_feature(enable = "avx2")]
    pub unsafe fn quantize_blocks_avx2<const X86: bool>(x: &[f32], r: QBlocks<'_>) {
        let sign = _mm256_set1_ps(-0.0);
        let half = _mm256_set1_ps(0.5);
        let one = _mm256_set1_ps(1.0);
        // _mm256_packs_epi32 / _epi16 interleave the 128-bit lanes: this puts them back.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        for b in 0..x.len() / QK {
            let p = x.as_ptr().add(b * QK);
            let v = [
                _mm256_loadu_ps(p),
                _mm256_loadu_ps(p.add(8)),
                _mm256_loadu_ps(p.add(16)),
                _mm256_loadu_ps(p.add(24)),
            ];
            let m = _mm256_max_ps(
                _mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])),
            );
            let m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
            let amax = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
            let (dd, id, ds) = block_scale::<X86>(amax);
            let idv = _mm256_set1_ps(id);
            let mut q = [_mm256_setzero_si256(); 4];
            let mut sum = _mm256_setzero_si256();
            for (h, v) in v.into_iter().enumerate() {
                let y = _mm256_mul_ps(v, idv);
                q[h] = if X86 {
                    _mm256_cvttps_epi32(_mm256_round_ps::<
                        { _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC },
                    >(y))
                } else {
                    let t = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
                    let frac = _mm256_andnot_ps(sign, _mm256_sub_ps(y, t));
                    let away = _mm256_cmp_ps::<_CMP_GE_OQ>(frac, half);
                    let step = _mm256_and_ps(away, _mm256_or_ps(_mm256_and_ps(y, sign), one));
                    _mm256_cvttps_epi32(_mm256_add_ps(t, step))
                };
                sum = _mm256_add_epi32(sum, q[h]);
            }
            let w16 = _mm256_packs_epi32(q[0], q[1]);
            let w16b = _mm256_packs_epi32(q[2], q[3]);
            let w8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w16, w16b), order);
            _mm256_storeu_si256(r.q.as_mut_ptr().add(b * QK) as *mut __m256i, w8);
            let s4 = _mm_add_epi32(
                _mm256_castsi256_si128(sum),
                _mm256_extracti128_si256(sum, 1),
            );
            let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
            let s1 = _mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1));
            let sum = _mm_cvtsi128_si32(s1);
            r.d[b] = dd;
            r.s[b] = ds * sum as f32;
            r.sum[b] = sum;
        }
    }

    /// [`tile_rows`] with AVX2: the 16 rows of a tile as two registers of 8. Per block and
    /// group of 4 weights, each activation row's 4 bytes broadcast against the rows' bytes
    /// (`vpmaddubsw` then `vpmaddwd` against ones: the exact sum of the 4 products per row;
    /// Q4 nibbles are unsigned, Q8 weights `q + 128` are turned back into `q` and multiplied
    /// as `|q| * sign(x, q)`, which keeps every pair sum within an i16), then per block one
    /// conversion and one fma per row, as the other paths.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; as [`tile_rows`] otherwise.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_rows_avx2<const Q4: bool, const R: usize>(
        w: &QMatrix,
        t: usize,
        x: &QRows,
        r0: usize,
        out: &mut [[f32; TR]; ROWS_PER_PASS],
    ) {
        let kb = w.cols / QK;
        let tbb = w.kind.tile_block_bytes();
        let mins = !w.m.is_empty();
        let lo = _mm256_set1_epi8(0x0f);
        let flip = _mm256_set1_epi8(-128);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut macc = [[_mm256_setzero_ps(); 2]; R];
        let qp = w.q.as_ptr();
        let xq = x.q.as_ptr();
        for b in 0..kb {
            let tb = t * kb + b;
            let p = qp.add(tb * tbb);
            // Q4: the pair sums of all 8 groups add up in i16 (at most 16 * 15 * 127 = 30480),
            // so one vpmaddwd a block; Q8's pairs reach 32512, so one a group.
            let mut s = [[_mm256_setzero_si256(); 2]; R];
            for c in 0..8 {
                // Group c of the 16 rows: rows 0..8 and 8..16, 32 bytes each.
                let g = [0, 1].map(|h| {
                    if Q4 {
                        let v = _mm256_loadu_si256(p.add(64 * (c % 4) + 32 * h) as *const _);
                        let v = if c < 4 { v } else { _mm256_srli_epi16(v, 4) };
                        _mm256_and_si256(v, lo)
                    } else {
                        _mm256_xor_si256(
                            _mm256_loadu_si256(p.add(64 * c + 32 * h) as *const _),
                            flip,
                        )
                    }
                });
                let ga = if Q4 { g } else { g.map(|v| _mm256_abs_epi8(v)) };
                for (r, sr) in s.iter_mut().enumerate() {
                    let xb = (r0 + r) * kb + b;
                    let xv =
                        _mm256_set1_epi32((xq.add(xb * QK) as *const i32).add(c).read_unaligned());
                    for h in 0..2 {
                        if Q4 {
                            sr[h] = _mm256_add_epi16(sr[h], _mm256_maddubs_epi16(ga[h], xv));
                        } else {
                            let p16 = _mm256_maddubs_epi16(ga[h], _mm256_sign_epi8(xv, g[h]));
                            sr[h] = _mm256_add_epi32(sr[h], _mm256_madd_epi16(p16, ones));
                        }
                    }
                }
            }
            if Q4 {
                for sr in s.iter_mut() {
                    for v in sr.iter_mut() {
                        *v = _mm256_madd_epi16(*v, ones);
                    }
                }
            }
            for h in 0..2 {
                let dv = _mm256_cvtph_ps(_mm_loadu_si128(
                    w.d.as_ptr().add(tb * TR + 8 * h) as *const _
                ));
                let mv = if !Q4 {
                    _mm256_setzero_ps()
                } else if mins {
                    _mm256_cvtph_ps(_mm_loadu_si128(
                        w.m.as_ptr().add(tb * TR + 8 * h) as *const _
                    ))
                } else {
                    _mm256_mul_ps(dv, _mm256_set1_ps(-8.0)) // Q4_0: exact
                };
                for r in 0..R {
                    let xb = (r0 + r) * kb + b;
                    let sc = _mm256_mul_ps(dv, _mm256_set1_ps(*x.d.get_unchecked(xb)));
                    acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s[r][h]), sc, acc[r][h]);
                    if Q4 {
                        macc[r][h] =
                            _mm256_fmadd_ps(mv, _mm256_set1_ps(*x.s.get_unchecked(xb)), macc[r][h]);
                    }
                }
            }
        }
        for r in 0..R {
            for h in 0..2 {
                let v = if Q4 {
                    _mm256_add_ps(acc[r][h], macc[r][h])
                } else {
                    acc[r][h]
                };
                _mm256_storeu_ps(out[r].as_mut_ptr().add(8 * h), v);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q8_weight(rows: usize, cols: usize) -> QTensor {
        let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&w, GgmlDType::Q8_0).unwrap()
    }

    /// Against candle's own Q8_0 product on the widths this kernel is used for (not a
    /// multiple of 256: there candle quantizes activations to Q8_0 the same way; for
    /// multiples of 256 its tiled kernel uses Q8_K activations): equal up to f32 summation
    /// order; the scalar and SIMD paths give the same bits; a row of x gives the same bits
    /// alone and among 16 rows.
    #[test]
    fn q8_product_matches_candle_and_is_row_invariant() {
        for (rows, cols) in [(49, 576), (64, 1504), (7, 32), (33, 640)] {
            assert!(QMatrix::preferred_for(cols));
            let q = q8_weight(rows, cols);
            let ours = QMatrix::from_qtensor(&q).unwrap().expect("Q8_0 on CPU");
            let x = Tensor::randn(0f32, 1.0, (16, cols), &Device::Cpu).unwrap();
            assert_matches_candle(&ours, q, &x, &[0, 5, 15], &format!("{rows}x{cols}"));
        }
    }

    /// `ours` against candle's product with the same quantized weights `q` on `x [16, cols]`:
    /// within 1e-5 of the output scale where ours quantizes the activations by candle's
    /// (ggml's portable) rule, 2e-3 under the x86 rule (now and then a quant differs by one,
    /// moving its outputs by `|w| d`; a wrong layout or scale is off by the scale itself); the
    /// rows `alone` give the same bits multiplied alone as among the 16; the scalar and SIMD
    /// paths give the same bits. Returns the 16 rows.
    fn assert_matches_candle(
        ours: &QMatrix,
        q: QTensor,
        x: &Tensor,
        alone: &[usize],
        label: &str,
    ) -> Vec<Vec<f32>> {
        let got = ours.forward(x).unwrap();
        let candle = candle_core::quantized::QMatMul::from_qtensor(q).unwrap();
        let want = candle_core::Module::forward(&candle, x).unwrap();
        let max_abs = |t: &Tensor| {
            t.abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        };
        let diff = max_abs(&(&got - &want).unwrap());
        let scale = max_abs(&want);
        let tol = match ours.rule() {
            Rule::Portable => 1e-5,
            Rule::X86 => 2e-3,
        };
        assert!(
            diff <= tol * scale.max(1.0),
            "{label}: {diff} vs scale {scale}"
        );
        let all = got.to_vec2::<f32>().unwrap();
        for &r in alone {
            let one = ours
                .forward(&x.narrow(0, r, 1).unwrap())
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            assert!(one[0] == all[r], "{label}: row {r} alone differs");
        }
        assert_scalar_equals_simd(ours, x);
        all
    }

    /// The scalar and SIMD paths give the same bits for every tile and every number of
    /// activation rows a pass takes.
    fn assert_scalar_equals_simd(w: &QMatrix, x: &Tensor) {
        let cols = w.cols;
        let xv = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let m = xv.len() / cols;
        // both rules on every path, whichever this matrix takes
        for rule in [Rule::Portable, Rule::X86] {
            let xr = quantize_rows(&xv, cols, rule);
            // buffers filled with `v`: a path that skips a value leaves it showing
            let filled = |v: i8| QRows {
                q: vec![v; xv.len()],
                d: vec![v as f32; xr.d.len()],
                s: vec![v as f32; xr.d.len()],
                sum: vec![v as i32; xr.d.len()],
                h0: vec![],
            };
            let mut xs = filled(0);
            match rule {
                Rule::Portable => quantize_blocks_scalar::<false>(&xv, xs.blocks()),
                Rule::X86 => quantize_blocks_scalar::<true>(&xv, xs.blocks()),
            }
            assert!(xs.q == xr.q && xs.d == xr.d && xs.s == xr.s && xs.sum == xr.sum);
            for simd in simd_levels() {
                let mut xl = filled(1);
                quantize_blocks_with(simd, rule, &xv, xl.blocks());
                let same = xl.q == xs.q && xl.d == xs.d && xl.s == xs.s && xl.sum == xs.sum;
                assert!(
                    same,
                    "{simd:?} {rule:?} activation quantization differs from the scalar one"
                );
            }
        }
        let mut xr = quantize_rows(&xv, cols, w.rule());
        w.prepare(&mut xr);
        for simd in simd_levels() {
            for t in 0..w.rows.div_ceil(TR) {
                for nx in 1..=rows_per_pass(simd).min(m) {
                    let (mut a, mut b) = ([[0f32; TR]; ROWS_PER_PASS], [[1f32; TR]; ROWS_PER_PASS]);
                    tile_rows_scalar(w, t, &xr, m - nx, nx, &mut a);
                    tile_rows(simd, w, t, &xr, m - nx, nx, &mut b);
                    assert_eq!(
                        a[..nx],
                        b[..nx],
                        "{simd:?} {}x{cols} tile {t}, {nx} rows",
                        w.rows
                    );
                }
            }
        }
    }

    /// Which paths the scalar == SIMD checks below covered on this CPU (the test log says).
    #[test]
    fn simd_paths_of_this_cpu() {
        let levels = simd_levels();
        eprintln!(
            "int8 product paths here: {levels:?}; used: {:?}",
            simd_level()
        );
        assert_eq!(levels[0], Simd::Scalar);
    }

    /// Weights and activations at the ends of their ranges (Q8 weight -128 and 127, activation
    /// -127 and 127, every Q4 nibble): the SIMD paths' i16 pair sums must not saturate.
    #[test]
    fn extreme_quants_give_the_scalar_bits() {
        let cols = 64;
        for kind in [
            Kind::Q8,
            Kind::Q4 { s16: true },
            Kind::Q4 { s16: false },
            Kind::Q6,
        ] {
            let rows = 19;
            let w = QMatrix::build(rows, cols, kind, |row, b| {
                let mut q = [0u8; QK];
                for (i, v) in q.iter_mut().enumerate() {
                    *v = match kind {
                        // stored as q + 128: 0 is q = -128, 255 is q = 127
                        Kind::Q8 => [0u8, 255, 1, 254][(row + i + b) % 4],
                        Kind::Q4 { .. } => ((row * 7 + i + b) % 16) as u8,
                        // 6-bit: 0 is q - 32 = -32, 63 is 31
                        Kind::Q6 => [0u8, 63, 1, 62][(row + i + b) % 4],
                    };
                }
                Block {
                    q,
                    d: f16::from_f32(0.5 + row as f32 * 0.01),
                    m: f16::from_f32(-0.25),
                    sc: if kind == Kind::Q6 {
                        [
                            [-128, 127][(row + b) % 2],
                            [127, -128, 1][(row + 2 * b) % 3],
                        ]
                    } else {
                        [0; 2]
                    },
                }
            });
            let x: Vec<f32> = (0..4 * cols)
                .map(|i| [1.0f32, -1.0, 0.999, -0.5][i % 4] * if i % 7 == 0 { 127.0 } else { 3.0 })
                .collect();
            let x = Tensor::from_vec(x, (4, cols), &Device::Cpu).unwrap();
            assert_scalar_equals_simd(&w, &x);
        }
    }

    /// Against the f32 product of the dequantized weights: within the activations' 8-bit
    /// quantization error (a layout slip would be off by about the output's own size).
    fn assert_near_dequantized(ours: &QMatrix, q: &QTensor, x: &Tensor, label: &str) {
        let wf = q.dequantize(&Device::Cpu).unwrap();
        let want = x.matmul(&wf.t().unwrap()).unwrap();
        let got = ours.forward(x).unwrap();
        let rms_of = |t: &Tensor| {
            let ms = t.sqr().unwrap().mean_all().unwrap();
            ms.to_scalar::<f32>().unwrap().sqrt()
        };
        let (err, rms) = (rms_of(&(&got - &want).unwrap()), rms_of(&want));
        // 8-bit activations: ~0.5% of the rms, up to ~1.2% on the smallest shapes here
        assert!(err < 3e-2 * rms, "{label}: rms error {err} vs rms {rms}");
    }

    /// The portable rule rounds exact halves away from zero as `f32::round` does; the x86
    /// rule (llama.cpp's `_mm256_round_ps(.., _MM_ROUND_NEAREST)`) to even, and multiplies by
    /// `127 / amax`. Q4 matrices take the x86 rule, the others the portable one.
    #[test]
    fn activation_quantization_rules() {
        // amax 127: d = 1 and 127 / amax = 1, so every value below is quantized as it stands
        let mut x: Vec<f32> = vec![127.0, -0.5, 0.5, 2.5, -2.5, 126.5, -125.5, 0.49999997];
        x.extend((0..24).map(|i| i as f32 * 0.75 - 9.0));
        let got = quantize_rows(&x, QK, Rule::Portable);
        let want: Vec<i8> = x.iter().map(|v| v.round() as i8).collect();
        assert_eq!(got.q, want);
        assert_eq!(&got.q[..8], &[127, -1, 1, 3, -3, 127, -126, 0]);
        assert_eq!(got.sum[0], want.iter().map(|&v| v as i32).sum::<i32>());
        let got = quantize_rows(&x, QK, Rule::X86);
        let want: Vec<i8> = x.iter().map(|v| v.round_ties_even() as i8).collect();
        assert_eq!(got.q, want);
        assert_eq!(&got.q[..8], &[127, 0, 0, 2, -2, 126, -126, 0]);
        // at amax 11, 1 / (11 / 127) is one ulp below 127 / 11: 5.5 quantizes to 63 by the
        // portable rule (63.499996) and to 64 by the x86 one (63.500004)
        let mut x = vec![0f32; QK];
        (x[0], x[1]) = (11.0, 5.5);
        assert_eq!(&quantize_rows(&x, QK, Rule::Portable).q[..2], &[127, 63]);
        assert_eq!(&quantize_rows(&x, QK, Rule::X86).q[..2], &[127, 64]);
        // Q8_1's `s`: from `d` before its f16 rounding under the x86 rule
        let r = quantize_rows(&x, QK, Rule::X86);
        assert_eq!(r.s[0], (11.0f32 / 127.0) * (127 + 64) as f32);
        let r = quantize_rows(&x, QK, Rule::Portable);
        assert_eq!(r.s[0], r.d[0] * (127 + 63) as f32);
    }

    /// The layout keeps every block: read back, stacked with another matrix (rows in order,
    /// bit for bit), and at widths that are multiples of 256 (the demo's 1536-wide down
    /// projections), where candle's Q8_0 kernel quantizes activations differently.
    #[test]
    fn tiles_round_trip_and_stack() {
        for dt in [
            GgmlDType::Q8_0,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q6K,
        ] {
            for (rows, cols) in [(40, 1536), (17, 256), (3, 64)] {
                if dt == GgmlDType::Q6K && cols % 256 != 0 {
                    continue;
                }
                let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dt).unwrap();
                let ours = QMatrix::from_qtensor(&q).unwrap().unwrap();
                let label = format!("{dt:?} {rows}x{cols}");
                // the layout holds exactly the stored weights
                let deq = q
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                for (r, row) in deq.iter().enumerate() {
                    for b in 0..cols / QK {
                        let blk = ours.block(r, b);
                        let (d, m) = (blk.d.to_f32(), blk.m.to_f32());
                        for (i, &want) in row[b * QK..(b + 1) * QK].iter().enumerate() {
                            let got = match ours.kind {
                                Kind::Q8 => (blk.q[i] as f32 - 128.0) * d,
                                Kind::Q4 { s16: true } => blk.q[i] as f32 * d + m,
                                Kind::Q4 { s16: false } => (blk.q[i] as f32 - 8.0) * d,
                                // ggml: d * scale * (q - 32), in that order
                                Kind::Q6 => d * blk.sc[i / 16] as f32 * (blk.q[i] as f32 - 32.0),
                            };
                            assert_eq!(got, want, "{label}: row {r} element {}", b * QK + i);
                        }
                    }
                }
                let x = Tensor::randn(0f32, 1.0, (6, cols), &Device::Cpu).unwrap();
                assert_near_dequantized(&ours, &q, &x, &label);
                assert_scalar_equals_simd(&ours, &x);
                let other = Tensor::randn(0f32, 1.0, (5, cols), &Device::Cpu).unwrap();
                let o = QMatrix::from_qtensor(&QTensor::quantize(&other, dt).unwrap())
                    .unwrap()
                    .unwrap();
                let st = QMatrix::stack(&[&ours, &o]).unwrap();
                assert_eq!(st.rows(), rows + 5);
                for r in 0..rows + 5 {
                    for b in 0..cols / QK {
                        let want = if r < rows {
                            ours.block(r, b)
                        } else {
                            o.block(r - rows, b)
                        };
                        assert_eq!(st.block(r, b), want, "{label}: row {r} block {b}");
                    }
                }
                let a = ours.forward(&x).unwrap().to_vec2::<f32>().unwrap();
                let both = st.forward(&x).unwrap().to_vec2::<f32>().unwrap();
                assert!(
                    both.iter().zip(&a).all(|(b, a)| b[..rows] == a[..]),
                    "{label}"
                );
            }
        }
    }

    /// Q4_0 and Q4_1 weights kept as stored: against candle's product with the same quantized
    /// weights (its Q4 kernels quantize activations to Q8 per block of 32 too, and for Q4_1
    /// round each block's `d * sum(q)` to f16 as we do: equal up to summation order), row
    /// invariance, scalar == SIMD, stacking, and ~1/3 fewer bytes than the Q8_0 requantization.
    #[test]
    fn q4_product_matches_candle_and_is_row_invariant() {
        for dt in [GgmlDType::Q4_0, GgmlDType::Q4_1] {
            for (rows, cols) in [(49, 576), (8, 1504), (5, 32)] {
                let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
                let q = QTensor::quantize(&w, dt).unwrap();
                let ours = QMatrix::from_qtensor(&q).unwrap().expect("Q4 on CPU");
                let q8 = QMatrix::from_qtensor(&QTensor::quantize(&w, GgmlDType::Q8_0).unwrap())
                    .unwrap()
                    .unwrap();
                assert!(
                    ours.bytes() * 3 < q8.bytes() * 2 + 1,
                    "{dt:?} {rows}x{cols}"
                );
                let x = Tensor::randn(0f32, 1.0, (16, cols), &Device::Cpu).unwrap();
                let all = assert_matches_candle(
                    &ours,
                    q,
                    &x,
                    &[0, 7, 15],
                    &format!("{dt:?} {rows}x{cols}"),
                );
                // Stacked with itself: the rows repeat, bit for bit; a Q8 part does not stack.
                let st = QMatrix::stack(&[&ours, &ours]).unwrap();
                let both = st.forward(&x).unwrap().to_vec2::<f32>().unwrap();
                assert!(both
                    .iter()
                    .zip(&all)
                    .all(|(b, a)| b[..rows] == a[..] && b[rows..] == a[..]));
                assert!(QMatrix::stack(&[&ours, &q8]).is_none());
            }
        }
    }

    /// Q6_K kept as stored: every 6-bit value and 16-weight scale read back exactly (above);
    /// here the product against the dequantized f32 product, 1-16 rows bit for bit alone vs
    /// together, scalar == SIMD at every row count a pass takes, its bytes, and the policy
    /// (kept at widths of whole super-blocks only).
    #[test]
    fn q6k_kept_as_stored_is_row_invariant() {
        for (rows, cols) in [(49, 256), (20, 2048), (3, 768)] {
            let w = Tensor::randn(0f32, 1.0, (rows, cols), &Device::Cpu).unwrap();
            let q = QTensor::quantize(&w, GgmlDType::Q6K).unwrap();
            let ours = QMatrix::from_qtensor(&q).unwrap().expect("Q6_K on the CPU");
            assert_eq!(ours.kind, Kind::Q6);
            let label = format!("Q6K {rows}x{cols}");
            let x = Tensor::randn(0f32, 1.0, (16, cols), &Device::Cpu).unwrap();
            assert_near_dequantized(&ours, &q, &x, &label);
            assert_scalar_equals_simd(&ours, &x);
            let all = ours.forward(&x).unwrap().to_vec2::<f32>().unwrap();
            for r in [0, 5, 15] {
                let one = ours
                    .forward(&x.narrow(0, r, 1).unwrap())
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                assert!(one[0] == all[r], "{label}: row {r} alone differs");
            }
            let tiles = rows.div_ceil(TR);
            assert_eq!(
                ours.bytes(),
                tiles * TR * (cols / QK) * kept_block_bytes(GgmlDType::Q6K)
            );
        }
        if simd_level() != Simd::Scalar && enabled() && crate::switches::get().q4 {
            assert!(keeps_as_stored(GgmlDType::Q6K, 2048));
        }
        assert!(!keeps_as_stored(GgmlDType::Q6K, 640));
    }
}
