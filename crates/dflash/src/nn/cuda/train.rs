//! Launchers of the training kernels (`kernels/train.cu`) for `nn::train_ops`, which holds the
//! custom ops, their CPU paths and their backwards: one block of 256 threads per row.

use super::*;

const TRAIN_PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/train.ptx"));

fn row_cfg(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn rows_of(l: &Layout, cols: usize) -> usize {
    l.shape().elem_count() / cols.max(1)
}

/// `softmax(x + mask[r % n])` per row of `cols` columns (`x` f32, `mask [n, cols]` f32).
pub fn masked_softmax_f32(
    xs: &CudaStorage,
    xl: &Layout,
    ms: &CudaStorage,
    ml: &Layout,
    n: usize,
    cols: usize,
) -> candle_core::Result<CudaStorage> {
    let dev = xs.device();
    let (x, m) = (
        view_of::<f32>(xs, xl, "scores")?,
        view_of::<f32>(ms, ml, "mask")?,
    );
    let rows = rows_of(xl, cols);
    // SAFETY: the kernel writes every element.
    let y = unsafe { dev.alloc::<f32>(rows * cols)? };
    let func = dev.get_or_load_custom_func("masked_softmax_f32", "dflash_train", TRAIN_PTX)?;
    let (l_i, n_i) = (cols as i32, n as i32);
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&m);
    b.arg(&y);
    b.arg(&l_i);
    b.arg(&n_i);
    // SAFETY: argument types match the kernel; the caller checked the mask's shape.
    unsafe { b.launch(row_cfg(rows)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// `y * (dy - sum(y * dy))` per row of `cols` columns.
pub fn softmax_bwd_f32(
    ys: &CudaStorage,
    yl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    cols: usize,
) -> candle_core::Result<CudaStorage> {
    if yl.shape() != gl.shape() {
        candle_core::bail!("dflash-softmax-bwd: {:?} vs {:?}", yl.shape(), gl.shape());
    }
    let dev = ys.device();
    let (y, g) = (
        view_of::<f32>(ys, yl, "softmax")?,
        view_of::<f32>(gs, gl, "gradient")?,
    );
    let rows = rows_of(yl, cols);
    // SAFETY: the kernel writes every element.
    let dx = unsafe { dev.alloc::<f32>(rows * cols)? };
    let func = dev.get_or_load_custom_func("softmax_bwd_f32", "dflash_train", TRAIN_PTX)?;
    let l_i = cols as i32;
    let mut b = func.builder();
    b.arg(&y);
    b.arg(&g);
    b.arg(&dx);
    b.arg(&l_i);
    // SAFETY: argument types match the kernel; shapes checked above.
    unsafe { b.launch(row_cfg(rows)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

fn check_rows(what: &str, l: &Layout, m: usize) -> candle_core::Result<()> {
    if l.shape().elem_count() != m {
        candle_core::bail!("{what}: {:?} for {m} rows", l.shape());
    }
    Ok(())
}

/// `w[r] * (logsumexp(x[r]) - x[r, label[r]])` of `[m, v]` logits.
#[allow(clippy::too_many_arguments)]
pub fn xent_fwd_f32(
    xs: &CudaStorage,
    xl: &Layout,
    ls: &CudaStorage,
    ll: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    m: usize,
    v: usize,
) -> candle_core::Result<CudaStorage> {
    check_rows("dflash-weighted-xent labels", ll, m)?;
    check_rows("dflash-weighted-xent weights", wl, m)?;
    let dev = xs.device();
    let x = view_of::<f32>(xs, xl, "logits")?;
    let lab = view_of::<u32>(ls, ll, "labels")?;
    let w = view_of::<f32>(ws, wl, "weights")?;
    // SAFETY: the kernel writes every element.
    let out = unsafe { dev.alloc::<f32>(m)? };
    let func = dev.get_or_load_custom_func("xent_fwd_f32", "dflash_train", TRAIN_PTX)?;
    let v_i = v as i32;
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&lab);
    b.arg(&w);
    b.arg(&out);
    b.arg(&v_i);
    // SAFETY: argument types match the kernel; sizes checked above (labels < v: the caller's).
    unsafe { b.launch(row_cfg(m)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}

/// `g[r] * (softmax(x[r]) - onehot(label[r]))` of `[m, v]` logits.
#[allow(clippy::too_many_arguments)]
pub fn xent_bwd_f32(
    xs: &CudaStorage,
    xl: &Layout,
    ls: &CudaStorage,
    ll: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    m: usize,
    v: usize,
) -> candle_core::Result<CudaStorage> {
    check_rows("dflash-weighted-xent-bwd labels", ll, m)?;
    check_rows("dflash-weighted-xent-bwd gradient", gl, m)?;
    let dev = xs.device();
    let x = view_of::<f32>(xs, xl, "logits")?;
    let lab = view_of::<u32>(ls, ll, "labels")?;
    let g = view_of::<f32>(gs, gl, "gradient")?;
    // SAFETY: the kernel writes every element.
    let dx = unsafe { dev.alloc::<f32>(m * v)? };
    let func = dev.get_or_load_custom_func("xent_bwd_f32", "dflash_train", TRAIN_PTX)?;
    let v_i = v as i32;
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&lab);
    b.arg(&g);
    b.arg(&dx);
    b.arg(&v_i);
    // SAFETY: argument types match the kernel; sizes checked above.
    unsafe { b.launch(row_cfg(m)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(dx, dev.clone()))
}

/// RMSNorm of rows of `h = w.len()`: `x * rsqrt(mean(x^2) + eps) * w`.
pub fn rms_norm_f32(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    eps: f32,
) -> candle_core::Result<CudaStorage> {
    let h = wl.shape().elem_count();
    if h == 0 || xl.shape().elem_count() % h != 0 {
        candle_core::bail!(
            "dflash-rms-norm: {:?} by weight {:?}",
            xl.shape(),
            wl.shape()
        );
    }
    let dev = xs.device();
    let (x, w) = (
        view_of::<f32>(xs, xl, "input")?,
        view_of::<f32>(ws, wl, "weight")?,
    );
    let rows = rows_of(xl, h);
    // SAFETY: the kernel writes every element.
    let y = unsafe { dev.alloc::<f32>(rows * h)? };
    let func = dev.get_or_load_custom_func("rms_norm_f32", "dflash_train", TRAIN_PTX)?;
    let h_i = h as i32;
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&w);
    b.arg(&y);
    b.arg(&h_i);
    b.arg(&eps);
    // SAFETY: argument types match the kernel; shapes checked above.
    unsafe { b.launch(row_cfg(rows)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(y, dev.clone()))
}

/// The RMSNorm's backward: `[2, rows, h]`, the input's gradient, then the per-row terms
/// `dy * x * rsqrt(mean(x^2) + eps)` of the weight's.
pub fn rms_norm_bwd_f32(
    xs: &CudaStorage,
    xl: &Layout,
    ws: &CudaStorage,
    wl: &Layout,
    gs: &CudaStorage,
    gl: &Layout,
    eps: f32,
) -> candle_core::Result<CudaStorage> {
    let h = wl.shape().elem_count();
    if h == 0 || xl.shape().elem_count() % h != 0 || xl.shape() != gl.shape() {
        candle_core::bail!(
            "dflash-rms-norm-bwd: {:?}, gradient {:?}, weight {:?}",
            xl.shape(),
            gl.shape(),
            wl.shape()
        );
    }
    let dev = xs.device();
    let x = view_of::<f32>(xs, xl, "input")?;
    let w = view_of::<f32>(ws, wl, "weight")?;
    let g = view_of::<f32>(gs, gl, "gradient")?;
    let rows = rows_of(xl, h);
    // SAFETY: the kernel writes every element.
    let out = unsafe { dev.alloc::<f32>(2 * rows * h)? };
    let func = dev.get_or_load_custom_func("rms_norm_bwd_f32", "dflash_train", TRAIN_PTX)?;
    let (h_i, rows_i) = (h as i32, rows as i32);
    let mut b = func.builder();
    b.arg(&x);
    b.arg(&w);
    b.arg(&g);
    b.arg(&out);
    b.arg(&h_i);
    b.arg(&rows_i);
    b.arg(&eps);
    // SAFETY: argument types match the kernel; shapes checked above.
    unsafe { b.launch(row_cfg(rows)) }.w()?;
    Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
}
