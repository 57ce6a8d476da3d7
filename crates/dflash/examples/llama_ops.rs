//! Issue 27 debugging aid (docs/perf.md, session 51): llama.cpp's own tensors, dumped for one
//! prompt by `tools/llama-cpp-fixtures/dump_tensors.cpp` (prefill, then one-token steps), set
//! beside dflash's.
//!
//! `llama_ops FILE.gguf DIR [STEP]` (SmolLM2-135M's llama graph: 30 layers, 9 x 64 query
//! heads, 3 KV heads, eps 1e-5, rope base 1e5): op by op, llama.cpp's inputs through dflash's
//! CPU ops (RMSNorm, the int8 products as stored, SwiGLU) and through bit-exact models of
//! llama.cpp b11434's x86 arithmetic (`[emu]`: RMSNorm, the Q4_1 product, rope, attention,
//! SwiGLU), each compared bit for bit with llama.cpp's output.
//!
//! `llama_ops FILE.gguf DIR --logits PROMPT_IDS LLAMA_IDS` (comma-separated): dflash's layer
//! outputs over the prompt against llama.cpp's `l_out-N`, then dflash's logits at each step on
//! llama.cpp's own tokens against llama.cpp's.
//!
//! `llama_ops FILE.gguf DIR --proj 'INPUT-{l}:OP' 'OUTPUT-{l}' 'blk.{l}.NAME.weight'`: one
//! product of every layer ([`QMatrix`] kinds), llama.cpp's input in, per step (any model).
use candle_core::quantized::gguf_file;
use candle_core::{Device, Tensor};
use dflash::nn::cpu_ops;
use dflash::nn::mlp::Activation;
use dflash::nn::q8::QMatrix;
use std::collections::HashMap;

type R<T> = std::result::Result<T, Box<dyn std::error::Error>>;

struct Dump {
    dir: String,
    // (step, name, op) -> (seq, dims)
    at: HashMap<(usize, String, String), (usize, Vec<usize>)>,
    prompt_len: usize,
}

impl Dump {
    fn get(&self, step: usize, name: &str, op: &str) -> Option<(Vec<f32>, Vec<usize>)> {
        let (seq, dims) = self.at.get(&(step, name.to_string(), op.to_string()))?;
        let b = std::fs::read(format!("{}/{seq:05}.bin", self.dir)).ok()?;
        let v = b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        Some((v, dims.clone()))
    }
}

/// ggml's `rms_norm_f32` fused with the weight's MUL (b11434): `x * x` summed in f64, the
/// mean and `1 / sqrt` in f32, `x * scale * w`.
fn llama_rms(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let n = w.len();
    let mut out = vec![0f32; x.len()];
    for (xr, o) in x.chunks_exact(n).zip(out.chunks_exact_mut(n)) {
        let sum: f64 = xr.iter().map(|&v| (v * v) as f64).sum();
        let mean = (sum / n as f64) as f32;
        let scale = 1.0f32 / (mean + eps).sqrt();
        for ((o, &v), &a) in o.iter_mut().zip(xr).zip(w) {
            *o = v * scale * a;
        }
    }
    out
}

