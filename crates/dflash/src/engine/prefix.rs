//! The prefix cache: finished sequences' caches kept for requests whose prompts start the same
//! way (a shared system prompt, the earlier turns of a chat). A new sequence starts from a copy
//! of the longest usable cached prefix and prefills only the rest of its prompt.
//!
//! An entry holds the target cache of the tokens it covers, the draft's context cache and the
//! taps of the positions the draft has not seen yet, so a hit restores the draft too. Attention
//! and latent rows can be cut at any prefix; a recurrent state (the hybrids) exists only after
//! all of an entry's tokens, so for those models only a whole entry is reused. Entries are
//! stored compact (their own tensors, sized to their tokens) and evicted least recently used
//! when the byte budget is exceeded.

use crate::archs::TargetCache;
use crate::draft::DraftCache;
use crate::Result;
use candle_core::Tensor;

/// Shortest prefix worth a copy (fewer tokens prefill as fast as they copy).
pub const MIN_PREFIX: usize = 16;

struct Entry {
    /// The tokens at positions `0 .. ids.len()` (== the target cache's length).
    ids: Vec<u32>,
    tcache: TargetCache,
    dcache: Option<DraftCache>,
    /// Taps of positions `dcache.len() .. ids.len()` (the draft's pending context rows).
    pending: Option<Tensor>,
    bytes: usize,
    used: u64,
}

/// What a hit gives a new sequence: caches of `len` prompt positions (sized for it), and the
/// taps of the positions its draft cache does not hold yet.
pub struct Hit {
    pub len: usize,
    pub tcache: TargetCache,
    pub dcache: Option<DraftCache>,
    pub pending: Option<Tensor>,
}

/// Counters for `/metrics`.
#[derive(Debug, Clone, Copy, Default)]
pub struct PrefixStats {
    pub hits: u64,
    pub misses: u64,
    pub reused_tokens: u64,
    pub evictions: u64,
    pub entries: usize,
    pub bytes: usize,
}

pub struct PrefixCache {
    budget: usize,
    entries: Vec<Entry>,
    clock: u64,
    pub stats: PrefixStats,
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

impl PrefixCache {
    /// A cache of at most `budget` bytes.
    pub fn new(budget: usize) -> Self {
        Self {
            budget,
            entries: Vec::new(),
            clock: 0,
            stats: PrefixStats::default(),
        }
    }

    /// The longest usable cached prefix of `prompt` (at most `prompt.len() - 1` positions: the
    /// last prompt token must run to give the first logits), copied into caches of `capacity`
    /// positions. `draft`: the sequence has a draft, so an entry must restore it too.
    pub fn lookup(&mut self, prompt: &[u32], capacity: usize, draft: bool) -> Result<Option<Hit>> {
        let limit = prompt.len().saturating_sub(1).min(capacity);
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            if draft && e.dcache.is_none() {
                continue;
            }
            let m = e.tcache.reusable(common_prefix(&e.ids, prompt).min(limit));
            let d = e.dcache.as_ref().map_or(0, |d| d.len());
            if draft && m > d && e.pending.is_none() {
                continue;
            }
            if m >= MIN_PREFIX && best.is_none_or(|(_, b)| m > b) {
                best = Some((i, m));
            }
        }
        let Some((i, m)) = best else {
            self.stats.misses += 1;
            return Ok(None);
        };
        self.clock += 1;
        let e = &mut self.entries[i];
        e.used = self.clock;
        let tcache = e.tcache.fork(m, capacity)?;
        let (dcache, pending) = match (&e.dcache, draft) {
            (Some(dc), true) => {
                let d = dc.len().min(m);
                let pending = match &e.pending {
                    Some(p) if m > d => Some(p.narrow(0, 0, m - d)?),
                    _ => None,
                };
                (Some(dc.fork(d, capacity)?), pending)
            }
            _ => (None, None),
        };
        self.stats.hits += 1;
        self.stats.reused_tokens += m as u64;
        Ok(Some(Hit {
            len: m,
            tcache,
            dcache,
            pending,
        }))
    }

    /// Keep a finished sequence's caches: `ids` are the tokens at positions
    /// `0 .. tcache.len()`. Entries it extends are dropped; old entries are evicted until it
    /// fits the budget (an entry larger than the budget is not kept).
    pub fn insert(
        &mut self,
        ids: &[u32],
        tcache: &TargetCache,
        dcache: Option<&DraftCache>,
        pending: Option<Tensor>,
    ) -> Result<()> {
        let n = tcache.len();
        if n < MIN_PREFIX || ids.len() < n || tcache.reusable(n) != n {
            return Ok(());
        }
        let ids = ids[..n].to_vec();
        // An entry that is a prefix of this one (the previous turn of the chat) is covered.
        self.entries
            .retain(|e| !(e.ids.len() <= n && ids.starts_with(&e.ids)));
        if self.entries.iter().any(|e| e.ids.starts_with(&ids)) {
            return Ok(()); // already covered by a longer entry
        }
        let tcache = tcache.fork(n, n)?;
        let dcache = dcache
            .map(|d| {
                let l = d.len();
                d.fork(l, l.max(1))
            })
            .transpose()?;
        let pending = pending.map(|p| p.copy()).transpose()?;
        let bytes = tcache.bytes()
            + dcache.as_ref().map_or(0, |d| d.bytes())
            + pending.as_ref().map_or(0, crate::nn::tensor_bytes);
        if bytes > self.budget {
            return Ok(());
        }
        while self.used_bytes() + bytes > self.budget {
            let Some((i, _)) = self.entries.iter().enumerate().min_by_key(|(_, e)| e.used) else {
                break;
            };
            self.entries.swap_remove(i);
            self.stats.evictions += 1;
        }
        self.clock += 1;
        self.entries.push(Entry {
            ids,
            tcache,
            dcache,
            pending,
            bytes,
            used: self.clock,
        });
        self.stats.entries = self.entries.len();
        self.stats.bytes = self.used_bytes();
        Ok(())
    }

    fn used_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }
}
