//! The K/V cache write (per-head norm + RoPE) and attention over the cache (`kernels/fused.cu`),
//! with sinks and an output gate. `nn::attention` decides when they run.

use super::*;
use crate::nn::attention::Visibility;
pub use crate::nn::fused::{AttentionCall, HeadSource};

/// A tensor's bf16 view, if one was given.
fn opt_view<'a>(
    h: &'a Option<Held<'a>>,
    what: &str,
) -> candle_core::Result<Option<CudaView<'a, bf16>>> {
    h.as_ref().map(|h| h.view(what)).transpose()
}

/// Push an optional device pointer (null when absent).
fn push_opt<'a>(
    b: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    v: &'a Option<CudaView<'a, bf16>>,
    null: &'a u64,
) {
    match v {
        Some(v) => b.arg(v),
        None => b.arg(null),
    };
}

struct KvWrite {
    k: HeadSource,
    v: HeadSource,
    kv_heads: usize,
    head_dim: usize,
    pos0: usize,
}

impl InplaceOp3 for KvWrite {
    fn name(&self) -> &'static str {
        "dflash-kv-write"
    }
    fn cpu_fwd(
        &self,
        _: &mut CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<()> {
        candle_core::bail!(
            "dflash-kv-write is a CUDA kernel (the caller appends with candle on CPU)"
        )
    }
    fn cuda_fwd(
        &self,
        dst: &mut CudaStorage,
        dl: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
    ) -> candle_core::Result<()> {
        let (n, stride) = sl.shape().dims2()?;
        let (two, kvh, cap, d) = dl.shape().dims4()?;
        let (_, rot_cols) = cl.shape().dims2()?;
        let last = |h: &HeadSource| h.offset + (kvh - 1) * h.head_stride + d;
        let ok = d == self.head_dim
            && two == 2
            && kvh == self.kv_heads
            && cl.shape().dims2()?.0 == n
            && self.k.rot == rot_cols
            && last(&self.k) <= stride
            && last(&self.v) <= stride
            && self.pos0 + n <= cap;
        if !ok {
            candle_core::bail!(
                "dflash-kv-write: src {:?} tables {:?} cache {:?} at {}",
                sl.shape(),
                cl.shape(),
                dl.shape(),
                self.pos0
            );
        }
        let dev = dst.device().clone();
        let src = view(ss, sl, "projection")?;
        let tab = view(cs, cl, "rope tables")?;
        let held = self.k.norm.as_ref().map(Held::new);
        let kw = opt_view(&held, "head norm weight")?;
        let Some((o, e)) = dl.contiguous_offsets() else {
            candle_core::bail!("dflash-kv-write: cache must be contiguous");
        };
        let mut kv = dst.as_cuda_slice_mut::<bf16>()?.slice_mut(o..e);
        let func = dev.get_or_load_custom_func("kv_write_bf16", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, n as u32, 1),
            block_dim: (block_for(d), 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        let i = |x: usize| x as i32;
        let (stride_i, k_off, k_hs, v_off, v_hs, v_unit) = (
            i(stride),
            i(self.k.offset),
            i(self.k.head_stride),
            i(self.v.offset),
            i(self.v.head_stride),
            self.v.unit_norm as i32,
        );
        let (eps, rot, kvh_i, cap_i, pos_i, d_i) = (
            self.k.eps,
            i(self.k.rot),
            i(kvh),
            cap as i64,
            i(self.pos0),
            i(d),
        );
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&stride_i);
        b.arg(&k_off);
        b.arg(&k_hs);
        b.arg(&v_off);
        b.arg(&v_hs);
        b.arg(&v_unit);
        push_opt(&mut b, &kw, &null);
        b.arg(&eps);
        b.arg(&tab);
        b.arg(&rot);
        b.arg(&mut kv);
        b.arg(&kvh_i);
        b.arg(&cap_i);
        b.arg(&pos_i);
        b.arg(&d_i);
        // SAFETY: argument types match the kernel; shapes and bounds checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// Write rows `pos0 .. pos0 + n` of a joint KV cache `kv [2, kv_heads, cap, head_dim]` from a
/// projection output `src [n, ..]`: keys normed + roped from `k`, values from `v` (copied, or
/// unit-normed). `tables [n, rot]` holds the packed `cos | sin` of the rows' positions.
/// Returns false (nothing written) when the kernel does not apply.
pub fn kv_write(
    kv: &Tensor,
    src: &Tensor,
    tables: &Tensor,
    k: &HeadSource,
    v: &HeadSource,
    pos0: usize,
) -> candle_core::Result<bool> {
    let mut ts = vec![kv, src, tables];
    if let Some(w) = &k.norm {
        ts.push(w);
    }
    if !is_bf16_cuda(&ts) || kv.rank() != 4 || src.rank() != 2 || v.norm.is_some() {
        return Ok(false);
    }
    let (_, kv_heads, _, head_dim) = kv.dims4()?;
    if head_dim > 1024 || k.rot > head_dim || k.rot % 2 != 0 {
        return Ok(false);
    }
    let op = KvWrite {
        k: k.clone(),
        v: v.clone(),
        kv_heads,
        head_dim,
        pos0,
    };
    kv.inplace_op3(src, tables, &op)?;
    Ok(true)
}

/// Head dims the attention kernel is built for.
pub const ATTN_HEAD_DIMS: [usize; 4] = [64, 128, 256, 512];

/// Keys per attention block (see `Attend::cuda_fwd`). 64 is what the row-dependent rule it
/// replaced chose at the benchmark's shape (32 heads, context 128, 1 or 16 rows).
const ATTN_CHUNK: usize = 64;

/// One attention launch: the call, and for an MLA latent cache `[1, cap, width]` the width of
/// its value part (None: a joint `[2, kv_heads, cap, d]` cache).
struct Attend(AttentionCall, Option<usize>);

impl CustomOp3 for Attend {
    fn name(&self) -> &'static str {
        "dflash-attention"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        ss: &CudaStorage,
        sl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
        ks: &CudaStorage,
        kl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let c = &self.0;
        let (n, stride) = sl.shape().dims2()?;
        // (kv heads, positions, key width, value width, offset of the values, head stride, row stride)
        let (kvh, cap, dk, dv, v_off, head_stride, row_stride) = match self.1 {
            None => {
                let (two, kvh, cap, d) = kl.shape().dims4()?;
                if two != 2 {
                    candle_core::bail!("dflash-attention: cache {:?}", kl.shape());
                }
                (kvh, cap, d, d, kvh * cap * d, cap * d, d)
            }
            Some(dv) => {
                let (one, cap, w) = kl.shape().dims3()?;
                if one != 1 || dv > w {
                    candle_core::bail!("dflash-attention: latent cache {:?}", kl.shape());
                }
                (1, cap, w, dv, 0, 0, w)
            }
        };
        let d = dk;
        let (tab_rows, rot_cols) = cl.shape().dims2()?;
        let heads = c.heads;
        let q_last = c.q.offset + (heads - 1) * c.q.head_stride + d + c.gate_offset.unwrap_or(0);
        let ok = attn_kernel(dk, dv).is_some()
            && heads % kvh == 0
            && c.kv_len <= cap
            && c.kv_len > 0
            && tab_rows == n
            && (c.q.rot == 0 || c.q.rot == rot_cols)
            && q_last <= stride;
        if !ok {
            candle_core::bail!(
                "dflash-attention: src {:?} tables {:?} cache {:?} heads {heads} len {}",
                sl.shape(),
                cl.shape(),
                kl.shape(),
                c.kv_len
            );
        }
        let dev = ss.device();
        let src = view(ss, sl, "projection")?;
        let tab = view(cs, cl, "rope tables")?;
        let kv = view(ks, kl, "kv cache")?;
        let (kp, vp) = (kv.slice(0..), kv.slice(v_off..));
        let held_q = c.q.norm.as_ref().map(Held::new);
        let qw = opt_view(&held_q, "head norm weight")?;
        let held_s = c.sinks.as_ref().map(Held::new);
        let sinks = opt_view(&held_s, "sinks")?;
        // Keys split into fixed chunks of ATTN_CHUNK from position 0, one block each, merged by
        // the last of them to finish (or attn_combine). Fixed, so that a query row's arithmetic (which keys each block and
        // warp sums, in which order) depends on its position only, not on how many rows the
        // call has or how long the cache is: a verify reproduces the decode steps bit for bit
        // (with one split the kernel writes a / L itself, which is what the combine computes
        // from one non-empty split).
        let rows = heads * n;
        let chunk = ATTN_CHUNK;
        let splits = c.kv_len.div_ceil(chunk);
        // SAFETY: every element is written (by attn: one split or its merging blocks; else attn_combine).
        let out = unsafe { dev.alloc::<bf16>(n * heads * dv)? };
        let part = unsafe {
            dev.alloc::<f32>(if splits > 1 {
                rows * splits * (dv + 2)
            } else {
                1
            })?
        };
        let (name, pairs_per_block) =
            attn_pick(dev, dk, dv, n, kvh * splits, n * (heads / kvh)).expect("checked above");
        let func = dev.get_or_load_custom_func(name, "dflash_fused", FUSED_PTX)?;
        // One block per (KV head, key chunk, group of (row, head) pairs): kernels/fused.cu's ATTN.
        let groups = (n * (heads / kvh)).div_ceil(pairs_per_block);
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, splits as u32, groups as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let i = |x: usize| x as i32;
        let (stride_i, q_off, q_hs, eps, rot, scale) = (
            i(stride),
            i(c.q.offset),
            i(c.q.head_stride),
            c.q.eps,
            i(c.q.rot),
            c.scale,
        );
        let (kvh_i, hs_i, rs_i, len_i, rep_i, pos_i) = (
            i(kvh),
            head_stride as i64,
            i(row_stride),
            i(c.kv_len),
            i(heads / kvh),
            i(c.q_pos0),
        );
        let (causal, window, chunk_i, n_i) = (
            c.vis.causal as i32,
            c.vis.window.unwrap_or(0).min(i32::MAX as usize) as i32,
            i(chunk),
            i(n),
        );
        let gate_off = c.gate_offset.map_or(-1, i);
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&stride_i);
        b.arg(&q_off);
        b.arg(&q_hs);
        push_opt(&mut b, &qw, &null);
        b.arg(&eps);
        b.arg(&tab);
        b.arg(&rot);
        b.arg(&scale);
        b.arg(&kp);
        b.arg(&vp);
        b.arg(&hs_i);
        b.arg(&rs_i);
        b.arg(&kvh_i);
        b.arg(&len_i);
        b.arg(&rep_i);
        b.arg(&pos_i);
        b.arg(&causal);
        b.arg(&window);
        b.arg(&chunk_i);
        b.arg(&n_i);
        push_opt(&mut b, &sinks, &null);
        b.arg(&gate_off);
        b.arg(&out);
        b.arg(&part);
        let counters = if splits > 1 && pairs_per_block <= MERGE_MAX_PAIRS {
            split_counters(dev, kvh * groups)?
        } else {
            None
        };
        b.arg(counters.as_ref().unwrap_or(&null));
        // SAFETY: argument types match the kernel; shapes and bounds checked above.
        unsafe { b.launch(cfg) }.w()?;
        if splits > 1 && counters.is_none() {
            let g = Gate {
                src: &src,
                stride: stride_i,
                q_off,
                q_hs,
                gate_off,
            };
            combine_splits(dev, &part, &out, heads, n, splits, dv, &sinks, &g)?;
        }
        drop((kp, vp));
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, heads * dv)),
        ))
    }
}