/// llama.cpp's x86 Q4_1 product (b11434, `quantize_row_q8_1` with AVX2 then
/// `ggml_vec_dot_q4_1_q8_1` with AVX2): per block 8 lanes of 4 products each, `acc_l =
/// fma(d_w * d_x, lane_l, acc_l)`, `summs += m * s`; `hsum(acc) + summs`. `fma_m`: whether the
/// compiler fused `summs += m * s`.
fn llama_q4_1(raw: &[u8], rows: usize, cols: usize, x: &[f32], fma_m: bool) -> Vec<f32> {
    use half::f16;
    let nb = cols / 32;
    let m = x.len() / cols;
    // activations: Q8_1 by the x86 rule
    let mut xq = vec![0i8; x.len()];
    let (mut xd, mut xs) = (vec![0f32; m * nb], vec![0f32; m * nb]);
    for b in 0..m * nb {
        let v = &x[b * 32..][..32];
        let amax = v.iter().fold(0f32, |a, x| a.max(x.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for i in 0..32 {
            let q = (v[i] * id).round_ties_even() as i8;
            xq[b * 32 + i] = q;
            sum += q as i32;
        }
        xd[b] = f16::from_f32(d).to_f32();
        xs[b] = f16::from_f32(d * sum as f32).to_f32();
    }
    let mut out = vec![0f32; m * rows];
    for r in 0..m {
        for j in 0..rows {
            let mut acc = [0f32; 8];
            let mut summs = 0f32;
            for b in 0..nb {
                let blk = &raw[(j * nb + b) * 20..][..20];
                let d0 = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
                let m0 = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                let xb = r * nb + b;
                summs = if fma_m {
                    m0.mul_add(xs[xb], summs)
                } else {
                    summs + m0 * xs[xb]
                };
                let dd = d0 * xd[xb];
                for (l, a) in acc.iter_mut().enumerate() {
                    let mut lane = 0i32;
                    for u in 0..4 {
                        let e = 4 * l + u; // element e of the block
                        let wq = if e < 16 {
                            blk[4 + e] & 15
                        } else {
                            blk[4 + e - 16] >> 4
                        };
                        lane += wq as i32 * xq[xb * 32 + e] as i32;
                    }
                    *a = dd.mul_add(lane as f32, *a);
                }
            }
            let h = |i: usize| acc[i] + acc[i + 4];
            let (t0, t1) = (h(0) + h(2), h(1) + h(3));
            out[r * rows + j] = (t0 + t1) + summs;
        }
    }
    out
}

/// ggml's AVX-512 `ggml_v_expf` (b11434, vec.h), one lane.
fn ggml_expf(x: f32) -> f32 {
    let r = f32::from_bits(0x4B40_0000); // 0x1.8p23
    let z = x.mul_add(f32::from_bits(0x3FB8_AA3B), r); // 0x1.715476p+0
    let n = z - r;
    let b = (-n).mul_add(
        f32::from_bits(0x35BF_BE8E),
        (-n).mul_add(f32::from_bits(0x3F31_7200), x),
    );
    let u = b * b;
    let c = |bits: u32| f32::from_bits(bits);
    // 0x1.0e4020p-7, 0x1.573e2ep-5, 0x1.555e66p-3, 0x1.fffdb6p-2, 0x1.ffffecp-1
    let j = c(0x3C07_2010)
        .mul_add(b, c(0x3D2B_9F17))
        .mul_add(u, c(0x3E2A_AF33).mul_add(b, c(0x3EFF_FEDB)))
        .mul_add(u, c(0x3F7F_FFF6).mul_add(b, 1.0));
    if n.abs() > 192.0 {
        return if n <= 0.0 { 0.0 } else { f32::INFINITY };
    }
    // _mm512_scalef_ps(j, n): j * 2^floor(n) (n is whole here)
    (j as f64 * (n as f64).exp2()) as f32
}

/// ggml's rope (normal mode, b11434) of one 64-wide head at position `p`: `theta *= scale` per
/// pair, `cosf` / `sinf`; `variant` picks how the compiler contracted the rotation.
fn ggml_rope(x: &[f32], p: usize, base: f32, variant: u8) -> Vec<f32> {
    let n = x.len();
    let theta_scale = base.powf(-2.0 / n as f32);
    let mut theta = p as f32;
    let mut out = vec![0f32; n];
    for i in (0..n).step_by(2) {
        let (c, s) = (theta.cos(), theta.sin());
        let (x0, x1) = (x[i], x[i + 1]);
        (out[i], out[i + 1]) = match variant {
            0 => (x0 * c - x1 * s, x0 * s + x1 * c),
            1 => (x0.mul_add(c, -(x1 * s)), x0.mul_add(s, x1 * c)),
            _ => ((-x1).mul_add(s, x0 * c), x1.mul_add(c, x0 * s)),
        };
        theta *= theta_scale;
    }
    out
}

/// `_mm512_reduce_add_ps` as GCC writes it: halves, quarters, then pairs.
fn reduce16(a: &[f32; 16]) -> f32 {
    let t3: Vec<f32> = (0..8).map(|i| a[i] + a[i + 8]).collect();
    let t6: Vec<f32> = (0..4).map(|i| t3[i] + t3[i + 4]).collect();
    (t6[0] + t6[2]) + (t6[1] + t6[3])
}

/// ggml's AVX-512 `ggml_vec_dot_f32`: 4 accumulators of 16 lanes per 64, folded 0+2, 1+3,
/// 0+1, then reduced (n a multiple of 64 here).
fn vdot(x: &[f32], y: &[f32]) -> f32 {
    let mut acc = [[0f32; 16]; 4];
    for i in (0..x.len()).step_by(64) {
        for (j, a) in acc.iter_mut().enumerate() {
            for l in 0..16 {
                a[l] = x[i + 16 * j + l].mul_add(y[i + 16 * j + l], a[l]);
            }
        }
    }
    let mut r = [0f32; 16];
    for l in 0..16 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    reduce16(&r)
}

/// llamafile's tinyBLAS f32 (AVX-512) dot: one 16-lane accumulator, then reduced.
fn tdot(x: &[f32], y: &[f32]) -> f32 {
    let mut a = [0f32; 16];
    for i in (0..x.len()).step_by(16) {
        for l in 0..16 {
            a[l] = x[i + l].mul_add(y[i + l], a[l]);
        }
    }
    reduce16(&a)
}

/// llama.cpp's attention without flash attention (f32 KV cache padded to `n_kv`), one row:
/// `q [heads][64]` at position `pos` against keys / values of positions `0..=pos`.
fn llama_attention(
    q: &[f32],
    k: &[Vec<f32>],
    v: &[Vec<f32>],
    pos: usize,
    n_kv: usize,
    prefill: bool,
) -> Vec<f32> {
    let (heads, kvh, hd) = (q.len() / 64, k[0].len() / 64, 64);
    let rep = heads / kvh;
    let mut out = vec![0f32; q.len()];
    for h in 0..heads {
        let g = h / rep;
        let qh = &q[h * hd..][..hd];
        let mut wp = vec![f32::NEG_INFINITY; n_kv];
        for j in 0..=pos {
            wp[j] = vdot(&k[j][g * hd..][..hd], qh) * 0.125;
        }
        let max = wp.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
        let mut sum = 0f64;
        let mut e = vec![0f32; n_kv];
        for c in 0..n_kv / 16 {
            let mut ch = [0f32; 16];
            for l in 0..16 {
                ch[l] = ggml_expf(wp[16 * c + l] - max);
                e[16 * c + l] = ch[l];
            }
            sum += reduce16(&ch) as f64;
        }
        let inv = (1.0 / sum) as f32;
        let p: Vec<f32> = e.iter().map(|x| x * inv).collect();
        for c in 0..hd {
            let vc: Vec<f32> = (0..n_kv)
                .map(|j| if j < v.len() { v[j][g * hd + c] } else { 0.0 })
                .collect();
            out[h * hd + c] = if prefill {
                tdot(&vc, &p)
            } else {
                vdot(&vc, &p)
            };
        }
    }
    out
}

fn report(label: &str, ours: &[f32], theirs: &[f32]) -> usize {
    assert_eq!(ours.len(), theirs.len(), "{label}");
    let (mut n, mut max) = (0usize, 0f32);
    for (a, b) in ours.iter().zip(theirs) {
        if a.to_bits() != b.to_bits() {
            n += 1;
            max = max.max((a - b).abs());
        }
    }
    println!(
        "{label:<28} {n:>6} of {:>6} differ, max |diff| {max:.3e}",
        ours.len()
    );
    n
}

fn top2(l: &[f32]) -> (usize, f32) {
    let mut v: Vec<(f32, usize)> = l.iter().copied().zip(0..).collect();
    v.sort_by(|a, b| b.0.total_cmp(&a.0));
    (v[0].1, v[0].0 - v[1].0)
}

fn logits(path: &str, d: &Dump, prompt: &[u32], theirs: &[u32]) -> R<()> {
    use dflash::archs::{load_target, LoadOptions, Logits};
    use dflash::source::ModelSource;
    let opts = LoadOptions {
        keep_quant: true,
        ..Default::default()
    };
    let (_, m) = load_target(
        &ModelSource::from_gguf("cli", std::path::Path::new(path)),
        &opts,
    )?;
    {
        // each layer's output over the prompt (our taps) against llama.cpp's l_out rows
        let layers = m.info().num_layers;
        let all: Vec<usize> = (0..layers).collect();
        let mut c = m.new_cache(prompt.len() + 1)?;
        let taps = m
            .forward(prompt, 0, &mut c, &all, Logits::Last)?
            .taps
            .expect("taps");
        let h = taps.dim(1)? / layers;
        for l in 0..layers {
            let t: Vec<f32> = taps
                .narrow(1, l * h, h)?
                .to_dtype(candle_core::DType::F32)?
                .flatten_all()?
                .to_vec1()?;
            let Some((lv, _)) = d.get(0, &format!("l_out-{l}"), "ADD") else {
                break;
            };
            if lv.len() != t.len() {
                println!("l_out-{l}: {} values vs our {}", lv.len(), t.len());
                continue;
            }
            let rows: Vec<usize> = (0..t.len() / h)
                .filter(|&r| (0..h).any(|i| t[r * h + i].to_bits() != lv[r * h + i].to_bits()))
                .collect();
            let max = t
                .iter()
                .zip(&lv)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            println!("l_out-{l}: rows differing {rows:?}, max |diff| {max:.3e}");
        }
    }
    let mut c = m.new_cache(prompt.len() + theirs.len() + 1)?;
    let mut toks = prompt.to_vec();
    let mut pos = 0;
    let mut all = vec![];
    for (s, &next) in theirs.iter().enumerate() {
        let l = m
            .forward(&toks[pos..], pos, &mut c, &[], Logits::Last)?
            .logits
            .unwrap();
        let ours: Vec<f32> = l.flatten_all()?.to_vec1()?;
        let (lv, _) = d.get(s, "result_output", "MUL_MAT").expect("result_output");
        let n = ours.len();
        let lv = &lv[lv.len() - n..];
        let max = ours
            .iter()
            .zip(lv)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let mean = ours
            .iter()
            .zip(lv)
            .map(|(a, b)| (a - b).abs() as f64)
            .sum::<f64>()
            / n as f64;
        let (ob, og) = top2(&ours);
        let (tb, tg) = top2(lv);
        println!("step {s:>2}: max |ours - llama.cpp| {max:.4}, mean {mean:.4}; top-2 gap ours {og:.4} (id {ob}), llama.cpp {tg:.4} (id {tb}){}", if ob != tb { "  <- differ" } else { "" });
        all.push(max);
        pos = toks.len();
        toks.push(next);
    }
    all.sort_by(f32::total_cmp);
    println!(
        "max |diff| per step: median {:.4}, largest {:.4}",
        all[all.len() / 2],
        all[all.len() - 1]
    );
    Ok(())
}

fn main() -> R<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut f = std::fs::File::open(&args[0])?;
    let g = gguf_file::Content::read(&mut f)?;
    let dir = args[1].clone();
    let only: Option<usize> = args.get(2).and_then(|s| s.parse().ok());
    let mut at = HashMap::new();
    for l in std::fs::read_to_string(format!("{dir}/index.txt"))?.lines() {
        let p: Vec<&str> = l.split(' ').collect();
        // names may hold spaces ("Kcur-0 (view)"): the op is the token before four sizes
        let Some(i) = (3..p.len().saturating_sub(6))
            .find(|&i| p[i + 1..i + 5].iter().all(|x| x.parse::<usize>().is_ok()))
        else {
            continue;
        };
        let dims: Vec<usize> = p[i + 1..i + 5].iter().map(|s| s.parse().unwrap()).collect();
        at.entry((p[1].parse().unwrap(), p[2..i].join(" "), p[i].to_string()))
            .or_insert((p[0].parse().unwrap(), dims));
    }
    let prompt_len = at
        .get(&(0, "embd".to_string(), "GET_ROWS".to_string()))
        .map_or(0, |x| x.1[1]);
    let d = Dump {
        dir,
        at,
        prompt_len,
    };
    if let Some(i) = args.iter().position(|a| a == "--proj") {
        // one product per layer and step: `--proj INPUT:OP OUTPUT WEIGHT` with `{l}` for the layer
        let (inp, out, wn) = (&args[i + 1], &args[i + 2], &args[i + 3]);
        let (iname, iop) = inp.split_once(':').unwrap();
        let mut f = std::fs::File::open(&args[0])?;
        let g = gguf_file::Content::read(&mut f)?;
        for s in 0..64 {
            let (mut n, mut of) = (0, 0);
            for l in 0..64 {
                let sub = |x: &str| x.replace("{l}", &l.to_string());
                let (Some((x, dims)), Some((y, _))) =
                    (d.get(s, &sub(iname), iop), d.get(s, &sub(out), "MUL_MAT"))
                else {
                    continue;
                };
                let Ok(q) = g.tensor(&mut f, &sub(wn), &Device::Cpu) else {
                    continue;
                };
                let Some(m) = QMatrix::from_qtensor(&q)? else {
                    continue;
                };
                let ours: Vec<f32> = m
                    .forward(&Tensor::from_vec(
                        x.clone(),
                        (x.len() / dims[0], dims[0]),
                        &Device::Cpu,
                    )?)?
                    .flatten_all()?
                    .to_vec1()?;
                if ours.len() != y.len() {
                    continue;
                }
                n += ours
                    .iter()
                    .zip(&y)
                    .filter(|(a, b)| a.to_bits() != b.to_bits())
                    .count();
                of += ours.len();
            }
            if of > 0 {
                println!("step {s}: {n} of {of} differ");
            }
        }
        return Ok(());
    }
    if let Some(i) = args.iter().position(|a| a == "--logits") {
        // our logits on the prompt then llama.cpp's own tokens, beside llama.cpp's
        let ids = |s: &str| -> Vec<u32> { s.split(',').map(|x| x.parse().unwrap()).collect() };
        let (prompt, theirs) = (ids(&args[i + 1]), ids(&args[i + 2]));
        return logits(&args[0], &d, &prompt, &theirs);
    }
    let dev = Device::Cpu;
    let eps = 1e-5f32;
    let layers = 30;
    let steps: Vec<usize> = match only {
        Some(s) => vec![s],
        None => (0..64)
            .filter(|s| d.at.contains_key(&(*s, "l_out-0".into(), "ADD".into())))
            .collect(),
    };
    let mut tensors: HashMap<String, QMatrix> = HashMap::new();
    let mut qm = |name: &str| -> R<QMatrix> {
        if let Some(m) = tensors.get(name) {
            return Ok(m.clone());
        }
        let q = g.tensor(&mut f, name, &dev)?;
        let m = QMatrix::from_qtensor(&q)?.expect("a QMatrix kind");
        tensors.insert(name.to_string(), m.clone());
        Ok(m)
    };
    let mut fw = std::fs::File::open(&args[0])?;
    let mut vecw = |name: &str| -> R<Tensor> {
        let q = g.tensor(&mut fw, name, &dev)?;
        Ok(q.dequantize(&dev)?)
    };
    let mut fr = std::fs::File::open(&args[0])?;
    let g2 = gguf_file::Content::read(&mut fr)?;
    let mut raw =
        |name: &str| -> R<candle_core::quantized::QTensor> { Ok(g2.tensor(&mut fr, name, &dev)?) };
    let mut totals: HashMap<&str, (usize, usize)> = HashMap::new();
    for &s in &steps {
        println!("== step {s}");
        for l in 0..layers {
            let t = |n: &str, op: &str| d.get(s, &format!("{n}-{l}"), op);
            let mut check = |label: &'static str, ours: Vec<f32>, theirs: &[f32]| {
                let n = if l < 2 || only.is_some() {
                    report(&format!("L{l} {label}"), &ours, theirs)
                } else {
                    ours.iter()
                        .zip(theirs)
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count()
                };
                let e = totals.entry(label).or_default();
                e.0 += n;
                e.1 += ours.len();
            };
            let inp = if l == 0 {
                d.get(s, "embd", "GET_ROWS")
            } else {
                d.get(s, &format!("l_out-{}", l - 1), "ADD")
            };
            let Some((x, dims)) = inp else { break };
            let rows = x.len() / dims[0];
            let tx = Tensor::from_vec(x, (rows, dims[0]), &dev)?;
            let w = vecw(&format!("blk.{l}.attn_norm.weight"))?;
            let ours = cpu_ops::rms_norm(&tx, &w, eps)?.unwrap();
            let (an, _) = t("attn_norm", "MUL").unwrap();
            check("attn rms_norm * w", ours.flatten_all()?.to_vec1()?, &an);
            let wv: Vec<f32> = w.to_vec1()?;
            let emu = llama_rms(&tx.flatten_all()?.to_vec1()?, &wv, eps);
            check("[emu] attn rms_norm", emu, &an);
            let an_t = Tensor::from_vec(an, (rows, dims[0]), &dev)?;
            if let (Some((qm_, _)), Some((qr, _))) = (t("Qcur", "MUL_MAT"), t("Qcur", "ROPE")) {
                let n = qm_.len() / 576;
                for variant in 0..3u8 {
                    let mut emu = vec![];
                    for r in 0..n {
                        let p = if s == 0 { r } else { d.prompt_len + s - 1 };
                        for h in 0..9 {
                            emu.extend(ggml_rope(
                                &qm_[r * 576 + h * 64..][..64],
                                p,
                                100000.0,
                                variant,
                            ));
                        }
                    }
                    check(
                        [
                            "[emu] rope q, plain",
                            "[emu] rope q, fma a",
                            "[emu] rope q, fma b",
                        ][variant as usize],
                        emu,
                        &qr,
                    );
                }
            }
            for (wn, on) in [("attn_q", "Qcur"), ("attn_k", "Kcur"), ("attn_v", "Vcur")] {
                let m = qm(&format!("blk.{l}.{wn}.weight"))?;
                let ours = m.forward(&an_t)?;
                let (th, _) = t(on, "MUL_MAT").unwrap();
                check(
                    match wn {
                        "attn_q" => "q proj",
                        "attn_k" => "k proj",
                        _ => "v proj",
                    },
                    ours.flatten_all()?.to_vec1()?,
                    &th,
                );
                let q = raw(&format!("blk.{l}.{wn}.weight"))?;
                let (rows, cols) = q.shape().dims2()?;
                let xin: Vec<f32> = an_t.flatten_all()?.to_vec1()?;
                let data = q.data()?;
                check(
                    "[emu] proj, fma m",
                    llama_q4_1(&data, rows, cols, &xin, true),
                    &th,
                );
                check(
                    "[emu] proj, mul+add m",
                    llama_q4_1(&data, rows, cols, &xin, false),
                    &th,
                );
            }
            // the last layer runs its output rows only (llama.cpp's inp_out_ids)
            let Some((kqv, kd)) = t("kqv_out", "CONT") else {
                continue;
            };
            {
                // keys and values of every position so far, from llama.cpp's own rows
                let (mut ks, mut vs) = (vec![], vec![]);
                for st in 0..=s {
                    let (kr, _) = d.get(st, &format!("Kcur-{l}"), "ROPE").unwrap();
                    let (vr, _) = d.get(st, &format!("Vcur-{l}"), "MUL_MAT").unwrap();
                    ks.extend(kr.chunks(192).map(|c| c.to_vec()));
                    vs.extend(vr.chunks(192).map(|c| c.to_vec()));
                }
                let (qr, _) = t("Qcur", "ROPE").unwrap();
                let n = qr.len() / 576;
                let n_kv =
                    d.at.get(&(s, format!("kq-{l}"), "MUL_MAT".to_string()))
                        .unwrap()
                        .1[0];
                let mut emu = vec![];
                for r in 0..n {
                    let pos = if s == 0 { r } else { d.prompt_len + s - 1 };
                    emu.extend(llama_attention(
                        &qr[r * 576..][..576],
                        &ks,
                        &vs,
                        pos,
                        n_kv,
                        n > 1,
                    ));
                }
                check("[emu] attention", emu, &kqv);
            }
            let kr = kqv.len() / kd[0];
            let kqv_t = Tensor::from_vec(kqv, (kr, kd[0]), &dev)?;
            let (ao, _) = t("attn_out", "MUL_MAT").unwrap();
            let ours = qm(&format!("blk.{l}.attn_output.weight"))?.forward(&kqv_t)?;
            check("o proj", ours.flatten_all()?.to_vec1()?, &ao);
            let (fi, fd) = t("ffn_inp", "ADD").unwrap();
            let fr = fi.len() / fd[0];
            let fi_t = Tensor::from_vec(fi, (fr, fd[0]), &dev)?;
            let w = vecw(&format!("blk.{l}.ffn_norm.weight"))?;
            let ours = cpu_ops::rms_norm(&fi_t, &w, eps)?.unwrap();
            let (fnm, _) = t("ffn_norm", "MUL").unwrap();
            check("ffn rms_norm * w", ours.flatten_all()?.to_vec1()?, &fnm);
            let fn_t = Tensor::from_vec(fnm, (fr, fd[0]), &dev)?;
            let (gate, gd) = t("ffn_gate", "MUL_MAT").unwrap();
            let ours = qm(&format!("blk.{l}.ffn_gate.weight"))?.forward(&fn_t)?;
            check("gate proj", ours.flatten_all()?.to_vec1()?, &gate);
            let (up, _) = t("ffn_up", "MUL_MAT").unwrap();
            let ours = qm(&format!("blk.{l}.ffn_up.weight"))?.forward(&fn_t)?;
            check("up proj", ours.flatten_all()?.to_vec1()?, &up);
            let i = gd[0];
            let gu: Vec<f32> = (0..fr)
                .flat_map(|r| {
                    gate[r * i..(r + 1) * i]
                        .iter()
                        .chain(&up[r * i..(r + 1) * i])
                        .copied()
                        .collect::<Vec<_>>()
                })
                .collect();
            let gu_t = Tensor::from_vec(gu, (fr, 2 * i), &dev)?;
            let ours = cpu_ops::gated(&gu_t, Activation::Silu)?.unwrap();
            let (sw, _) = t("ffn_swiglu", "SWIGLU").unwrap();
            check("swiglu", ours.flatten_all()?.to_vec1()?, &sw);
            let emu: Vec<f32> = gate
                .iter()
                .zip(&up)
                .map(|(&g, &u)| g / (1.0 + ggml_expf(0.0 - g)) * u)
                .collect();
            check("[emu] swiglu", emu, &sw);
            let sw_t = Tensor::from_vec(sw, (fr, i), &dev)?;
            let ours = qm(&format!("blk.{l}.ffn_down.weight"))?.forward(&sw_t)?;
            let (dn, _) = t("ffn_out", "MUL_MAT").unwrap();
            check("down proj", ours.flatten_all()?.to_vec1()?, &dn);
        }
    }
    let mut v: Vec<_> = totals.into_iter().collect();
    v.sort();
    println!("== all steps and layers");
    for (k, (n, of)) in v {
        println!(
            "{k:<20} {n:>8} of {of:>9} differ ({:.3}%)",
            100.0 * n as f64 / of as f64
        );
    }
    Ok(())
}
