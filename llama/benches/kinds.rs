//! One product of one input row with a 2048×2048 weight in each quantized kind that 7B-class
//! GGUF files hold (`q8_0`, `q4_0`, `q4_K`, `q6_K`), 24 weights in turn so that each is cold in
//! memory as in a decoder, 2 threads: microseconds a product (the best of 5 passes) and the
//! weight's bytes read per second, through `Linear` (module-nn's kernel for `q8_0`, `q4_0` and
//! `q4_K` on CPUs with AVX2, candle's for `q6_K`) and through candle's quantized matmul on the
//! same weights, alternated.
//!
//! ```text
//! cargo bench -p llama --bench kinds
//! ```

use std::time::Instant;

use module_runtime::candle_core::quantized::QTensor;
use module_runtime::nn::{parse_quant_kind, quantize, Linear};
use module_runtime::prelude::*;

/// Weights per kind, each 2048×2048.
const WEIGHTS: usize = 24;
const SIDE: usize = 2048;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    let dev = Device::Cpu;
    for name in ["q8_0", "q4_0", "q4_k", "q6_k"] {
        let kind = parse_quant_kind(name)?;
        let layers: Vec<Linear> = (0..WEIGHTS)
            .map(|_| Linear::no_bias(SIDE, SIDE, &dev))
            .collect::<Result<_>>()?;
        // Candle's own copies of the same weights (ours give theirs up to the kernel's tiles).
        let mut candle = Vec::with_capacity(WEIGHTS);
        for layer in &layers {
            candle.push(QTensor::quantize(&layer.weight.tensor()?, kind)?);
            let _ = quantize(layer, "**", kind)?;
        }
        let x = Tensor::randn(0f32, 1., (1, SIDE), &dev)?;
        let ours = || -> Result<f64> {
            without_grad(|| {
                let start = Instant::now();
                for layer in &layers {
                    std::hint::black_box(layer.call(&x)?);
                }
                Ok(start.elapsed().as_secs_f64() / WEIGHTS as f64)
            })
        };
        let theirs = || -> Result<f64> {
            let start = Instant::now();
            for w in &candle {
                std::hint::black_box(x.apply_op1_no_bwd(w)?);
            }
            Ok(start.elapsed().as_secs_f64() / WEIGHTS as f64)
        };
        ours()?; // the kernels' layouts are made on the first product
        theirs()?;
        let (mut best, mut best_candle) = (f64::MAX, f64::MAX);
        for _ in 0..5 {
            best = best.min(ours()?);
            best_candle = best_candle.min(theirs()?);
        }
        let bytes = (SIDE * SIDE / kind.block_size() * kind.type_size()) as f64;
        println!(
            "{name:5} Linear {:7.1} µs a product ({:4.1} GB/s), candle {:7.1} µs ({:4.1} GB/s)",
            best * 1e6,
            bytes / best / 1e9,
            best_candle * 1e6,
            bytes / best_candle / 1e9
        );
    }
    Ok(())
}
