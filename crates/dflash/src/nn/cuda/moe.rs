//! The MoE block on the device (`kernels/moe.cu`): routing, the union of the chosen experts'
//! GEMMs (the layer's shared expert as one more slot) and the weighted combine in one op, no
//! host round trip. `nn::moe` decides when it runs.

use super::*;
use crate::nn::moe::ExpertMatrix;

const MOE_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/moe.ptx"));

/// Most rows one call takes (the kernels keep one accumulator per routed row of an expert).
pub const MOE_MAX_ROWS: usize = 16;
/// Most experts the routing kernel handles (256 threads x 4).
pub const MOE_MAX_EXPERTS: usize = 1024;
/// Ints per union slot (kernels/moe.cu `build_union`): expert, pair count, up to 16 pairs.
const SLOT_W: usize = MOE_MAX_ROWS + 2;

/// How the router scores (kernels/moe.cu's `route_row` modes).
#[derive(Clone, Debug)]
pub enum RouteMode {
    Softmax {
        renormalize: bool,
    },
    TopKSoftmax,
    SigmoidGrouped {
        /// `[E]` f32 on the device.
        correction: Tensor,
        n_group: usize,
        topk_group: usize,
        renormalize: bool,
    },
}

/// The expert activation (kernels/moe.cu's `expert_act` modes).
#[derive(Clone, Copy, Debug)]
pub enum ActMode {
    Silu,
    GeluTanh,
    ClampedGlu { limit: f32, alpha: f32 },
}

/// Everything one MoE launch needs besides the rows and the router logits.
#[derive(Clone, Debug)]
pub struct MoeCall {
    pub mode: RouteMode,
    pub top_k: usize,
    /// `[E]` f32 on the device, or None.
    pub per_expert_scale: Option<Tensor>,
    pub scale: f32,
    /// `[E, 2I, H]`, `[E, 2I]`, `[E, H, I]`, `[E, H]`: bf16, the stacks also MXFP4 or MLX
    /// affine 4-bit as stored (the tensor-core kernels only, no shared expert).
    pub gate_up: ExpertMatrix,
    pub gate_up_bias: Option<Tensor>,
    pub down: ExpertMatrix,
    pub down_bias: Option<Tensor>,
    pub inter: usize,
    pub act: ActMode,
    /// The shared expert, run as one more slot of the same launches (needs the tensor-core
    /// kernels: [`mma_widths`]).
    pub shared: Option<SharedCall>,
}

/// A shared expert of the routed experts' width and activation, every row routed to it with
/// weight `sigmoid(x . gate)` (Qwen) or 1 (no gate).
#[derive(Clone, Debug)]
pub struct SharedCall {
    /// `[2I, H]` (gate rows then up rows), `[H, I]`, `[H]` bf16.
    pub gate_up: Tensor,
    pub down: Tensor,
    pub gate: Option<Tensor>,
}

/// Whether the expert GEMMs run on the tensor cores (both widths multiples of 32; chosen from
/// the shapes alone, so a row always meets the same arithmetic): only they take a shared
/// expert.
pub fn mma_widths(hidden: usize, inter: usize) -> bool {
    hidden % 32 == 0 && inter % 32 == 0
}

/// An expert stack's operands as the kernels take them: bf16, MXFP4 codes and scales, or
/// affine 4-bit words and (scale, bias) words with log2(group / 32).
enum StackView<'a> {
    Bf16(CudaView<'a, bf16>),
    Mx(CudaView<'a, u8>, CudaView<'a, u8>),
    Af(CudaView<'a, u32>, CudaView<'a, u32>, i32),
}

/// The storage kind of an expert stack, as the kernels' names spell it.
fn stack_kind(m: &ExpertMatrix) -> &'static str {
    match m {
        ExpertMatrix::Float(_) => "",
        ExpertMatrix::Mxfp4(_) => "mx_",
        ExpertMatrix::Affine { .. } => "af_",
    }
}

