//! Optimizer traces against PyTorch (the repository's `fixtures/pytorch/`, the same files the root
//! package's parity tests read): an MLP trained for 20 steps with `SGD(lr=0.1)` and
//! `AdamW(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)` must follow PyTorch's losses
//! step by step and end at PyTorch's weights, through the fused and the composed update alike.
//!
//! Tolerance: 1e-5 absolute plus 1e-5 relative (the traces are within 4e-7 of a float64 rerun).

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::candle_nn::loss::cross_entropy;
use module_runtime::optim::{Adam, AdamW, Optimizer, SgdOptions, SGD};
use module_runtime::prelude::*;

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

fn fixture(name: &str) -> HashMap<String, Tensor> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/pytorch")
        .join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &Device::Cpu).expect("the fixture reads")
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
    let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    let max = got
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs())
        .fold(0f32, f32::max);
    eprintln!("{what}: largest difference from PyTorch {max:e}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let tol = 1e-5 + 1e-5 * w.abs();
        assert!(
            (g - w).abs() <= tol,
            "{what}[{i}]: got {g}, PyTorch {w} (difference {})",
            (g - w).abs()
        );
    }
}

/// The MLP with the fixture's initial parameters.
fn model(fx: &HashMap<String, Tensor>) -> Mlp {
    let dev = Device::Cpu;
    let model = Mlp {
        fc1: Linear::new(64, 32, &dev).unwrap(),
        fc2: Linear::new(32, 10, &dev).unwrap(),
    };
    for (path, p) in model.named_parameters() {
        p.set(&fx[&format!("param.{path}")]).unwrap();
    }
    model
}

/// Runs the fixture's 20 steps with `opt` and compares the trace.
fn check_trace(name: &str, make: impl FnOnce(&Mlp) -> Box<dyn Optimizer>) {
    let fx = fixture(name);
    let model = model(&fx);
    let mut opt = make(&model);
    let (x, target) = (&fx["input"], &fx["target"]);
    let loss_of = |m: &Mlp| cross_entropy(&m.call(x).unwrap(), target).unwrap();
    let (mut losses, mut losses_post) = (Vec::new(), Vec::new());
    for _ in 0..20 {
        let loss = loss_of(&model);
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
        losses_post.push(loss_of(&model).to_scalar::<f32>().unwrap());
    }
    let dev = Device::Cpu;
    assert_close("losses", &Tensor::new(losses, &dev).unwrap(), &fx["losses"]);
    assert_close(
        "losses_post",
        &Tensor::new(losses_post, &dev).unwrap(),
        &fx["losses_post"],
    );
    for (path, p) in model.named_parameters() {
        assert_close(&path, &p.tensor().unwrap(), &fx[&format!("after.{path}")]);
    }
}

#[test]
fn sgd_trace_fused() {
    check_trace("mlp_sgd_trace", |m| {
        Box::new(SGD::new(m, SgdOptions::new(0.1)).unwrap())
    });
}

#[test]
fn sgd_trace_composed() {
    check_trace("mlp_sgd_trace", |m| {
        let mut opt = SGD::new(m, SgdOptions::new(0.1)).unwrap();
        opt.set_fused(false);
        Box::new(opt)
    });
}

fn adamw(m: &Mlp, fused: bool) -> AdamW {
    let options = AdamW::options().lr(1e-2).betas(0.9, 0.999).eps(1e-8);
    let mut opt = AdamW::new(m, options.weight_decay(0.01)).unwrap();
    opt.set_fused(fused);
    opt
}

#[test]
fn adamw_trace_fused() {
    check_trace("adamw_trace", |m| Box::new(adamw(m, true)));
}

#[test]
fn adamw_trace_composed() {
    check_trace("adamw_trace", |m| Box::new(adamw(m, false)));
}

/// `Adam` with `decoupled_weight_decay` is AdamW, as in PyTorch.
#[test]
fn adam_decoupled_is_adamw() {
    check_trace("adamw_trace", |m| {
        let options = Adam::options()
            .lr(1e-2)
            .weight_decay(0.01)
            .decoupled_weight_decay(true);
        Box::new(Adam::new(m, options).unwrap())
    });
}
