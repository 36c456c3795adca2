//! Float16 and bfloat16 parameters: their state is float32, the update runs in float32 on the
//! parameter's value and gradient and its result is rounded into the parameter, on the fused and
//! the composed path alike.

use module_runtime::optim::{AdamW, Optimizer, SgdOptions, SGD};
use module_runtime::prelude::*;

/// A half-precision layer, and a float32 one with its values.
fn layers(dtype: DType) -> (Linear, Linear) {
    let dev = Device::Cpu;
    let half = Linear::new(8, 4, &dev).unwrap();
    half.to_dtype(dtype).unwrap();
    let f32_of = |p: &Param| p.tensor().unwrap().to_dtype(DType::F32).unwrap();
    let full = Linear::from_tensors(f32_of(&half.weight), half.bias.as_ref().map(f32_of)).unwrap();
    (half, full)
}

/// The two layers' parameters, side by side.
fn pairs<'a>(half: &'a Linear, full: &'a Linear) -> [(&'a Param, &'a Param); 2] {
    [
        (&half.weight, &full.weight),
        (half.bias.as_ref().unwrap(), full.bias.as_ref().unwrap()),
    ]
}

/// One step of `opt_half` on `half` from a loss in its dtype, and of `opt_full` on `full` from a
/// loss whose gradients are the same values in float32.
fn step_both(
    half: &Linear,
    full: &Linear,
    opt_half: &mut dyn Optimizer,
    opt_full: &mut dyn Optimizer,
    k: f64,
) {
    let dtype = half.weight.tensor().unwrap().dtype();
    let x = Tensor::arange(0f32, 24., &Device::Cpu)
        .unwrap()
        .reshape((3, 8))
        .unwrap()
        .affine(k / 24., 0.)
        .unwrap();
    let loss = half
        .call(&x.to_dtype(dtype).unwrap())
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap();
    let grads = loss.backward().unwrap();
    // The float32 loss Σ p·G has the half gradients G, converted exactly, as its gradients.
    let mut surrogate = Tensor::new(0f32, &Device::Cpu).unwrap();
    for (hp, fp) in pairs(half, full) {
        let g = grads.get(&hp.tensor().unwrap()).unwrap();
        assert_eq!(g.dtype(), dtype);
        let g = g.to_dtype(DType::F32).unwrap();
        let term = fp.tensor().unwrap().mul(&g).unwrap().sum_all().unwrap();
        surrogate = surrogate.add(&term).unwrap();
    }
    let full_grads = surrogate.backward().unwrap();
    opt_half.step(&grads).unwrap();
    opt_full.step(&full_grads).unwrap();
}

fn values(p: &Param) -> Vec<f32> {
    p.tensor()
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The half model after each step is the float32 model's values rounded to its dtype (both start
/// equal and see the same gradients; only the rounding of the result differs). Then the float32
/// model takes those rounded values, as the half one holds them, for the next step.
fn check_and_align(half: &Linear, full: &Linear, dtype: DType) {
    for (hp, fp) in pairs(half, full) {
        assert_eq!(hp.tensor().unwrap().dtype(), dtype);
        let rounded = fp
            .tensor()
            .unwrap()
            .to_dtype(dtype)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap();
        assert_eq!(
            values(hp),
            rounded.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
        fp.set(&rounded).unwrap();
    }
}

#[test]
fn adamw_keeps_float32_state_for_half_parameters() {
    for dtype in [DType::F16, DType::BF16] {
        for fused in [true, false] {
            let (half, full) = layers(dtype);
            let options = AdamW::options().lr(1e-2).amsgrad(true);
            let mut opt_half = AdamW::new(&half, options.clone()).unwrap();
            let mut opt_full = AdamW::new(&full, options).unwrap();
            opt_half.set_fused(fused);
            opt_full.set_fused(fused);
            for k in [1.0, -0.5, 2.0] {
                step_both(&half, &full, &mut opt_half, &mut opt_full, k);
                check_and_align(&half, &full, dtype);
            }
            let sd = opt_half.state_dict().unwrap();
            for key in [
                "state.weight.exp_avg",
                "state.weight.exp_avg_sq",
                "state.bias.max_exp_avg_sq",
            ] {
                let t = sd
                    .get(key)
                    .unwrap_or_else(|| panic!("{key} in the state dict"));
                assert_eq!(t.dtype(), DType::F32, "{key} ({dtype:?}, fused {fused})");
            }
            // Loaded back, the state stays float32.
            let mut again = AdamW::new(&half, AdamW::options().lr(1e-2).amsgrad(true)).unwrap();
            again.load_state_dict(&sd).unwrap();
            assert_eq!(
                again
                    .state_dict()
                    .unwrap()
                    .get("state.weight.exp_avg")
                    .unwrap()
                    .dtype(),
                DType::F32
            );
        }
    }
}

#[test]
fn sgd_momentum_keeps_float32_state_for_half_parameters() {
    for dtype in [DType::F16, DType::BF16] {
        for fused in [true, false] {
            let (half, full) = layers(dtype);
            let options = SgdOptions::new(0.1).momentum(0.9).nesterov(true);
            let mut opt_half = SGD::new(&half, options.clone()).unwrap();
            let mut opt_full = SGD::new(&full, options).unwrap();
            opt_half.set_fused(fused);
            opt_full.set_fused(fused);
            for k in [1.0, 0.5] {
                step_both(&half, &full, &mut opt_half, &mut opt_full, k);
                check_and_align(&half, &full, dtype);
            }
            let sd = opt_half.state_dict().unwrap();
            let buffer = sd
                .get("state.weight.momentum_buffer")
                .expect("a momentum buffer");
            assert_eq!(buffer.dtype(), DType::F32);
        }
    }
}
