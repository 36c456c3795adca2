//! Times one AdamW step over parameters of all-MiniLM-L6-v2's shapes (22.7M values, CPU float32):
//! the fused in-place pass, the composed candle ops, and candle-nn's `AdamW`, interleaved; then
//! one SGD step with momentum, fused and composed.
//!
//! ```text
//! cargo run -p module-optim --example step_bench --release
//! ```
//!
//! (or, to avoid a release build of candle, the dev profile with this crate optimized:
//! `cargo run -p module-optim --example step_bench --config 'profile.dev.package.module-optim.opt-level=3'`;
//! candle's own crates are optimized in the dev profile already).

use std::time::Instant;

use module_runtime::candle_core::{Device, Tensor};
use module_runtime::candle_nn::{self, Optimizer as _};
use module_runtime::optim::{AdamW, Optimizer, ParamList, SgdOptions, SGD};
use module_runtime::Param;

fn shapes() -> Vec<(String, Vec<usize>)> {
    let (h, i) = (384, 1536);
    let mut s = vec![
        (
            "embeddings.word_embeddings.weight".to_owned(),
            vec![30522, h],
        ),
        ("embeddings.position_embeddings.weight".into(), vec![512, h]),
        ("embeddings.token_type_embeddings.weight".into(), vec![2, h]),
        ("embeddings.LayerNorm.weight".into(), vec![h]),
        ("embeddings.LayerNorm.bias".into(), vec![h]),
    ];
    for l in 0..6 {
        let p = format!("encoder.layer.{l}");
        for name in ["query", "key", "value"] {
            s.push((format!("{p}.attention.self.{name}.weight"), vec![h, h]));
            s.push((format!("{p}.attention.self.{name}.bias"), vec![h]));
        }
        s.push((format!("{p}.attention.output.dense.weight"), vec![h, h]));
        s.push((format!("{p}.attention.output.dense.bias"), vec![h]));
        s.push((format!("{p}.attention.output.LayerNorm.weight"), vec![h]));
        s.push((format!("{p}.attention.output.LayerNorm.bias"), vec![h]));
        s.push((format!("{p}.intermediate.dense.weight"), vec![i, h]));
        s.push((format!("{p}.intermediate.dense.bias"), vec![i]));
        s.push((format!("{p}.output.dense.weight"), vec![h, i]));
        s.push((format!("{p}.output.dense.bias"), vec![h]));
        s.push((format!("{p}.output.LayerNorm.weight"), vec![h]));
        s.push((format!("{p}.output.LayerNorm.bias"), vec![h]));
    }
    s
}

/// How long one call of `step` takes, in milliseconds.
fn time_ms<E>(step: impl FnOnce() -> Result<(), E>) -> Result<f64, E> {
    let t = Instant::now();
    step()?;
    Ok(t.elapsed().as_secs_f64() * 1e3)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dev = Device::Cpu;
    let params: Vec<(String, Param)> = shapes()
        .into_iter()
        .map(|(n, s)| Ok((n, Param::new(Tensor::randn(0f32, 0.02, s, &dev)?)?)))
        .collect::<Result<_, Box<dyn std::error::Error>>>()?;
    let total: usize = params.iter().map(|(_, p)| p.elem_count()).sum();
    // Gradients: loss = sum(p * c) gives each parameter the gradient c.
    let mut loss = Tensor::new(0f32, &dev)?;
    for (_, p) in &params {
        let c = Tensor::randn(0f32, 1.0, p.shape(), &dev)?;
        loss = (loss + (p.tensor().unwrap() * c)?.sum_all()?)?;
    }
    let grads = loss.backward()?;
    let list = ParamList(params.clone());
    let mut fused = AdamW::new(&list, AdamW::options().lr(1e-4))?;
    let mut composed = AdamW::new(&list, AdamW::options().lr(1e-4))?;
    composed.set_fused(false);
    let vars = params.iter().map(|(_, p)| p.var().unwrap()).collect();
    let mut candle = candle_nn::AdamW::new(
        vars,
        candle_nn::ParamsAdamW {
            lr: 1e-4,
            ..Default::default()
        },
    )?;
    let (mut tf, mut tc, mut tn) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..7 {
        tf.push(time_ms(|| fused.step(&grads))?);
        tc.push(time_ms(|| composed.step(&grads))?);
        tn.push(time_ms(|| candle.step(&grads))?);
    }
    println!(
        "AdamW step over {total} float32 values, {} threads, median of 7 (ms): fused {:.1}, composed {:.1}, candle-nn {:.1}",
        candle_core::utils::barrier_pool().n_workers() + 1,
        median(tf),
        median(tc),
        median(tn)
    );
    let options = SgdOptions::new(1e-3).momentum(0.9);
    let mut fused = SGD::new(&list, options.clone())?;
    let mut composed = SGD::new(&list, options)?;
    composed.set_fused(false);
    let (mut tf, mut tc) = (Vec::new(), Vec::new());
    for _ in 0..7 {
        tf.push(time_ms(|| fused.step(&grads))?);
        tc.push(time_ms(|| composed.step(&grads))?);
    }
    println!(
        "SGD (momentum 0.9) step, median of 7 (ms): fused {:.1}, composed {:.1}",
        median(tf),
        median(tc)
    );
    Ok(())
}
