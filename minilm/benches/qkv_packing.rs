//! What one QKV matmul would gain over three (issue 28, item 4): MiniLM's query, key and value
//! projections of the forward benchmark's batch (32 × 25 tokens, hidden 384) as three matmuls
//! against `[384, 384]` weights, as one against the three weights packed `[1152, 384]`, and as one
//! that packs them first (what a model must do when nothing keeps a packed copy in step with the
//! parameters). Minimums over the rounds, which other work on the machine disturbs least.
//!
//! ```text
//! cargo bench -p minilm --bench qkv_packing          # 40 rounds
//! cargo bench -p minilm --bench qkv_packing -- 100
//! ```

use std::time::Instant;

use candle_core::{Device, Tensor};

#[path = "support/mod.rs"]
mod support;

fn main() -> candle_core::Result<()> {
    // Two threads, as the other benchmarks (and PyTorch's side of them).
    let rounds = support::threads_and_rounds(40);
    let dev = Device::Cpu;
    let x = Tensor::randn(0f32, 1., (32 * 25, 384), &dev)?;
    let weights = (0..3)
        .map(|_| Tensor::randn(0f32, 1., (384, 384), &dev))
        .collect::<candle_core::Result<Vec<_>>>()?;
    let packed = Tensor::cat(&weights, 0)?;
    let mut best = [f64::MAX; 3];
    for _ in 0..rounds {
        let time = |f: &dyn Fn() -> candle_core::Result<()>| -> candle_core::Result<f64> {
            let start = Instant::now();
            f()?;
            Ok(start.elapsed().as_secs_f64() * 1e3)
        };
        let three = time(&|| {
            for w in &weights {
                x.matmul(&w.t()?)?;
            }
            Ok(())
        })?;
        let one = time(&|| x.matmul(&packed.t()?).map(drop))?;
        let pack_and_one = time(&|| x.matmul(&Tensor::cat(&weights, 0)?.t()?).map(drop))?;
        for (b, t) in best.iter_mut().zip([three, one, pack_and_one]) {
            *b = b.min(t);
        }
    }
    println!(
        "QKV projections of 800 tokens, min of {rounds}: three matmuls {:.3} ms, one packed {:.3} ms, \
         pack + one {:.3} ms",
        best[0], best[1], best[2]
    );
    Ok(())
}