/// Where `attn_combine_bf16` finds each row's output gate (as the attention kernel does).
struct Gate<'a> {
    src: &'a CudaView<'a, bf16>,
    stride: i32,
    q_off: i32,
    q_hs: i32,
    gate_off: i32,
}

/// Merge the key splits of an attention launch (`part`, `(m, l, acc[dv])` per (head, row,
/// split)) into the bf16 output rows, with the sinks and the output gate.
#[allow(clippy::too_many_arguments)]
fn combine_splits(
    dev: &candle_core::cuda_backend::CudaDevice,
    part: &candle_core::cuda_backend::cudarc::driver::CudaSlice<f32>,
    out: &candle_core::cuda_backend::cudarc::driver::CudaSlice<bf16>,
    heads: usize,
    n: usize,
    splits: usize,
    dv: usize,
    sinks: &Option<CudaView<'_, bf16>>,
    g: &Gate,
) -> candle_core::Result<()> {
    let func = dev.get_or_load_custom_func("attn_combine_bf16", "dflash_fused", FUSED_PTX)?;
    let cfg = LaunchConfig {
        grid_dim: (heads as u32, n as u32, 1),
        block_dim: (block_for(dv), 1, 1),
        shared_mem_bytes: 0,
    };
    let (splits_i, d_i) = (splits as i32, dv as i32);
    let null = 0u64;
    let mut b = func.builder();
    b.arg(part);
    b.arg(out);
    b.arg(&splits_i);
    b.arg(&d_i);
    push_opt(&mut b, sinks, &null);
    b.arg(g.src);
    b.arg(&g.stride);
    b.arg(&g.q_off);
    b.arg(&g.q_hs);
    b.arg(&g.gate_off);
    // SAFETY: argument types match the kernel.
    unsafe { b.launch(cfg) }.w()?;
    Ok(())
}

