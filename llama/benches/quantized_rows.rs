//! A quantized `Linear` against the float one at 1 to 512 input rows: decoding (1 row), batched
//! decoding and short prompts (a few rows), prefill (many). Weights shaped like the
//! SmolLM-135M-shaped decoder's (`gate_proj` 1536×576, `down_proj` 576×1536, the tied head
//! 49152×576), enough copies of each that they are cold in memory, as in a decoder.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo bench -p llama --bench quantized_rows            # q8_0
//! RAYON_NUM_THREADS=2 cargo bench -p llama --bench quantized_rows -- q4_0    # another kind
//! ```
//!
//! Up to `Q8_0_MAX_ROWS` rows a `q8_0`, `q4_0` or `q4_K` layer runs module-nn's kernel (CPUs
//! with AVX2; shapes whose rows the kind's blocks do not fit are skipped),
//! up to `QUANTIZED_MAX_ROWS` other kinds run candle's; above, both multiply with the
//! dequantized weight in float (the ratio is then about 1).

use std::time::Instant;

use module_runtime::nn::{parse_quant_kind, Linear, Q8_0_MAX_ROWS, QUANTIZED_MAX_ROWS};
use module_runtime::prelude::*;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    let kind_name = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_else(|| "q8_0".to_owned());
    let kind = parse_quant_kind(&kind_name)?;
    println!(
        "{kind_name}: kernel up to {Q8_0_MAX_ROWS} rows (q8_0, q4_0, q4_k) / {QUANTIZED_MAX_ROWS} (other kinds)"
    );
    let dev = Device::Cpu;
    for (out, inp, copies) in [
        (1536usize, 576usize, 60usize),
        (576, 1536, 60),
        (49152, 576, 3),
    ] {
        if inp % kind.block_size() != 0 {
            println!(
                "{out}x{inp}: rows of {inp} do not fit {kind_name}'s blocks of {}",
                kind.block_size()
            );
            continue;
        }
        let float: Vec<Linear> = (0..copies)
            .map(|_| Linear::no_bias(inp, out, &dev))
            .collect::<Result<_>>()?;
        let quantized: Vec<Linear> = (0..copies)
            .map(|_| {
                let layer = Linear::no_bias(inp, out, &dev)?;
                layer.weight.quantize(kind)?;
                Ok(layer)
            })
            .collect::<Result<_>>()?;
        for rows in [1usize, 4, 8, 16, 32, 64, 128, 256, 512] {
            let x = Tensor::randn(0f32, 1., (rows, inp), &dev)?;
            let time = |layers: &[Linear]| -> Result<f64> {
                without_grad(|| {
                    let start = Instant::now();
                    for _ in 0..3 {
                        for layer in layers {
                            std::hint::black_box(layer.call(&x)?);
                        }
                    }
                    Ok(start.elapsed().as_secs_f64() / (3 * layers.len()) as f64 * 1e6)
                })
            };
            time(&quantized)?; // the kernel's tiles are made at the first call
            let (f, q) = (time(&float)?, time(&quantized)?);
            println!(
                "{out}x{inp}, {rows:3} rows: float32 {f:7.0} µs, {kind_name} {q:7.0} µs ({:.2}x)",
                f / q
            );
        }
    }
    Ok(())
}
