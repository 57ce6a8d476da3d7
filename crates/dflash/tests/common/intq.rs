//! Writers of tiny integer-quantized checkpoints in the layouts AutoAWQ (GEMM), GPTQ (v1 and
//! v2 zero points) and compressed-tensors (`pack-quantized`) publish, written from those
//! packers' definitions (AWQ: eight 4-bit outputs a word in the order 0,2,4,6,1,3,5,7; GPTQ:
//! inputs packed along dim 0, zero points along the outputs, v1 storing each zero less one;
//! compressed-tensors: inputs packed along dim 1, each signed value offset by 2^(bits-1)),
//! independent of the engine's loader (source/intq.rs), with the float twin holding exactly
//! the dequantized weights `s * (q - z)`.

use candle_core::{DType, Device, Tensor};
use dflash::testing::{write_json, TinyTarget};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::Path;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Format {
    Awq,
    /// v2: zero points as is; else stored less one (AutoGPTQ's `gptq` format).
    Gptq {
        v2: bool,
        sym: bool,
    },
    PackQuantized,
}

pub struct Scheme {
    pub format: Format,
    pub bits: usize,
    pub group: usize,
}

impl Scheme {
    pub fn new(format: Format, bits: usize, group: usize) -> Self {
        Self {
            format,
            bits,
            group,
        }
    }

    fn symmetric(&self) -> bool {
        match self.format {
            Format::Awq => false,
            Format::Gptq { sym, .. } => sym,
            Format::PackQuantized => true,
        }
    }

    fn scale_dtype(&self) -> DType {
        match self.format {
            Format::PackQuantized => DType::BF16,
            _ => DType::F16,
        }
    }

    pub fn config_entry(&self) -> Value {
        match self.format {
            Format::Awq => {
                json!({"quant_method": "awq", "bits": self.bits, "group_size": self.group,
                "version": "gemm", "zero_point": true, "modules_to_not_convert": null})
            }
            Format::Gptq { v2, sym } => json!({"quant_method": "gptq", "bits": self.bits,
                "group_size": self.group, "desc_act": false, "sym": sym,
                "checkpoint_format": if v2 { "gptq_v2" } else { "gptq" }}),
            Format::PackQuantized => json!({"quant_method": "compressed-tensors",
                "format": "pack-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": null,
                    "output_activations": null, "weights": {"num_bits": self.bits, "type": "int",
                    "symmetric": true, "strategy": "group", "group_size": self.group,
                    "dynamic": false, "observer": "minmax"}}}}),
        }
    }
}

fn round_to(v: f32, dt: DType) -> f32 {
    match dt {
        DType::F16 => half::f16::from_f32(v).to_f32(),
        DType::BF16 => half::bf16::from_f32(v).to_f32(),
        _ => v,
    }
}

/// `w [out, inp]` quantized per group of `group` inputs: unsigned codes `q [out, inp]`, zero
/// points `z [out, groups]`, scales `s [out, groups]` (already rounded to the stored dtype);
/// the weights are `s * (q - z)`.
fn quantize(w: &[f32], out: usize, inp: usize, sc: &Scheme) -> (Vec<u32>, Vec<u32>, Vec<f32>) {
    let groups = inp / sc.group;
    let top = (1u32 << sc.bits) - 1;
    let (mut q, mut z, mut s) = (
        vec![0; out * inp],
        vec![0; out * groups],
        vec![0.0; out * groups],
    );
    for n in 0..out {
        for g in 0..groups {
            let vals = &w[n * inp + g * sc.group..n * inp + (g + 1) * sc.group];
            let (lo, hi) = vals
                .iter()
                .fold((0f32, 0f32), |(a, b), &x| (a.min(x), b.max(x)));
            let (scale, zero) = if sc.symmetric() {
                let half = (1u32 << (sc.bits - 1)) as f32;
                (
                    round_to((lo.abs().max(hi.abs()) / half).max(1e-4), sc.scale_dtype()),
                    half as u32,
                )
            } else {
                let scale = round_to(((hi - lo) / top as f32).max(1e-4), sc.scale_dtype());
                // the v1 format cannot store a zero point of 0
                let least = matches!(sc.format, Format::Gptq { v2: false, .. }) as u32;
                (scale, ((-lo / scale).round() as u32).clamp(least, top))
            };
            s[n * groups + g] = scale;
            z[n * groups + g] = zero;
            for (i, &x) in vals.iter().enumerate() {
                let v = ((x / scale).round() + zero as f32).clamp(0.0, top as f32);
                q[n * inp + g * sc.group + i] = v as u32;
            }
        }
    }
    (q, z, s)
}

