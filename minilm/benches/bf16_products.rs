//! Single bfloat16 products `x Wᵀ` (a bfloat16 `Linear` without a bias, under `no_grad`) against
//! the same product in float32 and against the bfloat16 product on the float32 kernels (forced
//! with `with_cpu_capability(AVX2)`, the path of CPUs without AVX512-BF16), interleaved call by
//! call; and, with `PYTORCH` set, PyTorch's `torch.nn.functional.linear` on float32 and on
//! bfloat16 tensors in the same run (`support/pytorch_bf16_products.py`, 2 threads; oneDNN's
//! AVX512-BF16 or AMX kernels). Medians of the calls, in GFLOP/s. The shapes: MiniLM's training
//! step (8 × 25 rows) forward and its backward's two products (`dx = g W`: `k` the output width;
//! `dW = gᵀ x`: `k` the 200 rows), and the 800-row inference batch.
//!
//! ```text
//! cargo bench -p minilm --bench bf16_products                  # 200 calls per shape
//! PYTORCH=/path/to/venv/bin/python cargo bench -p minilm --bench bf16_products -- 300
//! ```

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use module_runtime::backends::cpu::{kernel_choice, with_cpu_capability, CpuCapability};
use module_runtime::nn::Linear;
use module_runtime::prelude::*;

#[path = "support/mod.rs"]
mod support;

/// (name, rows, in, out).
const SHAPES: [(&str, usize, usize, usize); 7] = [
    ("train-qkvo", 200, 384, 384),
    ("train-up", 200, 384, 1536),
    ("train-down", 200, 1536, 384),
    ("train-dW-up", 1536, 200, 384),
    ("train-dW-qkvo", 384, 200, 384),
    ("forward-up", 800, 384, 1536),
    ("square-512x1024x1024", 512, 1024, 1024),
];

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let calls = support::threads_and_rounds(200);
    if !kernel_choice().bf16_products {
        eprintln!(
            "*** this CPU has no AVX512-BF16: bfloat16 products take the float32 kernels ***"
        );
    }
    let dev = Device::Cpu;
    let _inference = module_runtime::no_grad();
    let mut ours = Vec::new();
    for (name, m, k, n) in SHAPES {
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let f32_linear = Linear::from_tensors(w.clone(), None)?;
        let (xb, wb) = (x.to_dtype(DType::BF16)?, w.to_dtype(DType::BF16)?);
        let bf16_linear = Linear::from_tensors(wb, None)?;
        let fallback = || with_cpu_capability(CpuCapability::Avx2, || bf16_linear.call(&xb));
        // The two bfloat16 paths agree within float32 rounding, rounded to bfloat16.
        let (a, b) = (bf16_linear.call(&xb)?, fallback()?);
        let scale = b
            .to_dtype(DType::F32)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        let diff = (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(
            diff <= scale / 64.0,
            "{name}: the bf16 paths differ by {diff}"
        );
        for _ in 0..20 {
            f32_linear.call(&x)?;
            bf16_linear.call(&xb)?;
            fallback()?;
        }
        let (mut t32, mut t16, mut tfall) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..calls {
            let start = Instant::now();
            f32_linear.call(&x)?;
            t32.push(start.elapsed().as_secs_f64() * 1e3);
            let start = Instant::now();
            bf16_linear.call(&xb)?;
            t16.push(start.elapsed().as_secs_f64() * 1e3);
            let start = Instant::now();
            fallback()?;
            tfall.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let flop = 2.0 * (m * k * n) as f64;
        let gflops = |ms: f64| flop / ms / 1e6;
        let (t32, t16, tfall) = (
            support::median(t32),
            support::median(t16),
            support::median(tfall),
        );
        ours.push((t32, t16));
        println!(
            "{name:<22} {m:>4}x{k:<4}x{n:<5} ours bf16 {t16:.3} ms ({:.0} GFLOP/s), f32 {t32:.3} ms \
             ({:.0}), bf16 on the f32 kernels {tfall:.3} ms ({:.0})",
            gflops(t16),
            gflops(t32),
            gflops(tfall)
        );
    }
    if let Some(python) = std::env::var_os("PYTORCH") {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support/pytorch_bf16_products.py");
        let out = Command::new(python)
            .arg(script)
            .arg(calls.to_string())
            .args(
                SHAPES
                    .iter()
                    .map(|(name, m, k, n)| format!("{name}:{m}:{k}:{n}")),
            )
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        for (line, (t32, t16)) in text.lines().zip(&ours) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, m, k, n, ms32, ms16] = fields[..] else {
                continue;
            };
            let flop = 2.0 * m.parse::<f64>()? * k.parse::<f64>()? * n.parse::<f64>()?;
            let (ms32, ms16): (f64, f64) = (ms32.parse()?, ms16.parse()?);
            println!(
                "{name:<22} PyTorch bf16 {ms16:.3} ms ({:.0} GFLOP/s), f32 {ms32:.3} ms ({:.0}); \
                 ours bf16 {:.2}x its bf16 speed, f32 {:.2}x its f32",
                flop / ms16 / 1e6,
                flop / ms32 / 1e6,
                ms16 / t16,
                ms32 / t32
            );
        }
        if !out.status.success() {
            eprintln!("pytorch: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    Ok(())
}
