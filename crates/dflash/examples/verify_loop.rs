//! A profiling harness for the CPU verify (issue 27): a GGUF target, a 128-token prompt, then
//! ITERS forwards of Q rows each cut back to the prompt; prints ms per forward. Run under
//! `perf record -g` to see where a verify's time goes (docs/perf.md, session 27).
//! `cargo run --release --example verify_loop -p dflash -- FILE.gguf Q ITERS [last]`
//! (`last`: only the last row's logits, as a prompt chunk; default every row's, as a verify).
use dflash::archs::{load_target, LoadOptions, Logits};
use dflash::source::ModelSource;
use std::time::Instant;
fn main() -> dflash::Result<()> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() != 3 && !(a.len() == 4 && a[3] == "last") {
        return Err(dflash::Error::input(
            "usage: verify_loop FILE.gguf Q ITERS [last]",
        ));
    }
    let logits = if a.len() == 4 {
        Logits::Last
    } else {
        Logits::All
    };
    let num = |s: &str| {
        s.parse::<usize>()
            .map_err(|_| dflash::Error::input(format!("not a count: {s}")))
    };
    let (q, iters) = (num(&a[1])?, num(&a[2])?);
    let (_, m) = load_target(
        &ModelSource::from_gguf("x", std::path::Path::new(&a[0])),
        &LoadOptions::default(),
    )?;
    let ids: Vec<u32> = (0..128u32).map(|i| 100 + i * 7).collect();
    let mut c = m.new_cache(128 + q.max(384))?;
    m.forward(&ids, 0, &mut c, &[], Logits::Last)?;
    let block: Vec<u32> = (0..q as u32).map(|i| 300 + i).collect();
    let t = Instant::now();
    for _ in 0..iters {
        m.forward(&block, 128, &mut c, &[], logits)?;
        c.truncate(128)?;
    }
    println!(
        "q={q}: {:.2} ms",
        t.elapsed().as_secs_f64() * 1e3 / iters as f64
    );
    Ok(())
}
