//! MiniLM's training attention alone, forward and backward (issue 28, item 3): one layer's
//! `[8, 12, 25, 32]` heads as views of the projections, dropout 0.1 on the weights, three ways,
//! interleaved:
//!
//! - `scaled_dot_product_attention` with a gradient recorded: the fused training op (one graph node,
//!   a one-pass backward per head);
//! - the same function with fusion off (`without_fusion`): candle's composed ops;
//! - the chain `BertSelfAttention` ran before the op: contiguous heads, `q·kᵀ`, the mask added, the
//!   runtime's fused softmax and dropout modules, the product with the values;
//! - `packed_heads`: the same function over the projections' `[B, L, H·E]` as they are (what
//!   `BertSelfAttention` runs now), no split/join views in the graph.
//!
//! Minimums over the rounds, which other work on the machine disturbs least.
//!
//! ```text
//! cargo bench -p minilm --bench attention_train          # 50 rounds
//! cargo bench -p minilm --bench attention_train -- 200
//! ```

use std::time::Instant;

use candle_core::{DType, Device, Tensor, Var};
use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::{without_fusion, Dropout, Softmax};
use module_runtime::prelude::*;

#[path = "support/mod.rs"]
mod support;

/// Forward and backward milliseconds of one call.
type Timing = (f64, f64);

fn main() -> Result<()> {
    let rounds = support::threads_and_rounds(50);
    let dev = Device::Cpu;
    let (b, h, l, e) = (8, 12, 25, 32);
    let scale = 1.0 / (e as f64).sqrt();
    // The projections' `[B, L, H·E]` outputs; the heads are their `[B, H, L, E]` views.
    let proj = || Var::randn(0f32, 1., (b, l, h, e), &dev);
    let (q, k, v) = (proj()?, proj()?, proj()?);
    let heads = |x: &Var| x.as_tensor().transpose(1, 2);
    let mask = Tensor::zeros((b, 1, 1, l), DType::F32, &dev)?;
    let dropout = Dropout::new(0.1);
    // Each variant returns `[B, L, H·E]`, the heads side by side.
    let joined = |y: Tensor| -> Result<Tensor> { Ok(y.transpose(1, 2)?.reshape((b, l, h * e))?) };
    let timed = |f: &dyn Fn() -> Result<Tensor>| -> Result<Timing> {
        let start = Instant::now();
        let y = f()?;
        let forward = start.elapsed().as_secs_f64() * 1e3;
        let start = Instant::now();
        y.sum_all()?.backward()?;
        Ok((forward, start.elapsed().as_secs_f64() * 1e3))
    };
    let sdpa = || -> Result<Tensor> {
        let options = SdpaOptions {
            dropout_p: 0.1,
            scale: Some(scale),
            ..Default::default()
        };
        joined(scaled_dot_product_attention(
            &heads(&q)?,
            &heads(&k)?,
            &heads(&v)?,
            Some(&mask),
            options,
        )?)
    };
    let packed = || -> Result<Tensor> {
        let options = SdpaOptions {
            dropout_p: 0.1,
            scale: Some(scale),
            packed_heads: Some(h),
            ..Default::default()
        };
        let flat = |x: &Var| x.as_tensor().reshape((b, l, h * e));
        scaled_dot_product_attention(&flat(&q)?, &flat(&k)?, &flat(&v)?, Some(&mask), options)
    };
    let previous = || -> Result<Tensor> {
        let q = (heads(&q)?.contiguous()? * scale)?;
        let (k, v) = (heads(&k)?.contiguous()?, heads(&v)?.contiguous()?);
        let scores = q.matmul(&k.t()?)?.broadcast_add(&mask)?;
        let probs = Forward::forward(&Softmax::new(-1), &scores)?;
        joined(dropout.call(&probs)?.matmul(&v)?)
    };
    let mut best = [(f64::MAX, f64::MAX); 4];
    for _ in 0..rounds {
        let times = [
            timed(&sdpa)?,
            without_fusion(|| timed(&sdpa))?,
            timed(&previous)?,
            timed(&packed)?,
        ];
        for (b, t) in best.iter_mut().zip(times) {
            *b = (b.0.min(t.0), b.1.min(t.1));
        }
    }
    for (name, (f, bw)) in [
        "attention [8, 12, 25, 32], fused training op",
        "attention [8, 12, 25, 32], composed (fusion off)",
        "attention [8, 12, 25, 32], previous chain",
        "attention [8, 12, 25, 32], packed_heads",
    ]
    .iter()
    .zip(best)
    {
        println!("{name}: forward {f:.3} ms, backward {bw:.3} ms (min of {rounds})");
    }
    Ok(())
}
