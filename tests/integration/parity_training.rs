//! Optimizer traces against PyTorch: an MLP written with `#[derive(Module)]`, trained for 20 steps
//! with candle's own `SGD` and `AdamW` on `model.trainable_vars()`, must follow PyTorch's losses step
//! by step and end at PyTorch's weights.
//!
//! Tolerance: 1e-5 absolute plus 1e-5 relative (the traces are within 4e-7 of a float64 rerun).

use candle_module::fixtures::{assert_close, Fixture};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, SGD};
use module_runtime::prelude::*;

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.call(x)?.relu()?;
        self.fc2.call(&h)
    }
}

/// Runs the 20 steps of `fixture` with the optimizer `make_opt` builds, and compares the trace.
fn check_trace<O: Optimizer>(name: &str, make_opt: impl FnOnce(Vec<candle_core::Var>) -> O) {
    let fx = Fixture::load(name);
    let dev = dev();
    let model = Mlp {
        fc1: Linear::new(64, 32, &dev).unwrap(),
        fc2: Linear::new(32, 10, &dev).unwrap(),
    };
    fx.load_state(&model);
    let mut opt = make_opt(model.trainable_vars().unwrap());
    let x = fx.get("input");
    let target = fx.get("target");
    let loss_of = |m: &Mlp| candle_nn::loss::cross_entropy(&m.call(&x).unwrap(), &target).unwrap();

    let (mut losses, mut losses_post) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let loss = loss_of(&model);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
        losses_post.push(loss_of(&model).to_scalar::<f32>().unwrap());
    }
    assert_close(
        "losses",
        &Tensor::new(losses, &dev).unwrap(),
        &fx.get("losses"),
    );
    assert_close(
        "losses_post",
        &Tensor::new(losses_post, &dev).unwrap(),
        &fx.get("losses_post"),
    );
    for key in fx.keys_under("after.") {
        let p = model.get_parameter(&key).unwrap();
        assert_close(&key, &p.tensor().unwrap(), &fx.get(&format!("after.{key}")));
    }
    fx.assert_all_used();
}

#[test]
fn mlp_sgd_trace() {
    check_trace("mlp_sgd_trace", |vars| SGD::new(vars, 0.1).unwrap());
}

#[test]
fn adamw_trace() {
    check_trace("adamw_trace", |vars| {
        let params = ParamsAdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        AdamW::new(vars, params).unwrap()
    });
}