/// The attention kernel for key / value widths, and its (row, head) pairs per block.
fn attn_kernel(dk: usize, dv: usize) -> Option<(&'static str, usize)> {
    attn_variants(dk, dv).map(|v| v[0])
}

/// The kernels for these widths, most pairs per block first (kernels/fused.cu's ATTN).
fn attn_variants(dk: usize, dv: usize) -> Option<&'static [(&'static str, usize)]> {
    Some(match (dk, dv) {
        (64, 64) => &[
            ("attn_bf16_d64", 8),
            ("attn_bf16_d64_p2", 2),
            ("attn_bf16_d64_p1", 1),
        ],
        (128, 128) => &[
            ("attn_bf16_d128", 8),
            ("attn_bf16_d128_p2", 2),
            ("attn_bf16_d128_p1", 1),
        ],
        (256, 256) => &[("attn_bf16_d256", 4), ("attn_bf16_d256_p1", 1)],
        (512, 512) => &[("attn_bf16_d512", 2), ("attn_bf16_d512_p1", 1)],
        (576, 512) => &[("attn_bf16_k576_v512", 2), ("attn_bf16_k576_v512_p1", 1)],
        _ => return None,
    })
}

/// The tensor-core attention kernel (kernels/fused.cu's ATTN_MMA) for these widths and its
/// pairs per block: 64 (4 warps x one 16-row mma tile) over chunks of [`ATTN_CHUNK`] keys, the
/// kernel's own chunk.
fn attn_mma_kernel(dk: usize, dv: usize) -> Option<(&'static str, usize)> {
    const _: () = assert!(ATTN_CHUNK == 64, "kernels/fused.cu's MMA_KEYS");
    match (dk, dv) {
        (64, 64) => Some(("attn_mma_d64", 64)),
        (128, 128) => Some(("attn_mma_d128", 64)),
        _ => None,
    }
}

/// The batched (`_seg`) form of an attention kernel of [`attn_variants`] (a static name: no
/// string is built per launch).
fn seg_name(name: &str) -> &'static str {
    match name {
        "attn_bf16_d64" => "attn_bf16_d64_seg",
        "attn_bf16_d64_p2" => "attn_bf16_d64_p2_seg",
        "attn_bf16_d64_p1" => "attn_bf16_d64_p1_seg",
        "attn_bf16_d128" => "attn_bf16_d128_seg",
        "attn_bf16_d128_p2" => "attn_bf16_d128_p2_seg",
        "attn_bf16_d128_p1" => "attn_bf16_d128_p1_seg",
        "attn_bf16_d256" => "attn_bf16_d256_seg",
        "attn_bf16_d256_p1" => "attn_bf16_d256_p1_seg",
        "attn_bf16_d512" => "attn_bf16_d512_seg",
        "attn_bf16_d512_p1" => "attn_bf16_d512_p1_seg",
        "attn_bf16_k576_v512" => "attn_bf16_k576_v512_seg",
        "attn_mma_d64" => "attn_mma_d64_seg",
        "attn_mma_d128" => "attn_mma_d128_seg",
        _ => "attn_bf16_k576_v512_p1_seg",
    }
}