/// Whether an affine stack is the kind the `_af` kernels take (4 bits, bf16 scales).
fn affine_ok(m: &ExpertMatrix) -> bool {
    match m {
        ExpertMatrix::Affine { w, .. } => {
            w.bits == 4 && !w.f16 && matches!(w.group, 32 | 64 | 128) && w.q.dtype() == DType::U32
        }
        _ => true,
    }
}

fn u8_view<'a>(h: &'a Held<'a>, what: &str) -> candle_core::Result<CudaView<'a, u8>> {
    match &*h.0 {
        Storage::Cuda(s) => view_of::<u8>(s, h.1, what),
        _ => candle_core::bail!("dflash moe: {what} is not on the CUDA device"),
    }
}

fn u32_view<'a>(h: &'a Held<'a>, what: &str) -> candle_core::Result<CudaView<'a, u32>> {
    match &*h.0 {
        Storage::Cuda(s) => view_of::<u32>(s, h.1, what),
        _ => candle_core::bail!("dflash moe: {what} is not on the CUDA device"),
    }
}

/// The tensors an expert stack's view borrows (the second: scales; the group for affine).
struct StackHeld<'a>(Held<'a>, Option<Held<'a>>, Option<usize>);

impl<'a> StackHeld<'a> {
    fn new(m: &'a ExpertMatrix) -> Self {
        match m {
            ExpertMatrix::Float(t) => StackHeld(Held::new(t), None, None),
            ExpertMatrix::Mxfp4(s) => StackHeld(Held::new(&s.q), Some(Held::new(&s.scales)), None),
            ExpertMatrix::Affine { w, .. } => {
                StackHeld(Held::new(&w.q), Some(Held::new(&w.sb)), Some(w.group))
            }
        }
    }
    fn view(&'a self, what: &str) -> candle_core::Result<StackView<'a>> {
        Ok(match (&self.1, self.2) {
            (None, _) => StackView::Bf16(self.0.view(what)?),
            (Some(s), None) => StackView::Mx(u8_view(&self.0, what)?, u8_view(s, what)?),
            (Some(s), Some(g)) => StackView::Af(
                u32_view(&self.0, what)?,
                u32_view(s, what)?,
                (g / 32).trailing_zeros() as i32,
            ),
        })
    }
}

struct MoeOp {
    logits: Tensor,
    call: MoeCall,
}

fn f32_view<'a>(h: &'a Held<'a>, what: &str) -> candle_core::Result<CudaView<'a, f32>> {
    match &*h.0 {
        Storage::Cuda(s) => {
            let Some((o, e)) = h.1.contiguous_offsets() else {
                candle_core::bail!("dflash moe: {what} must be contiguous");
            };
            Ok(s.as_cuda_slice::<f32>()?.slice(o..e))
        }
        _ => candle_core::bail!("dflash moe: {what} is not on the CUDA device"),
    }
}

impl CustomOp1 for MoeOp {
    fn name(&self) -> &'static str {
        "dflash-moe"
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        no_cpu(self.name())
    }
    fn cuda_fwd(&self, xs: &CudaStorage, xl: &Layout) -> candle_core::Result<(CudaStorage, Shape)> {
        let c = &self.call;
        let (n, hidden) = xl.shape().dims2()?;
        let (e_count, two_i, h2) = c.gate_up.dims()?;
        // "" (bf16), "mx_" (MXFP4) or "af_" (affine): the quantized kinds take the tensor-core
        // kernels only, without a shared expert
        let kind = stack_kind(&c.gate_up);
        let quant = !kind.is_empty();
        let k = c.top_k;
        let inter = c.inter;
        let ok = two_i == 2 * inter
            && h2 == hidden
            && c.down.dims()? == (e_count, hidden, inter)
            && kind == stack_kind(&c.down)
            && affine_ok(&c.gate_up)
            && affine_ok(&c.down)
            && (!quant || (mma_widths(hidden, inter) && c.shared.is_none()))
            && self.logits.dims2()? == (n, e_count)
            && n <= MOE_MAX_ROWS
            && e_count <= MOE_MAX_EXPERTS
            && k >= 1
            && k <= 16
            && k <= e_count
            && hidden % 8 == 0
            && inter % 8 == 0
            && c.shared.as_ref().is_none_or(|s| {
                mma_widths(hidden, inter)
                    && s.gate_up.dims() == [2 * inter, hidden]
                    && s.down.dims() == [hidden, inter]
                    && s.gate.as_ref().is_none_or(|g| g.dims() == [hidden])
            });
        if !ok {
            candle_core::bail!(
                "dflash-moe: x {:?} logits {:?} gate_up {:?} down {:?} k {k} (stacks {kind:?})",
                xl.shape(),
                self.logits.shape(),
                c.gate_up.dims()?,
                c.down.dims()?
            );
        }
        let dev = xs.device();
        let x = view(xs, xl, "rows")?;
        let hl = Held::new(&self.logits);
        let logits_bf16 = self.logits.dtype() == DType::BF16;
        // The router's output as it is: bf16 (read so by the routing kernel, no cast launch) or f32.
        let logits_b = logits_bf16.then(|| hl.view("router logits")).transpose()?;
        let logits_f = (!logits_bf16)
            .then(|| f32_view(&hl, "router logits"))
            .transpose()?;
        let (hgu, hd) = (StackHeld::new(&c.gate_up), StackHeld::new(&c.down));
        let (gu, down) = (hgu.view("expert gate_up")?, hd.view("expert down")?);
        let hgb = c.gate_up_bias.as_ref().map(Held::new);
        let hdb = c.down_bias.as_ref().map(Held::new);
        let gub = hgb
            .as_ref()
            .map(|h| h.view("expert gate_up bias"))
            .transpose()?;
        let db = hdb
            .as_ref()
            .map(|h| h.view("expert down bias"))
            .transpose()?;
        let hpe = c.per_expert_scale.as_ref().map(Held::new);
        let pe = hpe
            .as_ref()
            .map(|h| f32_view(h, "per-expert scale"))
            .transpose()?;
        let (mode, renorm, corr_t, n_group, topk_group) = match &c.mode {
            RouteMode::Softmax { renormalize } => (0i32, *renormalize, None, 1usize, 1usize),
            RouteMode::TopKSoftmax => (1, false, None, 1, 1),
            RouteMode::SigmoidGrouped {
                correction,
                n_group,
                topk_group,
                renormalize,
            } => (2, *renormalize, Some(correction), *n_group, *topk_group),
        };
        if mode == 2 && (n_group == 0 || n_group > 64 || e_count % n_group != 0) {
            candle_core::bail!("dflash-moe: {n_group} groups of {e_count} experts");
        }
        let hc = corr_t.map(Held::new);
        let corr = hc
            .as_ref()
            .map(|h| f32_view(h, "correction bias"))
            .transpose()?;
        let npairs = n * k;
        // the shared expert: pairs npairs + r, one more slot (expert index e_count)
        let hs = c.shared.as_ref().map(|s| {
            (
                Held::new(&s.gate_up),
                Held::new(&s.down),
                s.gate.as_ref().map(Held::new),
            )
        });
        let shared = hs
            .as_ref()
            .map(|(gu, d, g)| {
                Ok::<_, candle_core::Error>((
                    gu.view("shared expert gate_up")?,
                    d.view("shared expert down")?,
                    g.as_ref()
                        .map(|g| g.view("shared expert gate"))
                        .transpose()?,
                ))
            })
            .transpose()?;
        let extra = if shared.is_some() { n } else { 0 };
        let shared_e: i32 = if shared.is_some() { e_count as i32 } else { -1 };
        // SAFETY: moe_route_union writes every id and weight; moe_gate_up writes h for every pair
        // (each pair's expert has a block for every tile), moe_down every y; combine all out.
        let ids = unsafe { dev.alloc::<u32>(npairs)? };
        // the union of chosen experts: per slot (expert, pair count, pairs), then the count
        let nslots = e_count.min(npairs) + usize::from(shared.is_some());
        let slots = unsafe { dev.alloc::<u32>(nslots * SLOT_W + 1)? };
        let wts = unsafe { dev.alloc::<f32>(npairs + extra)? };
        let h = unsafe { dev.alloc::<bf16>((npairs + extra) * inter)? };
        let y = unsafe { dev.alloc::<f32>((npairs + extra) * hidden)? };
        let out = unsafe { dev.alloc::<bf16>(n * hidden)? };
        let null = 0u64;
        let i = |v: usize| v as i32;

        let (e_i, k_i, renorm_i, ng_i, tg_i, scale) = (
            i(e_count),
            i(k),
            renorm as i32,
            i(n_group),
            i(topk_group),
            c.scale,
        );
        let lb_i = logits_bf16 as i32;
        let ns_i = i(nslots);
        // 1. routing and 2. the union of chosen experts, in one launch (one block, a warp per
        // row; 32 x `per` experts a warp, E <= MOE_MAX_EXPERTS = 32 x 32)
        let name = match e_count {
            0..=128 => "moe_route_union_e4",
            129..=256 => "moe_route_union_e8",
            257..=512 => "moe_route_union_e16",
            _ => "moe_route_union_e32",
        };
        let func = dev.get_or_load_custom_func(name, "dflash_moe", MOE_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let n_i = i(n);
        let mut b = func.builder();
        if let Some(v) = &logits_b {
            b.arg(v);
        } else if let Some(v) = &logits_f {
            b.arg(v);
        }
        b.arg(&lb_i);
        b.arg(&n_i);
        b.arg(&e_i);
        b.arg(&k_i);
        b.arg(&mode);
        b.arg(&renorm_i);
        match &corr {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&ng_i);
        b.arg(&tg_i);
        match &pe {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&scale);
        b.arg(&ids);
        b.arg(&wts);
        b.arg(&ns_i);
        b.arg(&slots);
        b.arg(&shared_e);
        b.arg(&x);
        match shared.as_ref().and_then(|s| s.2.as_ref()) {
            Some(g) => b.arg(g),
            None => b.arg(&null),
        };
        let hid_i = i(hidden);
        b.arg(&hid_i);
        // SAFETY: argument types match the kernel; shapes checked above.
        unsafe { b.launch(cfg) }.w()?;
        // At most one pair of a row per expert: P accumulators cover every expert's pairs.
        let p = n.next_power_of_two().min(16);
        let grid_x = nslots as u32;
        let (act, limit, alpha) = match c.act {
            ActMode::Silu => (0i32, 0f32, 0f32),
            ActMode::GeluTanh => (1, 0.0, 0.0),
            ActMode::ClampedGlu { limit, alpha } => (2, limit, alpha),
        };
        let (inter_i, hid_i) = (i(inter), i(hidden));
        // The tensor-core kernels where the widths allow, tiles of 8 rows for the pairs one
        // expert can have (at most one per row).
        let mma = mma_widths(hidden, inter);
        let t2 = n > 8;
        // the FMA kernels' accumulators per weight row
        let pi = p.trailing_zeros() as usize;

        // 3. gate/up of every chosen expert: 16 (tensor cores) or 8 units per block
        const UNITS: usize = 8;
        let t_name = if t2 { "t2" } else { "t1" };
        let mma_name = |op: &str| format!("moe_{op}_mma_{kind}{t_name}");
        let (name, units) = if mma {
            (mma_name("gate_up"), 16)
        } else {
            const NAMES: [&str; 5] = [
                "moe_gate_up_p1",
                "moe_gate_up_p2",
                "moe_gate_up_p4",
                "moe_gate_up_p8",
                "moe_gate_up_p16",
            ];
            (NAMES[pi].to_string(), UNITS)
        };
        let func = dev.get_or_load_custom_func(&name, "dflash_moe", MOE_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (grid_x, inter.div_ceil(units) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let units_i = i(UNITS);
        let mut b = func.builder();
        b.arg(&x);
        b.arg(&slots);
        b.arg(&ns_i);
        b.arg(&k_i);
        match &gu {
            StackView::Bf16(w) => b.arg(w),
            StackView::Mx(q, s) => b.arg(q).arg(s),
            StackView::Af(q, sb, gs) => b.arg(q).arg(sb).arg(gs),
        };
        match &gub {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&inter_i);
        b.arg(&hid_i);
        if !mma {
            b.arg(&units_i);
        }
        b.arg(&act);
        b.arg(&limit);
        b.arg(&alpha);
        b.arg(&h);
        let np_i = i(npairs);
        if mma && !quant {
            b.arg(&shared_e);
            b.arg(&np_i);
            match &shared {
                Some(s) => b.arg(&s.0),
                None => b.arg(&null),
            };
        }
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.w()?;

        // 4. down projections: 32 (tensor cores) or 16 output rows per block
        const ROWS: usize = 16;
        let (name, rows) = if mma {
            (mma_name("down"), 32)
        } else {
            const NAMES: [&str; 5] = [
                "moe_down_p1",
                "moe_down_p2",
                "moe_down_p4",
                "moe_down_p8",
                "moe_down_p16",
            ];
            (NAMES[pi].to_string(), ROWS)
        };
        let func = dev.get_or_load_custom_func(&name, "dflash_moe", MOE_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (grid_x, hidden.div_ceil(rows) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let rows_i = i(ROWS);
        let mut b = func.builder();
        b.arg(&h);
        b.arg(&slots);
        b.arg(&ns_i);
        match &down {
            StackView::Bf16(w) => b.arg(w),
            StackView::Mx(q, s) => b.arg(q).arg(s),
            StackView::Af(q, sb, gs) => b.arg(q).arg(sb).arg(gs),
        };
        match &db {
            Some(v) => b.arg(v),
            None => b.arg(&null),
        };
        b.arg(&inter_i);
        b.arg(&hid_i);
        if !mma {
            b.arg(&rows_i);
        }
        b.arg(&y);
        if mma && !quant {
            b.arg(&shared_e);
            match &shared {
                Some(s) => b.arg(&s.1),
                None => b.arg(&null),
            };
        }
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.w()?;

        // 5. the weighted sum over each row's slots (the shared expert's last)
        let func = dev.get_or_load_custom_func("moe_combine", "dflash_moe", MOE_PTX)?;
        let cfg = LaunchConfig {
            grid_dim: (n as u32, hidden.div_ceil(256) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut b = func.builder();
        b.arg(&y);
        b.arg(&wts);
        b.arg(&k_i);
        b.arg(&hid_i);
        b.arg(&out);
        let has_shared = i32::from(shared.is_some());
        b.arg(&has_shared);
        // SAFETY: as above.
        unsafe { b.launch(cfg) }.w()?;
        drop((ids, slots, wts, h, y));
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((n, hidden)),
        ))
    }
}

/// The routed experts' output `[n, H]` for rows `x [n, H]` with router `logits [n, E]` (f32):
/// None when the kernels do not apply (not CUDA, not bf16, more than [`MOE_MAX_ROWS`] rows,
/// widths not a multiple of 8, too many experts).
pub fn moe(x: &Tensor, logits: &Tensor, call: &MoeCall) -> candle_core::Result<Option<Tensor>> {
    let mut ts = vec![x];
    let mut packed = vec![];
    for m in [&call.gate_up, &call.down] {
        match m {
            ExpertMatrix::Float(t) => ts.push(t),
            ExpertMatrix::Mxfp4(s) => packed.extend([(&s.q, DType::U8), (&s.scales, DType::U8)]),
            ExpertMatrix::Affine { w, .. } => {
                packed.extend([(&w.q, DType::U32), (&w.sb, DType::U32)])
            }
        }
    }
    let packed_ok = packed
        .iter()
        .all(|(t, dt)| t.device().is_cuda() && t.dtype() == *dt && t.is_contiguous())
        && affine_ok(&call.gate_up)
        && affine_ok(&call.down);
    ts.extend(call.gate_up_bias.as_ref());
    ts.extend(call.down_bias.as_ref());
    if let Some(sh) = &call.shared {
        ts.extend([&sh.gate_up, &sh.down]);
        ts.extend(sh.gate.as_ref());
    }
    if !is_bf16_cuda(&ts)
        || !packed_ok
        || x.rank() != 2
        || !matches!(logits.dtype(), DType::F32 | DType::BF16)
    {
        return Ok(None);
    }
    let (n, hidden) = x.dims2()?;
    let e = call.gate_up.dims()?.0;
    // MXFP4 and affine stacks: the tensor-core kernels only, without a shared expert
    if !packed.is_empty() && (!mma_widths(hidden, call.inter) || call.shared.is_some()) {
        return Ok(None);
    }
    if n == 0
        || n > MOE_MAX_ROWS
        || e > MOE_MAX_EXPERTS
        || call.top_k == 0
        || call.top_k > 16
        || hidden % 8 != 0
        || call.inter % 8 != 0
        || !logits.device().is_cuda()
    {
        return Ok(None);
    }
    let op = MoeOp {
        logits: logits.contiguous()?,
        call: call.clone(),
    };
    Ok(Some(x.apply_op1_no_bwd(&op)?))
}

struct Mxfp4Dequant;

impl CustomOp2 for Mxfp4Dequant {
    fn name(&self) -> &'static str {
        "dflash-mxfp4-dequant"
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
        qs: &CudaStorage,
        ql: &Layout,
        ss: &CudaStorage,
        sl: &Layout,
    ) -> candle_core::Result<(CudaStorage, Shape)> {
        let groups = sl.shape().elem_count();
        if ql.shape().elem_count() != 16 * groups || ql.start_offset() % 4 != 0 {
            candle_core::bail!(
                "{}: codes {:?} for scales {:?}",
                self.name(),
                ql.shape(),
                sl.shape()
            );
        }
        let q = view_of::<u8>(qs, ql, "codes")?;
        let s = view_of::<u8>(ss, sl, "scales")?;
        let dev = qs.device();
        let func = dev.get_or_load_custom_func("mxfp4_dequant", "dflash_moe", MOE_PTX)?;
        // SAFETY: every element is written (one thread a word of 8 codes).
        let out = unsafe { dev.alloc::<bf16>(32 * groups)? };
        let cfg = LaunchConfig {
            grid_dim: (((4 * groups) as u32).div_ceil(256), 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let g = groups as i64;
        let mut b = func.builder();
        b.arg(&q);
        b.arg(&s);
        b.arg(&g);
        b.arg(&out);
        // SAFETY: argument types match the kernel; sizes checked above.
        unsafe { b.launch(cfg) }.w()?;
        Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from(32 * groups),
        ))
    }
}

/// MXFP4 codes `q` (u8, 16 bytes a group) and scales `s` (u8, one a group) dequantized to bf16
/// (flat, 32 values a group) on their CUDA device, exactly; None when they are not on one.
pub fn mxfp4_dequantize(q: &Tensor, s: &Tensor) -> candle_core::Result<Option<Tensor>> {
    if !q.device().is_cuda() {
        return Ok(None);
    }
    Ok(Some(
        q.contiguous()?
            .apply_op2_no_bwd(&s.contiguous()?, &Mxfp4Dequant)?,
    ))
}
