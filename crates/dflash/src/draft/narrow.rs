//! A narrow draft vocabulary: the draft proposes only the K target tokens most frequent in
//! training sequences, through a head of its own (`lm_head.weight [K, hidden]`: the target
//! head's rows of those tokens) and the `d2t` map of the speculators / EAGLE-3 format (draft
//! index i is target id `i + d2t[i]`, ascending), which [`super::DraftModel`] already reads.
//! FR-Spec (Zhao et al., 2025) measured the idea on EAGLE-2 drafts; here it is applied to a
//! trained DFlash draft as is (its body untouched). The target's verify keeps the output
//! exactly the target's; what changes is the draft head's cost (on the CPU demo half of a
//! 16-row proposal) against the tokens it can no longer propose.

use crate::source::ModelSource;
use crate::train::data::Sequence;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::Path;

/// How often each target id occurs in the sequences' responses (ids past `vocab` are not
/// counted), and the tokens counted.
pub fn response_counts(seqs: &[Sequence], vocab: usize) -> (Vec<u64>, u64) {
    let mut count = vec![0u64; vocab];
    let mut n = 0;
    for s in seqs {
        for &t in s.ids.get(s.response_start..).unwrap_or(&[]) {
            if let Some(c) = count.get_mut(t as usize) {
                *c += 1;
                n += 1;
            }
        }
    }
    (count, n)
}

/// The `k` most frequent ids (ties to the lower id), ascending.
pub fn most_frequent(counts: &[u64], k: usize) -> Vec<u32> {
    let mut order: Vec<u32> = (0..counts.len() as u32).collect();
    order.sort_by(|&x, &y| counts[y as usize].cmp(&counts[x as usize]).then(x.cmp(&y)));
    let mut ids = order[..k.min(order.len())].to_vec();
    ids.sort_unstable();
    ids
}

/// [`narrow_checkpoint`] over the `k` ids most frequent in `counts` (of
/// [`response_counts`]); returns the share of the counted tokens they cover.
pub fn narrow_to_frequent(
    draft: &Path,
    target: &ModelSource,
    counts: &[u64],
    k: usize,
    out: &Path,
) -> Result<f64> {
    let ids = most_frequent(counts, k);
    narrow_checkpoint(draft, target, &ids, out)?;
    let covered: u64 = ids.iter().map(|&t| counts[t as usize]).sum();
    Ok(covered as f64 / counts.iter().sum::<u64>().max(1) as f64)
}

/// The `d2t` tensor of a head over target ids `ids`: draft index i is target id `i + d2t[i]`.
pub fn d2t_offsets(ids: &[u32]) -> Vec<i64> {
    ids.iter()
        .enumerate()
        .map(|(i, &t)| t as i64 - i as i64)
        .collect()
}

/// Write `out`: the draft checkpoint in `draft` (config.json + model.safetensors, a z-lab
/// DFlash draft, float or MLX-quantized by `examples/quantize_draft`) with a head of its own
/// over `ids` (ascending target ids) taken from `target`'s head (its embedding when tied),
/// quantized like the draft's linears when they are, `d2t`, and `draft_vocab_size` in the
/// config. Other files of the draft directory (train_log.jsonl, eval.json) are copied.
pub fn narrow_checkpoint(
    draft: &Path,
    target: &ModelSource,
    ids: &[u32],
    out: &Path,
) -> Result<()> {
    let cfg = target.target_config()?;
    let (vocab, hidden) = (cfg.vocab_size, cfg.hidden_size);
    let k = ids.len();
    if k == 0 || k >= vocab {
        return Err(Error::input(format!(
            "narrow draft: {k} ids; want 0 < K < the target's vocabulary ({vocab})"
        )));
    }
    if ids.windows(2).any(|w| w[0] >= w[1]) || ids[k - 1] as usize >= vocab {
        return Err(Error::input(format!(
            "narrow draft: the ids must ascend and stay below the vocabulary ({vocab})"
        )));
    }
    let st = draft.join("model.safetensors");
    let mut tensors: HashMap<String, Tensor> = candle_core::safetensors::load(&st, &Device::Cpu)
        .map_err(|e| Error::weights(st.display().to_string(), e.to_string()))?;
    if tensors.contains_key("lm_head.weight") || tensors.contains_key("d2t") {
        return Err(Error::weights(
            st.display().to_string(),
            "the draft has a head (or vocabulary map) of its own already; narrow the draft it was made from",
        ));
    }
    let cfg_path = draft.join("config.json");
    let mut dcfg = crate::config::read_json(&cfg_path)?;
    let w = target.weights(DType::F32, &Device::Cpu, false)?;
    let name = if w.contains("lm_head.weight") {
        "lm_head.weight"
    } else {
        "model.embed_tokens.weight"
    };
    let index = Tensor::from_slice(ids, k, &Device::Cpu)?;
    let rows = w.get(name, (vocab, hidden))?.index_select(&index, 0)?;
    match dcfg.get("quantization") {
        Some(q) => {
            let num = |key: &str| q.get(key).and_then(|v| v.as_u64()).map(|v| v as usize);
            let (Some(bits), Some(group)) = (num("bits"), num("group_size")) else {
                return Err(Error::input(format!(
                    "{}: `quantization` needs bits and group_size",
                    cfg_path.display()
                )));
            };
            let layout = crate::source::mlx_write::Layout::new(bits, group);
            let one = HashMap::from([("lm_head.weight".to_string(), rows)]);
            let (mlx, _, _) = crate::source::mlx_write::quantize_checkpoint(&one, &layout)?;
            tensors.extend(mlx);
        }
        None => {
            let dtype = tensors
                .get("norm.weight")
                .map_or(DType::BF16, |t| t.dtype());
            tensors.insert("lm_head.weight".into(), rows.to_dtype(dtype)?);
        }
    }
    tensors.insert(
        "d2t".into(),
        Tensor::from_vec(d2t_offsets(ids), k, &Device::Cpu)?,
    );
    dcfg["draft_vocab_size"] = k.into();
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    candle_core::safetensors::save(&tensors, out.join("model.safetensors"))?;
    crate::testing::write_json(&out.join("config.json"), &dcfg)?;
    for f in ["train_log.jsonl", "eval.json"] {
        let from = draft.join(f);
        if from.exists() && from != out.join(f) {
            std::fs::copy(&from, out.join(f)).map_err(|e| Error::io(&from, e))?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_frequent_ranks_by_count_then_id_and_returns_them_ascending() {
        let counts = [5, 0, 9, 5, 1, 9];
        assert_eq!(most_frequent(&counts, 1), vec![2]);
        assert_eq!(most_frequent(&counts, 3), vec![0, 2, 5]);
        assert_eq!(most_frequent(&counts, 4), vec![0, 2, 3, 5]);
        assert_eq!(most_frequent(&counts, 99).len(), 6);
        let seqs = [
            Sequence {
                ids: vec![4, 4, 1, 2, 2, 2, 70],
                response_start: 2,
            },
            Sequence {
                ids: vec![1],
                response_start: 1,
            },
        ];
        let (c, n) = response_counts(&seqs, 8);
        assert_eq!(
            (c, n),
            (vec![0, 1, 3, 0, 0, 0, 0, 0], 4),
            "prompts and ids past the vocabulary are not counted"
        );
    }
}