/// The attention kernel for a launch of `n` query rows in `blocks` (KV head, key chunk) blocks
/// over `pairs` (row, head) pairs per KV head.
///
/// Past [`MMA_MAX_ROWS`] rows (a batch's step; the products have left the batch-invariant
/// skinny GEMM for cuBLAS there) the tensor-core kernel where the widths have one
/// ([`switches::attn_mma`](crate::switches::attn_mma) `auto`): a c = 32 DFlash step's attention
/// took 5.9 of its 17.5 ms on the CUDA cores, and the step ran 13-16% faster on the tensor
/// cores; at 1-16 rows it ran 4-8% slower (the c = 1 decode and verify, docs/perf.md session
/// 41), and its bits differ from the CUDA-core kernel's, which the decode steps and a
/// sequence's verify must share.
///
/// Otherwise the CUDA-core kernel with the most pairs per block (each block reads its key chunk
/// once for all its pairs) whose grid still gives every multiprocessor a block, else one pair
/// per block. Otherwise a decode step of a model with few KV heads over a short context is a
/// dozen blocks on 132 multiprocessors (qwen3_moe at context 128: 21 us a layer, docs/perf.md
/// session 22). A pair's arithmetic does not depend on which pairs share its block, so the
/// choice keeps the kernel batch-invariant.
fn attn_pick(
    dev: &candle_core::cuda_backend::CudaDevice,
    dk: usize,
    dv: usize,
    n: usize,
    blocks: usize,
    pairs: usize,
) -> Option<(&'static str, usize)> {
    use crate::switches::AttnMma;
    let tensor_cores = match crate::switches::attn_mma() {
        AttnMma::On => true,
        AttnMma::Off => false,
        AttnMma::Auto => n > MMA_MAX_ROWS,
    };
    if tensor_cores {
        if let Some(k) = attn_mma_kernel(dk, dv) {
            return Some(k);
        }
    }
    let v = attn_variants(dk, dv)?;
    let sms = multiprocessors(dev);
    Some(
        v.iter()
            .copied()
            .find(|&(_, p)| blocks * pairs.div_ceil(p) >= sms)
            .unwrap_or(v[v.len() - 1]),
    )
}

/// The device's multiprocessor count (read once; 132, an H100 / H200 SXM's, if the query fails).
fn multiprocessors(dev: &candle_core::cuda_backend::CudaDevice) -> usize {
    use candle_core::cuda_backend::cudarc::driver::sys::CUdevice_attribute;
    static N: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *N.get_or_init(|| {
        dev.cuda_stream()
            .context()
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_or(132, |n| n.max(1) as usize)
    })
}

/// MLA key / value widths the latent attention kernel is built for (DeepSeek-V3 / Kimi:
/// 512 latent + 64 rope dims).
pub const LATENT_DIMS: (usize, usize) = (576, 512);

/// Attention of ready queries (`src [n, heads * width]`, no norm, no rope: `call.q.rot` 0) over
/// the first `call.kv_len` rows of an MLA latent cache `rows [1, cap, width]`, values the first
/// `v_dim` dims of each row: `[n, heads * v_dim]`, or None when the kernel does not apply.
pub fn attention_latent(
    src: &Tensor,
    tables: &Tensor,
    rows: &Tensor,
    v_dim: usize,
    call: &AttentionCall,
) -> candle_core::Result<Option<Tensor>> {
    if !is_bf16_cuda(&[src, tables, rows]) || rows.rank() != 3 || src.rank() != 2 {
        return Ok(None);
    }
    let (_, _, w) = rows.dims3()?;
    if attn_kernel(w, v_dim).is_none()
        || call.q.rot != 0
        || call.q.norm.is_some()
        || call.kv_len == 0
    {
        return Ok(None);
    }
    Ok(Some(src.apply_op3_no_bwd(
        tables,
        rows,
        &Attend(call.clone(), Some(v_dim)),
    )?))
}

/// Attention of the `n` query rows of `src [n, ..]` (heads at `call.q`, normed + roped + scaled
/// in the kernel; row i at position `call.q_pos0 + i`) over the first `call.kv_len` rows of the
/// joint cache `kv [2, kv_heads, cap, head_dim]`, with the call's sinks and output gate.
/// Returns `[n, heads * head_dim]`, or None when the kernel does not apply.
pub fn attention(
    src: &Tensor,
    tables: &Tensor,
    kv: &Tensor,
    call: &AttentionCall,
) -> candle_core::Result<Option<Tensor>> {
    let mut ts = vec![src, tables, kv];
    if let Some(w) = &call.q.norm {
        ts.push(w);
    }
    if let Some(s) = &call.sinks {
        ts.push(s);
    }
    if !is_bf16_cuda(&ts) || kv.rank() != 4 || src.rank() != 2 || call.q.unit_norm {
        return Ok(None);
    }
    let (_, kvh, _, d) = kv.dims4()?;
    if !ATTN_HEAD_DIMS.contains(&d)
        || call.heads % kvh != 0
        || call.q.rot > d
        || call.q.rot % 2 != 0
        || call.kv_len == 0
        || call
            .sinks
            .as_ref()
            .is_some_and(|s| s.elem_count() != call.heads)
    {
        return Ok(None);
    }
    let _: Visibility = call.vis;
    Ok(Some(src.apply_op3_no_bwd(
        tables,
        kv,
        &Attend(call.clone(), None),
    )?))
}

