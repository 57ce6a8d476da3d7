//! Attention on the CPU in f32, one query row at a time: for each (query head, row) the scores
//! over the keys the row sees, their softmax and the weighted sum of the values, in an order
//! fixed by the row's position alone.
//!
//! Why its own kernel: a row's result must not depend on how many rows run with it. candle's
//! matmuls choose their blocking (and so their summation order) by shape, so a prompt chunk's
//! `[rep * n, d] x [d, L]` product rounds differently from a one-row decode step, and after the
//! activation quantization of GGUF weights those last bits grow into logit differences that
//! flip greedy choices. Here a prefill chunk, a verify block, a decode step, a batch of
//! sequences and a request resumed from the prefix cache compute every row with the same
//! instructions, so they agree bit for bit (tested in `tests/lossless.rs`, `tests/prefix.rs`).
//!
//! Cost: the same flops as the product form (`2 L d` per row and head for the scores, as many
//! for the values), no `[n, L]` mask or score matrix in memory; rows and heads are spread over
//! candle's CPU pool. The inner loops are AVX2 + FMA where the CPU has them (chosen once per
//! process, so every call on a machine takes the same path).

use super::attention::{Props, Visibility};
use crate::Result;
use candle_core::{DType, Device, Storage, Tensor};

/// Chunks of at least this many rows are attended in tiles of [`TILE_ROWS`] rows x all heads
/// of a KV group (see [`attend`]).
const TILE_MIN_ROWS: usize = 16;
const TILE_ROWS: usize = 8;
/// Bytes of keys (or values) a tile walks at a time: well inside L1 with its queries.
const BLOCK_BYTES: usize = 16 * 1024;

/// The keys `lo .. hi` the query at position `pos` sees among `l` keys at positions `0 .. l`.
fn visible(vis: Visibility, pos: usize, l: usize) -> (usize, usize) {
    let mut hi = if vis.causal { (pos + 1).min(l) } else { l };
    let mut lo = 0;
    if let Some(w) = vis.window {
        lo = (pos + 1).saturating_sub(w);
        if !vis.causal {
            hi = hi.min(pos + w);
        }
    }
    (lo, hi.max(lo))
}

/// Strided f32 view of a rank-3 tensor whose last dimension is contiguous.
struct View<'a> {
    data: &'a [f32],
    s0: usize,
    s1: usize,
}

fn slice(s: &Storage) -> Result<&[f32]> {
    match s {
        Storage::Cpu(c) => Ok(c.as_slice::<f32>()?),
        _ => Err(crate::Error::input("cpu attention: a tensor left the CPU")),
    }
}

fn view<'a>(s: &'a Storage, lay: &candle_core::Layout) -> Result<View<'a>> {
    Ok(View {
        data: &slice(s)?[lay.start_offset()..],
        s0: lay.stride()[0],
        s1: lay.stride()[1],
    })
}

impl View<'_> {
    fn row(&self, a: usize, b: usize, len: usize) -> &[f32] {
        let o = a * self.s0 + b * self.s1;
        &self.data[o..o + len]
    }
}