fn i32s(words: Vec<u32>, shape: &[usize]) -> Tensor {
    let v: Vec<i32> = words.into_iter().map(|w| w as i32).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

/// Pack `vals[i]` (each `< 2^bits`) `32 / bits` to a word, the first in the low bits.
fn pack_seq(vals: impl Iterator<Item = u32>, bits: usize) -> Vec<u32> {
    let per = 32 / bits;
    let v: Vec<u32> = vals.collect();
    v.chunks(per)
        .map(|c| {
            c.iter()
                .enumerate()
                .fold(0u32, |w, (j, &x)| w | x << (bits * j))
        })
        .collect()
}

/// The stored tensors of one quantized matrix `module` in the scheme's layout.
fn store(
    module: &str,
    q: &[u32],
    z: &[u32],
    s: &[f32],
    out: usize,
    inp: usize,
    sc: &Scheme,
) -> Vec<(String, Tensor)> {
    let (bits, groups) = (sc.bits, inp / sc.group);
    let per = 32 / bits;
    let scales_t = |transposed: bool| {
        let v: Vec<f32> = if transposed {
            (0..groups * out)
                .map(|i| s[(i % out) * groups + i / out])
                .collect()
        } else {
            s.to_vec()
        };
        let shape = if transposed {
            [groups, out]
        } else {
            [out, groups]
        };
        Tensor::from_vec(v, &shape, &Device::Cpu)
            .unwrap()
            .to_dtype(sc.scale_dtype())
            .unwrap()
    };
    match sc.format {
        Format::Awq => {
            const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
            let pack_awq = |rows: usize, at: &dyn Fn(usize, usize) -> u32| -> Vec<u32> {
                let mut words = vec![];
                for r in 0..rows {
                    for c in 0..out / 8 {
                        words
                            .push((0..8).fold(0u32, |w, i| w | at(r, 8 * c + ORDER[i]) << (4 * i)));
                    }
                }
                words
            };
            vec![
                (
                    format!("{module}.qweight"),
                    i32s(pack_awq(inp, &|k, n| q[n * inp + k]), &[inp, out / 8]),
                ),
                (
                    format!("{module}.qzeros"),
                    i32s(
                        pack_awq(groups, &|g, n| z[n * groups + g]),
                        &[groups, out / 8],
                    ),
                ),
                (format!("{module}.scales"), scales_t(true)),
            ]
        }
        Format::Gptq { v2, .. } => {
            let off = if v2 { 0 } else { 1 };
            let mut qw = vec![0u32; inp / per * out];
            for n in 0..out {
                for (w, word) in pack_seq((0..inp).map(|k| q[n * inp + k]), bits)
                    .into_iter()
                    .enumerate()
                {
                    qw[w * out + n] = word;
                }
            }
            let zeros: Vec<u32> = (0..groups)
                .flat_map(|g| pack_seq((0..out).map(|n| z[n * groups + g] - off), bits).into_iter())
                .collect();
            let g_idx: Vec<i32> = (0..inp).map(|k| (k / sc.group) as i32).collect();
            vec![
                (format!("{module}.qweight"), i32s(qw, &[inp / per, out])),
                (
                    format!("{module}.qzeros"),
                    i32s(zeros, &[groups, out / per]),
                ),
                (format!("{module}.scales"), scales_t(true)),
                (
                    format!("{module}.g_idx"),
                    Tensor::from_vec(g_idx, inp, &Device::Cpu).unwrap(),
                ),
            ]
        }
        Format::PackQuantized => {
            // q is already the signed value plus 2^(bits-1) (z = 2^(bits-1))
            let packed = pack_seq(q.iter().copied(), bits);
            vec![
                (
                    format!("{module}.weight_packed"),
                    i32s(packed, &[out, inp / per]),
                ),
                (format!("{module}.weight_scale"), scales_t(false)),
                (
                    format!("{module}.weight_shape"),
                    Tensor::from_vec(vec![out as i64, inp as i64], 2, &Device::Cpu).unwrap(),
                ),
            ]
        }
    }
}

/// What the published checkpoints quantize: the 2-D `.weight`s but the embedding, the LM head
/// and the MoE routers (`mlp.gate`).
pub fn published_choice(name: &str, w: &Tensor) -> bool {
    w.rank() == 2
        && name.ends_with(".weight")
        && !name.contains("embed_tokens")
        && !name.contains("lm_head")
        && !name.ends_with("mlp.gate.weight")
}

/// Write `t` integer-quantized in `sc`'s layout into `dir` ([`published_choice`]) and, into
/// `twin`, the float checkpoint holding exactly the dequantized weights in f32. Returns the
/// number of quantized matrices.
pub fn write_int(t: &TinyTarget, sc: &Scheme, dir: &Path, twin: &Path) -> usize {
    t.write(twin).unwrap();
    quantize_dir(twin, sc, &published_choice, false, dir, twin)
}

/// The checkpoint in `src` (`model.safetensors`, `config.json`) with the tensors `choose`
/// picks integer-quantized in `sc`'s layout into `dir`, its config's `quantization_config`
/// set (under `text_config` when `in_text_config`), and into `twin` the float checkpoint
/// holding exactly the dequantized weights in f32 (`twin` may be `src`). Returns the number
/// of quantized matrices.
pub fn quantize_dir(
    src: &Path,
    sc: &Scheme,
    choose: &dyn Fn(&str, &Tensor) -> bool,
    in_text_config: bool,
    dir: &Path,
    twin: &Path,
) -> usize {
    let float =
        candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let (mut qt, mut deq): (HashMap<String, Tensor>, HashMap<String, Tensor>) = Default::default();
    let mut n = 0;
    for (name, w) in float {
        if !choose(&name, &w) {
            qt.insert(name.clone(), w.clone());
            deq.insert(name, w);
            continue;
        }
        let module = name.strip_suffix(".weight").unwrap();
        let (out, inp) = w.dims2().unwrap();
        let vals: Vec<f32> = w
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let (q, z, s) = quantize(&vals, out, inp, sc);
        let groups = inp / sc.group;
        let d: Vec<f32> = (0..out * inp)
            .map(|i| {
                let (r, k) = (i / inp, i % inp);
                let g = r * groups + k / sc.group;
                s[g] * (q[i] as f32 - z[g] as f32)
            })
            .collect();
        deq.insert(
            name.clone(),
            Tensor::from_vec(d, (out, inp), &Device::Cpu).unwrap(),
        );
        qt.extend(store(module, &q, &z, &s, out, inp, sc));
        n += 1;
    }
    for d in [dir, twin] {
        std::fs::create_dir_all(d).unwrap();
    }
    candle_core::safetensors::save(&qt, dir.join("model.safetensors")).unwrap();
    candle_core::safetensors::save(&deq, twin.join("model.safetensors")).unwrap();
    write_json(&twin.join("config.json"), &cfg).unwrap();
    if in_text_config {
        cfg["text_config"]["quantization_config"] = sc.config_entry();
    } else {
        cfg["quantization_config"] = sc.config_entry();
    }
    write_json(&dir.join("config.json"), &cfg).unwrap();
    n
}
