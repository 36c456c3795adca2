//! The kernels' implementations forced one instruction set at a time
//! (`backends::cpu::with_cpu_capability`), each held to a reference: float32 products and their
//! gradients to float64 (bfloat16 `Linear` too, on the AVX512-BF16 kernel and the float32
//! fallback), attention to the composed path, the quantized products to one another,
//! and the passes that promise the same bits under every choice (activations, the optimizer's step)
//! to the bit. Every level the CPU has is run, so a host with AVX-512 checks its AVX2 and portable
//! builds too.

use candle_core::{DType, Var};
use module_runtime::backends::cpu::{
    get_cpu_capability, kernel_choice, with_cpu_capability, CpuCapability,
};
use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
use module_runtime::nn::{quantize, without_fusion, GgmlDType, Linear, SiLU, GELU};
use module_runtime::prelude::*;

/// Every level this CPU has, the portable one first.
fn levels() -> Vec<CpuCapability> {
    [
        CpuCapability::Default,
        CpuCapability::Avx2,
        CpuCapability::Avx512,
    ]
    .into_iter()
    .filter(|&level| level <= get_cpu_capability())
    .collect()
}

/// The largest `|a - b|` over the largest `|b|` (at least 1).
fn rel_diff(a: &Tensor, b: &Tensor) -> f64 {
    let a = a.to_dtype(DType::F64).unwrap();
    let b = b.to_dtype(DType::F64).unwrap();
    let diff = (&a - &b).unwrap().abs().unwrap().max_all().unwrap();
    let scale = b
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    diff.to_scalar::<f64>().unwrap() / scale.max(1.0)
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

#[test]
fn a_forced_level_is_what_every_operation_reports() {
    for level in levels() {
        let choice = with_cpu_capability(level, kernel_choice);
        assert_eq!(choice.products, level);
        assert_eq!(choice.elementwise, level);
        assert_eq!(choice.attention, level.min(CpuCapability::Avx2));
        assert_eq!(choice.optimizer, level.min(CpuCapability::Avx2));
        assert!(choice.quantized <= level);
        assert_eq!(with_cpu_capability(level, get_cpu_capability), level);
    }
    // Asking for more than the CPU has gives what it has.
    let widest = with_cpu_capability(CpuCapability::Avx512, kernel_choice);
    assert_eq!(widest.products, get_cpu_capability());
    assert!(kernel_choice().to_string().contains("products"));
}

/// `Linear` in inference (the barrier pool's products) and in training (the fused op and its
/// backward's products), at every level, against float64: shapes split over threads and ragged
/// ones, a transposed (strided) input included.
#[test]
fn products_and_their_gradients_match_float64_at_every_level() {
    let dev = Device::Cpu;
    for (m, k, n) in [(256, 384, 192), (37, 29, 53), (1, 96, 70)] {
        let x = Tensor::randn(0f32, 1., (m, k), &dev).unwrap();
        let xt = x.t().unwrap().contiguous().unwrap().t().unwrap();
        let w = Tensor::randn(0f32, 0.1, (n, k), &dev).unwrap();
        let b = Tensor::randn(0f32, 1., n, &dev).unwrap();
        let u = Tensor::randn(0f32, 1., (m, n), &dev).unwrap();
        let f64_ = |t: &Tensor| t.to_dtype(DType::F64).unwrap();
        let want = f64_(&x)
            .matmul(&f64_(&w).t().unwrap())
            .unwrap()
            .broadcast_add(&f64_(&b))
            .unwrap();
        let want_dx = f64_(&u).matmul(&f64_(&w)).unwrap();
        let want_dw = f64_(&u).t().unwrap().matmul(&f64_(&x)).unwrap();
        let want_db = f64_(&u).sum(0).unwrap();
        let tol = 2e-6 * (k as f64).sqrt();
        for level in levels() {
            let linear = Linear::from_tensors(w.clone(), Some(b.clone())).unwrap();
            for input in [&x, &xt] {
                let y = with_cpu_capability(level, || no_grad_call(&linear, input));
                assert!(rel_diff(&y, &want) < tol, "{level} {m}x{k}x{n}");
            }
            let xv = Var::from_tensor(&x).unwrap();
            let grads = with_cpu_capability(level, || {
                let y = linear.call(xv.as_tensor()).unwrap();
                assert!(rel_diff(&y, &want) < tol, "{level} training {m}x{k}x{n}");
                (y * &u).unwrap().sum_all().unwrap().backward().unwrap()
            });
            let grad = |t: &Tensor| grads.get(t).unwrap().clone();
            assert!(
                rel_diff(&grad(xv.as_tensor()), &want_dx) < tol,
                "{level} dx"
            );
            let dw = grad(&linear.weight.tensor().unwrap());
            assert!(rel_diff(&dw, &want_dw) < tol * 4.0, "{level} dW");
            let bias = linear.bias.as_ref().unwrap().tensor().unwrap();
            assert!(rel_diff(&grad(&bias), &want_db) < tol * 4.0, "{level} db");
        }
    }
}

fn no_grad_call(linear: &Linear, x: &Tensor) -> Tensor {
    let _inference = no_grad();
    linear.call(x).unwrap()
}

/// The exact GELU and the SiLU passes promise the same bits under every build.
#[test]
fn activations_give_the_same_bits_at_every_level() {
    let dev = Device::Cpu;
    let x = (Tensor::randn(0f32, 4., (64, 1000), &dev).unwrap() + 0.5).unwrap();
    let run = |level| {
        with_cpu_capability(level, || {
            let _inference = no_grad();
            (
                bits(&GELU::new().call(&x).unwrap()),
                bits(&SiLU::new().call(&x).unwrap()),
            )
        })
    };
    let portable = run(CpuCapability::Default);
    for level in levels() {
        assert!(run(level) == portable, "{level}");
    }
}

/// Attention's inference pass and training op (forward and backward) at every level, against the
/// composed path.
#[test]
fn attention_matches_the_composed_path_at_every_level() {
    let dev = Device::Cpu;
    let shape = (2, 4, 9, 16);
    let q = Var::randn(0f32, 1., shape, &dev).unwrap();
    let k = Var::randn(0f32, 1., shape, &dev).unwrap();
    let v = Var::randn(0f32, 1., shape, &dev).unwrap();
    let u = Tensor::randn(0f32, 1., shape, &dev).unwrap();
    let options = SdpaOptions {
        is_causal: true,
        ..SdpaOptions::default()
    };
    let run = || {
        let out = scaled_dot_product_attention(&q, &k, &v, None, options).unwrap();
        let grads = (&out * &u).unwrap().sum_all().unwrap().backward().unwrap();
        let inference = {
            let _inference = no_grad();
            let (q, k, v) = (q.detach(), k.detach(), v.detach());
            scaled_dot_product_attention(&q, &k, &v, None, options).unwrap()
        };
        let g = |t: &Var| grads.get(t).unwrap().clone();
        [out, inference, g(&q), g(&k), g(&v)]
    };
    let composed = without_fusion(run);
    for level in levels() {
        let fused = with_cpu_capability(level, run);
        for (i, (a, b)) in fused.iter().zip(&composed).enumerate() {
            assert!(rel_diff(a, b) < 1e-5, "{level}: output {i}");
        }
    }
}

/// The `q8_0` product at every level: candle's kernel at the portable level, this crate's AVX2 and
/// AVX-512 VNNI loops above it. Each rounds the input to 8 bits (in its own way: candle keeps each
/// block's scale in float16), so each is held to the float product with the dequantized weight
/// within that rounding, and this crate's loops to one another within float32 rounding.
#[test]
fn quantized_products_agree_at_every_level() {
    let dev = Device::Cpu;
    let linear = Linear::new(256, 48, &dev).unwrap();
    let report = quantize(&linear, "**", GgmlDType::Q8_0).unwrap();
    assert_eq!(report.quantized, [""], "the layer itself is quantized");
    let weight = linear.weight.tensor().unwrap();
    let bias = linear.bias.as_ref().unwrap().tensor().unwrap();
    for rows in [1, 5] {
        let x = Tensor::randn(0f32, 1., (rows, 256), &dev).unwrap();
        let float = x
            .matmul(&weight.t().unwrap())
            .unwrap()
            .broadcast_add(&bias)
            .unwrap();
        let mut ours = Vec::new();
        for level in levels() {
            let y = with_cpu_capability(level, || no_grad_call(&linear, &x));
            let d = rel_diff(&y, &float);
            assert!(d < 3e-2, "{level}, {rows} rows: {d} from the float product");
            if level >= CpuCapability::Avx2 {
                ours.push((level, y));
            }
        }
        for pair in ours.windows(2) {
            let d = rel_diff(&pair[1].1, &pair[0].1);
            assert!(d < 1e-5, "{} against {}: {d}", pair[1].0, pair[0].0);
        }
    }
}

/// AdamW's fused step over a parameter large enough to be split over threads: the same bits at
/// every level.
#[test]
fn the_optimizer_step_gives_the_same_bits_at_every_level() {
    let dev = Device::Cpu;
    let start = Tensor::randn(0f32, 1., (200, 250), &dev).unwrap();
    let grads_from = |linear: &Linear| {
        let x = Tensor::ones((8, 250), DType::F32, &dev).unwrap();
        let loss = with_cpu_capability(CpuCapability::Default, || {
            linear.call(&x).unwrap().sqr().unwrap().sum_all().unwrap()
        });
        loss.backward().unwrap()
    };
    let stepped = |level| {
        let linear = Linear::from_tensors(start.clone(), None).unwrap();
        let mut opt = AdamW::new(&linear, AdamW::options().lr(0.01)).unwrap();
        for _ in 0..3 {
            let grads = grads_from(&linear);
            with_cpu_capability(level, || opt.step(&grads)).unwrap();
        }
        bits(&linear.weight.tensor().unwrap())
    };
    let portable = stepped(CpuCapability::Default);
    for level in levels() {
        assert!(stepped(level) == portable, "{level}");
    }
}

/// Bfloat16 `Linear` products (a bfloat16 layer, and a float32 one under `autocast` to bfloat16),
/// forward and the three gradients, on the AVX512-BF16 kernel where the CPU has it and on the
/// float32 kernels under every lower level, against float64 products of the bfloat16-rounded
/// operands: within bfloat16 rounding of the output (2⁻⁸ of the largest value, plus the sums'
/// order).
#[test]
fn bfloat16_linear_forward_and_backward_on_every_implementation() {
    use module_runtime::amp::autocast;
    let dev = Device::Cpu;
    let round = |t: &Tensor| {
        t.to_dtype(DType::BF16)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap()
    };
    let x = Var::randn(0f32, 1.0, (3, 7, 45), &dev).unwrap();
    let fc = Linear::new(45, 70, &dev).unwrap();
    let (w, b) = (
        fc.weight.tensor().unwrap(),
        fc.bias.as_ref().unwrap().tensor().unwrap(),
    );
    let g = Tensor::randn(0f32, 1.0, (3, 7, 70), &dev).unwrap();
    // float64 references from the rounded operands: y = x Wᵀ + b, dx = g W, dW = gᵀ x, db = Σ g.
    let (x64, w64, g64) = (round(x.as_tensor()), round(&w), round(&g));
    let want_y = x64
        .broadcast_matmul(&w64.t().unwrap())
        .unwrap()
        .broadcast_add(&round(&b))
        .unwrap();
    let want_dx = g64.broadcast_matmul(&w64).unwrap();
    let (g2, x2) = (
        g64.reshape((21, 70)).unwrap(),
        x64.reshape((21, 45)).unwrap(),
    );
    let want_dw = g2.t().unwrap().matmul(&x2).unwrap();
    let want_db = g2.sum(0).unwrap();
    let bf16_fc = Linear::from_tensors(
        w.to_dtype(DType::BF16).unwrap(),
        Some(b.to_dtype(DType::BF16).unwrap()),
    )
    .unwrap();
    println!("kernels: {}", kernel_choice());
    for level in levels() {
        for amp in [true, false] {
            let (y, grads) = with_cpu_capability(level, || {
                let y = match amp {
                    true => autocast("cpu", DType::BF16, || fc.call(x.as_tensor())).unwrap(),
                    false => bf16_fc.call(&x.to_dtype(DType::BF16).unwrap()).unwrap(),
                };
                let loss = (y.to_dtype(DType::F32).unwrap() * &g)
                    .unwrap()
                    .sum_all()
                    .unwrap();
                (y, loss.backward().unwrap())
            });
            assert_eq!(y.dtype(), DType::BF16, "{level} autocast {amp}");
            let tol = 2f64.powi(-7);
            assert!(
                rel_diff(&y, &want_y) < tol,
                "{level} autocast {amp}: output"
            );
            assert!(
                rel_diff(grads.get(&x).unwrap(), &want_dx) < tol,
                "{level} {amp}: dx"
            );
            if amp {
                let dw = grads.get(&fc.weight.var().unwrap()).unwrap();
                let db = grads
                    .get(&fc.bias.as_ref().unwrap().var().unwrap())
                    .unwrap();
                assert_eq!(dw.dtype(), DType::F32);
                assert!(rel_diff(dw, &want_dw) < tol, "{level}: dW");
                assert!(rel_diff(db, &want_db) < tol, "{level}: db");
            }
        }
    }
}