/// [`super::attend`] on the CPU: `q [heads, n, d]`, `k [kv_heads, L, d]`, `v [kv_heads, L, dv]`
/// (views allowed), row i at position `q_start + i`; `[n, heads * dv]`. None where it does not
/// apply (not f32 on the CPU, or tracked for a backward pass).
pub fn attend(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_start: usize,
    p: &Props,
) -> Result<Option<Tensor>> {
    let cpu_f32 = |t: &Tensor| t.device().is_cpu() && t.dtype() == DType::F32;
    if !(cpu_f32(q) && cpu_f32(k) && cpu_f32(v)) || q.track_op() || k.track_op() || v.track_op() {
        return Ok(None);
    }
    let (heads, n, d) = q.dims3()?;
    let (kvh, l, dk) = k.dims3()?;
    let (kvh2, l2, dv) = v.dims3()?;
    if dk != d || kvh2 != kvh || l2 != l || kvh == 0 || heads % kvh != 0 {
        return Err(crate::Error::input(format!(
            "attention: queries {:?}, keys {:?}, values {:?} do not fit together",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let rep = heads / kvh;
    let q = q.contiguous()?;
    let last_contiguous = |t: &Tensor| -> Result<Tensor> {
        Ok(if t.layout().stride()[2] == 1 {
            t.clone()
        } else {
            t.contiguous()?
        })
    };
    let (k, v) = (last_contiguous(k)?, last_contiguous(v)?);
    let sinks: Option<Vec<f32>> = p
        .sinks
        .map(|s| s.to_dtype(DType::F32)?.to_vec1::<f32>())
        .transpose()?;
    if let Some(s) = &sinks {
        if s.len() != heads {
            return Err(crate::Error::input(format!(
                "attention: {} sinks for {heads} heads",
                s.len()
            )));
        }
    }
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (qd, kv_k, kv_v) = (
        &slice(&qs)?[ql.start_offset()..],
        view(&ks, kl)?,
        view(&vs, vl)?,
    );
    let scale = p.scale as f32;
    let vis = p.vis;
    let simd = simd::available();
    let mut out = vec![0f32; n * heads * dv];
    let out_ptr = out.as_mut_ptr() as usize;
    // Work items are tiles of (KV group, heads of the group, rows). A long chunk (a prefill)
    // takes all `rep` heads of a group over TILE_ROWS rows, and walks the keys and values in
    // blocks small enough for L1, so each key or value row loaded serves every query of the
    // tile (one query per item streamed every key from L2/L3, once per head and row). Short
    // chunks (decode steps, verify blocks) take one (head, row) per item, so the pool's
    // threads share even one row's heads. A query's arithmetic is the same either way: each
    // score is its own dot product, the softmax and the weighted sum run in key order.
    let (tile_rows, tile_heads) = if n >= TILE_MIN_ROWS {
        (TILE_ROWS, rep)
    } else {
        (1, 1)
    };
    let row_tiles = n.div_ceil(tile_rows);
    let head_tiles = rep / tile_heads;
    let block = (BLOCK_BYTES / (4 * d.max(dv))).max(8) / 8 * 8;
    candle_core::utils::barrier_pool().execute_chunked(kvh * head_tiles * row_tiles, |range| {
        let out = out_ptr as *mut f32;
        let mut qrows: Vec<f32> = Vec::new();
        let mut spans: Vec<(usize, usize, usize, usize, usize)> = Vec::new();
        let mut scores: Vec<f32> = Vec::new();
        let mut acc: Vec<f32> = Vec::new();
        for item in range {
            let g = item / (head_tiles * row_tiles);
            let ht = item / row_tiles % head_tiles;
            // the last rows (the most keys under a causal mask) first, so the pool's last
            // grabs are the cheap tiles
            let rt = row_tiles - 1 - item % row_tiles;
            let (r0, r1) = (rt * tile_rows, ((rt + 1) * tile_rows).min(n));
            let h0 = g * rep + ht * tile_heads;
            // the tile's queries: (head, row, first key, end of keys, offset in `scores`)
            spans.clear();
            qrows.clear();
            let mut at = 0;
            for h in h0..h0 + tile_heads {
                for i in r0..r1 {
                    let (lo, hi) = visible(vis, q_start + i, l);
                    spans.push((h, i, lo, hi, at));
                    at += hi - lo;
                    qrows.extend(
                        qd[(h * n + i) * d..(h * n + i + 1) * d]
                            .iter()
                            .map(|b| b * scale),
                    );
                }
            }
            scores.clear();
            scores.resize(at, 0.0);
            let jmin = spans.iter().map(|s| s.2).min().unwrap_or(0);
            let jmax = spans.iter().map(|s| s.3).max().unwrap_or(0);
            // scores, key block by key block (eight keys at a time: each key's dot in the one
            // fixed order of `simd::dot`, whatever its group)
            let mut jb = jmin;
            while jb < jmax {
                let je = (jb + block).min(jmax);
                for (qi, &(_, _, lo, hi, off)) in spans.iter().enumerate() {
                    let (a, b) = (jb.max(lo), je.min(hi));
                    let qrow = &qrows[qi * d..(qi + 1) * d];
                    let mut j = a;
                    while j + 8 <= b {
                        let keys: [&[f32]; 8] = std::array::from_fn(|t| kv_k.row(g, j + t, d));
                        scores[off + j - lo..off + j - lo + 8]
                            .copy_from_slice(&simd::dot8(simd, qrow, &keys));
                        j += 8;
                    }
                    for j in j..b {
                        scores[off + j - lo] = simd::dot(simd, qrow, kv_k.row(g, j, d));
                    }
                }
                jb = je;
            }
            // each query's softmax (unnormalized weights, the sum kept for the end)
            let mut inv = Vec::with_capacity(spans.len());
            for &(h, _, lo, hi, off) in &spans {
                let sc = &mut scores[off..off + hi - lo];
                let sum = simd::softmax_terms(simd, sc, sinks.as_ref().map(|s| s[h]));
                inv.push(if sum > 0.0 { 1.0 / sum } else { 0.0 });
            }
            // the weighted sums of the values, value block by value block (each query's sum
            // in key order)
            acc.clear();
            acc.resize(spans.len() * dv, 0.0);
            let mut jb = jmin;
            while jb < jmax {
                let je = (jb + block).min(jmax);
                for (qi, &(_, _, lo, hi, off)) in spans.iter().enumerate() {
                    let (a, b) = (jb.max(lo), je.min(hi));
                    if a < b {
                        simd::weighted_sum_onto(
                            simd,
                            &scores[off + a - lo..off + b - lo],
                            |t| kv_v.row(g, a + t, dv),
                            &mut acc[qi * dv..(qi + 1) * dv],
                        );
                    }
                }
                jb = je;
            }
            for (qi, &(h, i, ..)) in spans.iter().enumerate() {
                let base = i * heads * dv + h * dv;
                for (c, a) in acc[qi * dv..(qi + 1) * dv].iter().enumerate() {
                    // SAFETY: each (row, head) belongs to one tile, which writes its dv
                    // outputs once.
                    unsafe { *out.add(base + c) = a * inv[qi] };
                }
            }
        }
    });
    drop((qs, ks, vs));
    Ok(Some(Tensor::from_vec(out, (n, heads * dv), &Device::Cpu)?))
}

mod simd {
    /// Whether the AVX2 + FMA loops run (decided once per process).
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
            *HAS.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// `sum_i a_i b_i` over eight lanes, the lanes summed in a fixed order.
    pub fn dot(simd: bool, a: &[f32], b: &[f32]) -> f32 {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is only true when the CPU has AVX2 and FMA.
            return unsafe { dot_avx2(a, b) };
        }
        let _ = simd;
        let mut lanes = [0f32; 8];
        let n8 = a.len() / 8 * 8;
        for c in (0..n8).step_by(8) {
            for t in 0..8 {
                lanes[t] = a[c + t].mul_add(b[c + t], lanes[t]);
            }
        }
        let mut s = reduce8(&lanes);
        for t in n8..a.len() {
            s = a[t].mul_add(b[t], s);
        }
        s
    }

    /// `acc += w * x`.
    pub fn axpy(simd: bool, w: f32, x: &[f32], acc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: as in `dot`.
            return unsafe { axpy_avx2(w, x, acc) };
        }
        let _ = simd;
        for (a, b) in acc.iter_mut().zip(x) {
            *a = w.mul_add(*b, *a);
        }
    }

    /// A softmax's unnormalized terms in place, `s_j <- exp(s_j - m)` with `m` the largest
    /// score (and the sink logit, if any), and their sum (the sink's term included). exp is
    /// `cpu_ops::glu`'s (the same bits on every path); the sum runs in 8 lanes over the keys in
    /// order (lane t takes keys t, t + 8, ...), the lanes summed as `reduce8`, then the keys
    /// past the last whole 8 in order, then the sink's term: one fixed order for a row's keys,
    /// whatever call the row runs in.
    pub fn softmax_terms(simd: bool, sc: &mut [f32], sink: Option<f32>) -> f32 {
        use crate::nn::cpu_ops::glu::exp_one;
        let m = sc
            .iter()
            .fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &s| m.max(s));
        let n8 = sc.len() / 8 * 8;
        let mut total;
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: `simd` is only true when the CPU has AVX2 and FMA.
            total = unsafe { exp_sum_avx2(&mut sc[..n8], m) };
        } else {
            total = exp_sum_lanes(&mut sc[..n8], m);
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let _ = simd;
            total = exp_sum_lanes(&mut sc[..n8], m);
        }
        for s in &mut sc[n8..] {
            *s = exp_one(*s - m);
            total += *s;
        }
        if let Some(k) = sink {
            total += exp_one(k - m);
        }
        total
    }

    /// [`softmax_terms`]' whole-8 part, portable.
    fn exp_sum_lanes(sc: &mut [f32], m: f32) -> f32 {
        let mut lanes = [0f32; 8];
        for c in sc.chunks_exact_mut(8) {
            for t in 0..8 {
                c[t] = crate::nn::cpu_ops::glu::exp_one(c[t] - m);
                lanes[t] += c[t];
            }
        }
        reduce8(&lanes)
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp_sum_avx2(sc: &mut [f32], m: f32) -> f32 {
        use std::arch::x86_64::*;
        let mv = _mm256_set1_ps(m);
        let mut acc = _mm256_setzero_ps();
        for c in sc.chunks_exact_mut(8) {
            let e =
                crate::nn::cpu_ops::glu::x86::exp8(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), mv));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        reduce8(&lanes)
    }

    fn reduce8(l: &[f32; 8]) -> f32 {
        ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
    }

    /// [`dot`] of `a` with eight rows at once (the same bits as eight calls).
    pub fn dot8(simd: bool, a: &[f32], rows: &[&[f32]; 8]) -> [f32; 8] {
        #[cfg(target_arch = "x86_64")]
        if simd && a.len().is_multiple_of(8) && rows.iter().all(|r| r.len() == a.len()) {
            // SAFETY: as in `dot`; every row is a.len() long.
            return unsafe { dot8_avx2(a, rows) };
        }
        std::array::from_fn(|t| dot(simd, a, rows[t]))
    }

    /// `out = sum_j w[j] * row(j)` over j in order, one fma per element and key (the same bits
    /// as `axpy` per key into a zeroed `out`), the sums kept in registers 64 columns at a time.
    #[cfg(test)]
    pub fn weighted_sum<'r>(
        simd: bool,
        w: &[f32],
        row: impl Fn(usize) -> &'r [f32],
        out: &mut [f32],
    ) {
        out.fill(0.0);
        weighted_sum_onto(simd, w, row, out);
    }

    /// `out += sum_j w[j] * row(j)`, continuing each element's fma chain in j order: a sum
    /// split over consecutive key ranges gives the bits of one call over all of them.
    pub fn weighted_sum_onto<'r>(
        simd: bool,
        w: &[f32],
        row: impl Fn(usize) -> &'r [f32],
        out: &mut [f32],
    ) {
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: as in `dot`.
            return unsafe { weighted_sum_avx2(w, row, out) };
        }
        for (j, &wj) in w.iter().enumerate() {
            axpy(simd, wj, row(j), out);
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot8_avx2(a: &[f32], rows: &[&[f32]; 8]) -> [f32; 8] {
        use std::arch::x86_64::*;
        let mut acc = [_mm256_setzero_ps(); 8];
        let mut c = 0;
        while c < a.len() {
            let x = _mm256_loadu_ps(a.as_ptr().add(c));
            for t in 0..8 {
                acc[t] = _mm256_fmadd_ps(x, _mm256_loadu_ps(rows[t].as_ptr().add(c)), acc[t]);
            }
            c += 8;
        }
        // reduce8's order for all eight: b = (l0+l4, l1+l5, l2+l6, l3+l7) per key (keys k and
        // k+4 share a register), reordered to (b0, b2, b1, b3), then two rounds of pairwise
        // adds: (b0+b2) and (b1+b3), then their sum. Lanes end as keys 0..8.
        let half = |k: usize| {
            let lo = _mm256_permute2f128_ps::<0x20>(acc[k], acc[k + 4]);
            let hi = _mm256_permute2f128_ps::<0x31>(acc[k], acc[k + 4]);
            _mm256_permute_ps::<0b11_01_10_00>(_mm256_add_ps(lo, hi))
        };
        let (s0, s1, s2, s3) = (half(0), half(1), half(2), half(3));
        let r = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
        let mut out = [0f32; 8];
        _mm256_storeu_ps(out.as_mut_ptr(), r);
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn weighted_sum_avx2<'r>(w: &[f32], row: impl Fn(usize) -> &'r [f32], out: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = out.len();
        let mut c = 0;
        while c + 64 <= n {
            let mut acc: [__m256; 8] =
                std::array::from_fn(|u| _mm256_loadu_ps(out.as_ptr().add(c + 8 * u)));
            for (j, &wj) in w.iter().enumerate() {
                let wv = _mm256_set1_ps(wj);
                let p = row(j).as_ptr().add(c);
                for (u, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(wv, _mm256_loadu_ps(p.add(8 * u)), *a);
                }
            }
            for (u, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * u), *a);
            }
            c += 64;
        }
        if c < n {
            let rest = &mut out[c..];
            for (j, &wj) in w.iter().enumerate() {
                axpy_avx2(wj, &row(j)[c..], rest);
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        use std::arch::x86_64::*;
        let n = a.len().min(b.len());
        let n8 = n / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let mut c = 0;
        while c < n8 {
            let x = _mm256_loadu_ps(a.as_ptr().add(c));
            let y = _mm256_loadu_ps(b.as_ptr().add(c));
            acc = _mm256_fmadd_ps(x, y, acc);
            c += 8;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), acc);
        let mut s = reduce8(&lanes);
        for t in n8..n {
            s = a[t].mul_add(b[t], s);
        }
        s
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn axpy_avx2(w: f32, x: &[f32], acc: &mut [f32]) {
        use std::arch::x86_64::*;
        let n = x.len().min(acc.len());
        let n8 = n / 8 * 8;
        let wv = _mm256_set1_ps(w);
        let mut c = 0;
        while c < n8 {
            let p = acc.as_mut_ptr().add(c);
            let y = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x.as_ptr().add(c)), _mm256_loadu_ps(p));
            _mm256_storeu_ps(p, y);
            c += 8;
        }
        for t in n8..n {
            acc[t] = w.mul_add(x[t], acc[t]);
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn softmax_terms_are_the_same_on_both_paths_and_sum_to_one() {
            for len in [1, 7, 8, 9, 64, 77, 300] {
                let sc: Vec<f32> = (0..len)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 9.0)
                    .collect();
                for sink in [None, Some(2.5f32), Some(40.0)] {
                    let (mut a, mut b) = (sc.clone(), sc.clone());
                    let sa = super::softmax_terms(super::available(), &mut a, sink);
                    let sb = super::softmax_terms(false, &mut b, sink);
                    assert_eq!(sa.to_bits(), sb.to_bits(), "len {len} sink {sink:?}");
                    assert!(a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()));
                    // against f64: the normalized weights
                    let m = sc
                        .iter()
                        .fold(sink.unwrap_or(f32::NEG_INFINITY), |m, &s| m.max(s))
                        as f64;
                    let z: f64 = sc.iter().map(|&s| (s as f64 - m).exp()).sum::<f64>()
                        + sink.map_or(0.0, |k| (k as f64 - m).exp());
                    for (j, &s) in sc.iter().enumerate() {
                        let want = (s as f64 - m).exp() / z;
                        let got = (a[j] / sa) as f64;
                        assert!(
                            (got - want).abs() <= 1e-6 * want.max(1e-30) + 1e-12,
                            "len {len} key {j}: {got} vs {want}"
                        );
                    }
                }
            }
        }

        #[test]
        fn the_avx2_loops_equal_the_portable_ones() {
            let a: Vec<f32> = (0..77)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let b: Vec<f32> = (0..77)
                .map(|i| ((i * 53 % 89) as f32 - 44.0) / 3.0)
                .collect();
            assert_eq!(
                super::dot(super::available(), &a, &b),
                super::dot(false, &a, &b)
            );
            let mut x = b.clone();
            let mut y = b.clone();
            super::axpy(super::available(), 0.37, &a, &mut x);
            super::axpy(false, 0.37, &a, &mut y);
            assert_eq!(x, y);
            let rows: Vec<Vec<f32>> = (0..8)
                .map(|t| a.iter().map(|v| v * (t as f32 - 3.5)).collect())
                .collect();
            for len in [64, 77] {
                let r: [&[f32]; 8] = std::array::from_fn(|t| &rows[t][..len]);
                let want: Vec<f32> = r.iter().map(|r| super::dot(false, &a[..len], r)).collect();
                assert_eq!(
                    super::dot8(super::available(), &a[..len], &r).to_vec(),
                    want
                );
                assert_eq!(super::dot8(false, &a[..len], &r).to_vec(), want);
                let w = [0.3f32, -1.25, 2.0, 0.0, 7.5, -0.01, 1.0, 3.0];
                let mut want = vec![0f32; len];
                for (j, &wj) in w.iter().enumerate() {
                    super::axpy(false, wj, r[j], &mut want);
                }
                for simd in [super::available(), false] {
                    let mut got = vec![9f32; len];
                    super::weighted_sum(simd, &w, |j| r[j], &mut got);
                    assert_eq!(got, want, "len {len} simd {simd}");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nn::attention::{sdpa_with_sinks, Visibility};

    /// The row kernel agrees with the product form (to rounding), causal, windowed, full and
    /// with sinks, over a strided cache view; and a row's bits do not depend on the rows
    /// computed with it.
    #[test]
    fn rows_match_the_product_form_and_do_not_depend_on_their_company() {
        let dev = Device::Cpu;
        let (heads, kvh, d, cap, l) = (6, 2, 40, 50, 37);
        let q = Tensor::randn(0f32, 1.0, (heads, l, d), &dev).unwrap();
        let kc = Tensor::randn(0f32, 1.0, (kvh, cap, d), &dev).unwrap();
        let vc = Tensor::randn(0f32, 1.0, (kvh, cap, d + 8), &dev).unwrap();
        let (k, v) = (kc.narrow(1, 0, l).unwrap(), vc.narrow(1, 0, l).unwrap());
        let sinks = Tensor::randn(0f32, 1.0, heads, &dev).unwrap();
        for vis in [
            Visibility::CAUSAL,
            Visibility::sliding(5),
            Visibility::FULL,
            Visibility {
                causal: false,
                window: Some(4),
            },
        ] {
            for s in [None, Some(&sinks)] {
                let p = Props {
                    scale: 0.3,
                    vis,
                    sinks: s,
                };
                let all = attend(&q, &k, &v, 0, &p).unwrap().unwrap();
                let mask =
                    crate::nn::attention_mask(l, 0, l, vis.causal, vis.window, DType::F32, &dev)
                        .unwrap();
                let want = sdpa_with_sinks(&q, &k, &v, mask.as_ref(), 0.3, s).unwrap();
                let diff = (&all - &want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap();
                assert!(diff < 1e-5, "{vis:?} sinks={}: {diff}", s.is_some());
                // rows 10..13 alone, at their positions
                let part = attend(&q.narrow(1, 10, 3).unwrap(), &k, &v, 10, &p)
                    .unwrap()
                    .unwrap();
                let a = all.narrow(0, 10, 3).unwrap().to_vec2::<f32>().unwrap();
                assert_eq!(a, part.to_vec2::<f32>().unwrap(), "{vis:?}");
            }
        }
    }

    /// Long chunks take the tiled walk (several key blocks, rows in tiles of every head of a
    /// group): every row's bits equal the row attended alone (one query per item), and the
    /// product form to rounding.
    #[test]
    fn tiles_give_each_row_its_bits_alone() {
        let dev = Device::Cpu;
        let (heads, kvh, d, l) = (4, 1, 128, 300);
        let block = (BLOCK_BYTES / (4 * d)).max(8) / 8 * 8;
        assert!(l > 3 * block, "the test must cross key blocks");
        let q = Tensor::randn(0f32, 1.0, (heads, l, d), &dev).unwrap();
        let k = Tensor::randn(0f32, 1.0, (kvh, l, d), &dev).unwrap();
        let v = Tensor::randn(0f32, 1.0, (kvh, l, d), &dev).unwrap();
        for vis in [Visibility::CAUSAL, Visibility::sliding(70)] {
            let p = Props {
                scale: 0.09,
                vis,
                sinks: None,
            };
            // the last 290 rows as one chunk after 10 cached ones (a tile straddles the end)
            let all = attend(&q.narrow(1, 10, 290).unwrap(), &k, &v, 10, &p)
                .unwrap()
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            for i in [0usize, 7, 8, 100, 203, 289] {
                let one = attend(&q.narrow(1, 10 + i, 1).unwrap(), &k, &v, 10 + i, &p)
                    .unwrap()
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap();
                assert_eq!(all[i], one[0], "{vis:?} row {i}");
            }
            let mask = crate::nn::attention_mask(l, 0, l, vis.causal, vis.window, DType::F32, &dev)
                .unwrap();
            let want = sdpa_with_sinks(&q, &k, &v, mask.as_ref(), 0.09, None)
                .unwrap()
                .narrow(0, 10, 290)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap();
            let diff = all
                .iter()
                .flatten()
                .zip(want.iter().flatten())
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            assert!(diff < 1e-5, "{vis:?}: {diff}");
        }
    }

    #[test]
    fn visible_ranges() {
        assert_eq!(visible(Visibility::CAUSAL, 4, 10), (0, 5));
        assert_eq!(visible(Visibility::sliding(3), 4, 10), (2, 5));
        assert_eq!(visible(Visibility::FULL, 4, 10), (0, 10));
        let w = Visibility {
            causal: false,
            window: Some(3),
        };
        assert_eq!(visible(w, 4, 10), (2, 7));
        // every (q, k) agrees with Visibility::sees
        for vis in [
            Visibility::CAUSAL,
            Visibility::sliding(3),
            Visibility::FULL,
            w,
        ] {
            for q in 0..10 {
                let (lo, hi) = visible(vis, q, 10);
                for k in 0..10 {
                    assert_eq!(vis.sees(q, k), (lo..hi).contains(&k), "{vis:?} {q} {k}");
                }
            }
        }
    }
}