/// One sequence of a batched K/V write or attention: its joint cache `[2, kv_heads, cap, d]`,
/// the position of its first row (the cache length before the write), and its row count. Its
/// rows follow the previous segment's in the batched `src` and `tables`.
#[derive(Clone)]
pub struct Segment {
    pub kv: Tensor,
    pub pos0: usize,
    pub n: usize,
}

/// Positions that live on the device (a CUDA graph replays the launch at other positions):
/// `pos0 [nseg]` i64 holds every segment's first position, the rope table is indexed by
/// absolute position, and attention covers `kv_bound` keys (every segment's `pos0 + n` is at
/// most that; the splits past a segment's keys are empty). `Segment::pos0` then only serves
/// the host's checks.
#[derive(Clone, Debug)]
pub struct DevStep {
    pub pos0: Tensor,
    pub kv_bound: usize,
}

/// The i64 view of a device step's positions, checked against the segment count.
fn pos0_view<'a>(h: &'a Held<'a>, nseg: usize) -> candle_core::Result<CudaView<'a, i64>> {
    match &*h.0 {
        Storage::Cuda(s) => {
            let Some((o, e)) = h.1.contiguous_offsets() else {
                candle_core::bail!("dflash batched attention: step positions must be contiguous");
            };
            if e - o != nseg {
                candle_core::bail!(
                    "dflash batched attention: {} step positions for {nseg} segments",
                    e - o
                );
            }
            Ok(s.as_cuda_slice::<i64>()?.slice(o..e))
        }
        _ => candle_core::bail!("dflash batched attention: step positions are not on the device"),
    }
}

type Slice<T> = candle_core::cuda_backend::cudarc::driver::CudaSlice<T>;
type Kept<K, T> =
    std::sync::OnceLock<std::sync::Mutex<std::collections::HashMap<K, std::sync::Arc<Slice<T>>>>>;

/// A device buffer of `table` kept for good under `key`, made by `make` on first use. Graph
/// launches read such buffers at every replay, and nothing may be made while a graph is
/// captured (the warm-up run, outside the capture, makes them): asked for first during a
/// capture, this fails with `what` named.
fn kept<K: std::hash::Hash + Eq, T>(
    table: &'static Kept<K, T>,
    dev: &candle_core::cuda_backend::CudaDevice,
    key: K,
    what: &str,
    make: impl FnOnce(&K) -> candle_core::Result<Slice<T>>,
) -> candle_core::Result<std::sync::Arc<Slice<T>>> {
    let mut t = table
        .get_or_init(Default::default)
        .lock()
        .map_err(|_| candle_core::Error::Msg(format!("dflash {what} table poisoned")))?;
    if let Some(m) = t.get(&key) {
        return Ok(m.clone());
    }
    if super::graph::capturing(dev) {
        candle_core::bail!(
            "dflash attention: {what} not made in the warm-up run was asked for while a CUDA graph is captured"
        );
    }
    let slice = std::sync::Arc::new(make(&key)?);
    t.insert(key, slice.clone());
    Ok(slice)
}

/// Metadata tables of device-step launches, uploaded once per distinct content and kept
/// ([`kept`]). Their content is the cache pointers and geometry only (positions come from
/// the step), so a model holds one per layer and row count.
fn static_meta(
    dev: &candle_core::cuda_backend::CudaDevice,
    meta: Vec<i64>,
) -> candle_core::Result<std::sync::Arc<Slice<i64>>> {
    static TABLES: Kept<(candle_core::cuda_backend::DeviceId, Vec<i64>), i64> =
        std::sync::OnceLock::new();
    kept(&TABLES, dev, (dev.id(), meta), "a metadata table", |k| {
        dev.clone_htod(&k.1)
    })
}

/// Most (row, head) pairs per block for which the attention kernel merges its key splits
/// itself (below): one launch instead of two for decode steps (qwen3_moe at context 128:
/// 12.0 and 5.0 us a layer -> 9.0, H200 ncu, session 28); with 8 pairs a block the merging
/// block's serial tail cost more than `attn_combine_bf16`'s launch.
const MERGE_MAX_PAIRS: usize = 2;

/// Arrival counters for attention launches that merge their key splits in the kernel (the last
/// block of each (KV head, pair group) merges them: kernels/fused.cu, step 4 of the ATTN
/// kernels), one zeroed buffer per device ([`kept`]): every launch leaves it zeroed again.
/// None when a launch has more (KV head, group) sets than it holds: then the splits are
/// merged by `attn_combine_bf16`, a second launch.
fn split_counters(
    dev: &candle_core::cuda_backend::CudaDevice,
    sets: usize,
) -> candle_core::Result<Option<u64>> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    const SETS: usize = 1 << 16;
    if sets > SETS {
        return Ok(None);
    }
    static BUFS: Kept<candle_core::cuda_backend::DeviceId, i32> = std::sync::OnceLock::new();
    let buf = kept(&BUFS, dev, dev.id(), "the split counters", |_| {
        dev.alloc_zeros::<i32>(SETS)
    })?;
    let stream = dev.cuda_stream();
    let (p, _guard) = buf.device_ptr(&stream);
    Ok(Some(p))
}

/// Number of i64 per segment in the metadata table (`SEG_META` in kernels/fused.cu).
const SEG_META: usize = 6;

/// The metadata table of a batched launch (kernels/fused.cu, `SEG_*`): per segment its cache
/// pointer, capacity, first position, first row, rows and first attention block; then the
/// segment of every row; then the segment of every attention block (`groups` per segment
/// from its rows). Checks every cache against `kvh` and `d`. Also returns the total rows and
/// attention blocks.
fn seg_table(
    segs: &[Segment],
    dev_pos: bool,
    kvh: usize,
    d: usize,
    stream: &candle_core::cuda_backend::cudarc::driver::CudaStream,
    groups: impl Fn(usize) -> usize,
) -> candle_core::Result<(Vec<i64>, usize, usize)> {
    use candle_core::cuda_backend::cudarc::driver::DevicePtr;
    let mut head = Vec::with_capacity(SEG_META * segs.len());
    let mut row_seg = Vec::new();
    let mut blk_seg = Vec::new();
    let (mut row0, mut grp0) = (0usize, 0usize);
    for (i, s) in segs.iter().enumerate() {
        let (two, h, cap, dd) = s.kv.dims4()?;
        if two != 2 || h != kvh || dd != d || s.pos0 + s.n > cap || !s.kv.is_contiguous() {
            candle_core::bail!(
                "dflash batched attention: segment {i} cache {:?} at {} + {} rows (want [2, {kvh}, cap, {d}])",
                s.kv.shape(),
                s.pos0,
                s.n
            );
        }
        let (st, l) = s.kv.storage_and_layout();
        let ptr = match &*st {
            Storage::Cuda(c) => {
                // One stream: the launch that reads this pointer is ordered after every write
                // already queued, so the guard's event is not needed.
                let (p, _guard) = c.as_cuda_slice::<bf16>()?.device_ptr(stream);
                p + (l.start_offset() * std::mem::size_of::<bf16>()) as u64
            }
            _ => candle_core::bail!(
                "dflash batched attention: segment {i} cache is not on the device"
            ),
        };
        let g = groups(s.n);
        head.extend_from_slice(&[
            ptr as i64,
            cap as i64,
            // With device positions the table holds none (so its content does not change
            // with the step).
            if dev_pos { 0 } else { s.pos0 as i64 },
            row0 as i64,
            s.n as i64,
            grp0 as i64,
        ]);
        row_seg.extend(std::iter::repeat_n(i as i64, s.n));
        blk_seg.extend(std::iter::repeat_n(i as i64, g));
        row0 += s.n;
        grp0 += g;
    }
    head.extend(row_seg);
    head.extend(blk_seg);
    Ok((head, row0, grp0))
}

struct KvWriteSegs {
    k: HeadSource,
    v: HeadSource,
    segs: Vec<Segment>,
    tables: Tensor,
    step: Option<DevStep>,
}

/// The metadata table on the device: uploaded for this launch, or (device steps) the kept
/// copy of the same content.
enum Meta {
    Fresh(candle_core::cuda_backend::cudarc::driver::CudaSlice<i64>),
    Kept(std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaSlice<i64>>),
}

impl Meta {
    fn upload(
        dev: &candle_core::cuda_backend::CudaDevice,
        meta: Vec<i64>,
        kept: bool,
    ) -> candle_core::Result<Self> {
        Ok(if kept {
            Meta::Kept(static_meta(dev, meta)?)
        } else {
            Meta::Fresh(dev.clone_htod(&meta)?)
        })
    }
    fn slice(&self) -> &candle_core::cuda_backend::cudarc::driver::CudaSlice<i64> {
        match self {
            Meta::Fresh(m) => m,
            Meta::Kept(m) => m,
        }
    }
}

impl InplaceOp1 for KvWriteSegs {
    fn name(&self) -> &'static str {
        "dflash-kv-write-segments"
    }
    fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        no_cpu(self.name()).map(|_: (CpuStorage, Shape)| ())
    }
    /// `ss`: the batched projection (read, not written: the caches are).
    fn cuda_fwd(&self, ss: &mut CudaStorage, sl: &Layout) -> candle_core::Result<()> {
        let (n, stride) = sl.shape().dims2()?;
        let (_, kvh, _, d) = self.segs[0].kv.dims4()?;
        let (tab_rows, rot_cols) = self.tables.dims2()?;
        let last = |h: &HeadSource| h.offset + (kvh - 1) * h.head_stride + d;
        // One table row per source row, or (device steps) per position up to the bound.
        let rows_ok = match &self.step {
            None => tab_rows == n,
            Some(st) => tab_rows >= st.kv_bound,
        };
        if !rows_ok || self.k.rot != rot_cols || last(&self.k) > stride || last(&self.v) > stride {
            candle_core::bail!(
                "dflash-kv-write-segments: src {:?} tables {:?}",
                sl.shape(),
                self.tables.shape()
            );
        }
        let dev = ss.device().clone();
        let stream = dev.cuda_stream();
        let (meta, total, _) = seg_table(&self.segs, self.step.is_some(), kvh, d, &stream, |_| 0)?;
        if total != n {
            candle_core::bail!("dflash-kv-write-segments: segments of {total} rows for {n}");
        }
        let meta = Meta::upload(&dev, meta, self.step.is_some())?;
        let meta = meta.slice();
        let hp = self.step.as_ref().map(|st| Held::new(&st.pos0));
        let pos0s = hp
            .as_ref()
            .map(|h| pos0_view(h, self.segs.len()))
            .transpose()?;
        let cs_by_pos = self.step.is_some() as i32;
        let src = {
            let Some((o, e)) = sl.contiguous_offsets() else {
                candle_core::bail!("dflash-kv-write-segments: projection must be contiguous");
            };
            ss.as_cuda_slice::<bf16>()?.slice(o..e)
        };
        let ht = Held::new(&self.tables);
        let tab = ht.view("rope tables")?;
        let held = self.k.norm.as_ref().map(Held::new);
        let kw = opt_view(&held, "head norm weight")?;
        let func = dev.get_or_load_custom_func("kv_write_seg_bf16", "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, n as u32, 1),
            block_dim: (block_for(d), 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        let i = |x: usize| x as i32;
        let (stride_i, k_off, k_hs, v_off, v_hs, v_unit) = (
            i(stride),
            i(self.k.offset),
            i(self.k.head_stride),
            i(self.v.offset),
            i(self.v.head_stride),
            self.v.unit_norm as i32,
        );
        let (eps, rot, nseg, kvh_i, d_i) =
            (self.k.eps, i(self.k.rot), i(self.segs.len()), i(kvh), i(d));
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&stride_i);
        b.arg(&k_off);
        b.arg(&k_hs);
        b.arg(&v_off);
        b.arg(&v_hs);
        b.arg(&v_unit);
        push_opt(&mut b, &kw, &null);
        b.arg(&eps);
        b.arg(&tab);
        b.arg(&rot);
        b.arg(meta);
        b.arg(&nseg);
        b.arg(&kvh_i);
        b.arg(&d_i);
        match &pos0s {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(&cs_by_pos);
        // SAFETY: argument types match the kernel; every segment's rows fit its cache
        // (seg_table checked), shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok(())
    }
}

/// [`kv_write`] for several sequences in one launch: `src [N, ..]` and `tables [N, rot]` hold
/// the segments' rows back to back; segment s's rows go to its cache at `pos0 ..`. False
/// (nothing written) when the kernel does not apply.
pub fn kv_write_segments(
    src: &Tensor,
    tables: &Tensor,
    k: &HeadSource,
    v: &HeadSource,
    segs: &[Segment],
    step: Option<&DevStep>,
) -> candle_core::Result<bool> {
    let mut ts = vec![src, tables];
    ts.extend(segs.iter().map(|s| &s.kv));
    if let Some(w) = &k.norm {
        ts.push(w);
    }
    if segs.is_empty() || !is_bf16_cuda(&ts) || src.rank() != 2 || v.norm.is_some() {
        return Ok(false);
    }
    let (_, _, _, head_dim) = segs[0].kv.dims4()?;
    if head_dim > 1024 || k.rot > head_dim || k.rot % 2 != 0 {
        return Ok(false);
    }
    src.inplace_op1(&KvWriteSegs {
        k: k.clone(),
        v: v.clone(),
        segs: segs.to_vec(),
        tables: tables.clone(),
        step: step.cloned(),
    })?;
    Ok(true)
}

struct AttendSegs {
    call: AttentionCall,
    segs: Vec<Segment>,
    step: Option<DevStep>,
}

impl CustomOp2 for AttendSegs {
    fn name(&self) -> &'static str {
        "dflash-attention-segments"
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(
        &self,
        ss: &CudaStorage,
        sl: &Layout,
        cs: &CudaStorage,
        cl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let c = &self.call;
        let (n, stride) = sl.shape().dims2()?;
        let (_, kvh, _, d) = self.segs[0].kv.dims4()?;
        let (tab_rows, rot_cols) = cl.shape().dims2()?;
        let heads = c.heads;
        let q_last = c.q.offset + (heads - 1) * c.q.head_stride + d + c.gate_offset.unwrap_or(0);
        // The same fixed key chunks as `Attend` (a row's arithmetic depends on its position
        // only, so a sequence's rows give the bits they give alone); the split count is the
        // longest segment's (or the device step's bound), and a shorter segment's extra splits
        // are empty.
        let chunk = ATTN_CHUNK;
        let longest = match &self.step {
            Some(st) => st.kv_bound,
            None => self.segs.iter().map(|s| s.pos0 + s.n).max().unwrap_or(1),
        };
        let splits = longest.div_ceil(chunk).max(1);
        let rows_ok = match &self.step {
            None => tab_rows == n,
            Some(st) => tab_rows >= st.kv_bound,
        };
        if heads % kvh != 0 || !rows_ok || (c.q.rot != 0 && c.q.rot != rot_cols) || q_last > stride
        {
            candle_core::bail!(
                "dflash-attention-segments: src {:?} tables {:?} heads {heads}",
                sl.shape(),
                cl.shape()
            );
        }
        let rep = heads / kvh;
        let dev = ss.device();
        // As `Attend` picks (a pair's arithmetic does not depend on its block's other pairs).
        let Some((name, pairs_per_block)) = attn_pick(dev, d, d, n, kvh * splits, n * rep) else {
            candle_core::bail!("dflash-attention-segments: head dim {d}");
        };
        let stream = dev.cuda_stream();
        let dev_pos = self.step.is_some();
        let (meta, total, blocks) = seg_table(&self.segs, dev_pos, kvh, d, &stream, |rows| {
            (rows * rep).div_ceil(pairs_per_block)
        })?;
        if total != n {
            candle_core::bail!("dflash-attention-segments: segments of {total} rows for {n}");
        }
        let meta = Meta::upload(dev, meta, dev_pos)?;
        let meta = meta.slice();
        let hp = self.step.as_ref().map(|st| Held::new(&st.pos0));
        let pos0s = hp
            .as_ref()
            .map(|h| pos0_view(h, self.segs.len()))
            .transpose()?;
        let cs_by_pos = dev_pos as i32;
        let src = view(ss, sl, "projection")?;
        let tab = view(cs, cl, "rope tables")?;
        let held_q = c.q.norm.as_ref().map(Held::new);
        let qw = opt_view(&held_q, "head norm weight")?;
        let held_s = c.sinks.as_ref().map(Held::new);
        let sinks = opt_view(&held_s, "sinks")?;
        let rows = heads * n;
        // SAFETY: every element is written (by attn: one split or its merging blocks; else attn_combine).
        let out = unsafe { dev.alloc::<bf16>(n * heads * d)? };
        let part = unsafe {
            dev.alloc::<f32>(if splits > 1 {
                rows * splits * (d + 2)
            } else {
                1
            })?
        };
        let func = dev.get_or_load_custom_func(seg_name(name), "dflash_fused", FUSED_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (kvh as u32, splits as u32, blocks as u32),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        let i = |x: usize| x as i32;
        let (stride_i, q_off, q_hs, eps, rot, scale) = (
            i(stride),
            i(c.q.offset),
            i(c.q.head_stride),
            c.q.eps,
            i(c.q.rot),
            c.scale,
        );
        let (nseg, total_i, kvh_i, rep_i) = (i(self.segs.len()), i(n), i(kvh), i(rep));
        let (causal, window, chunk_i) = (
            c.vis.causal as i32,
            c.vis.window.unwrap_or(0).min(i32::MAX as usize) as i32,
            i(chunk),
        );
        let gate_off = c.gate_offset.map_or(-1, i);
        let null = 0u64;
        let mut b = func.builder();
        b.arg(&src);
        b.arg(&stride_i);
        b.arg(&q_off);
        b.arg(&q_hs);
        push_opt(&mut b, &qw, &null);
        b.arg(&eps);
        b.arg(&tab);
        b.arg(&rot);
        b.arg(&scale);
        b.arg(meta);
        b.arg(&nseg);
        b.arg(&total_i);
        b.arg(&kvh_i);
        b.arg(&rep_i);
        b.arg(&causal);
        b.arg(&window);
        b.arg(&chunk_i);
        push_opt(&mut b, &sinks, &null);
        b.arg(&gate_off);
        b.arg(&out);
        b.arg(&part);
        match &pos0s {
            Some(p) => b.arg(p),
            None => b.arg(&null),
        };
        b.arg(&cs_by_pos);
        let counters = if splits > 1 && pairs_per_block <= MERGE_MAX_PAIRS {
            split_counters(dev, kvh * blocks)?
        } else {
            None
        };
        b.arg(counters.as_ref().unwrap_or(&null));
        // SAFETY: argument types match the kernel; seg_table checked every segment's cache.
        unsafe { b.launch(cfg) }.w()?;
        if splits > 1 && counters.is_none() {
            let g = Gate {
                src: &src,
                stride: stride_i,
                q_off,
                q_hs,
                gate_off,
            };
            combine_splits(dev, &part, &out, heads, n, splits, d, &sinks, &g)?;
        }
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, heads * d)),
        ))
    }
}

/// [`attention`] for several sequences in one launch: `src [N, ..]` and `tables [N, rot]`
/// hold the segments' query rows back to back; segment s's rows sit at positions `pos0 ..`
/// and attend over the first `pos0 + n` rows of its own cache (already written). The call's
/// `kv_len` and `q_pos0` are ignored (per segment). None when the kernel does not apply.
pub fn attention_segments(
    src: &Tensor,
    tables: &Tensor,
    segs: &[Segment],
    call: &AttentionCall,
    step: Option<&DevStep>,
) -> candle_core::Result<Option<Tensor>> {
    let mut ts = vec![src, tables];
    ts.extend(segs.iter().map(|s| &s.kv));
    if let Some(w) = &call.q.norm {
        ts.push(w);
    }
    if let Some(s) = &call.sinks {
        ts.push(s);
    }
    if segs.is_empty() || !is_bf16_cuda(&ts) || src.rank() != 2 || call.q.unit_norm {
        return Ok(None);
    }
    let (_, kvh, _, d) = segs[0].kv.dims4()?;
    if !ATTN_HEAD_DIMS.contains(&d)
        || call.heads % kvh != 0
        || call.q.rot > d
        || call.q.rot % 2 != 0
        || segs.iter().any(|s| s.pos0 + s.n == 0)
        || call
            .sinks
            .as_ref()
            .is_some_and(|s| s.elem_count() != call.heads)
    {
        return Ok(None);
    }
    Ok(Some(src.apply_op2_no_bwd(
        tables,
        &AttendSegs {
            call: call.clone(),
            segs: segs.to_vec(),
            step: step.cloned(),
        },
    )?))
}
