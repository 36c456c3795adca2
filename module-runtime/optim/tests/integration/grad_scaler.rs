//! `GradScaler` against PyTorch's `torch.amp.GradScaler`: `fixtures/pytorch/swa/
//! grad_scaler.safetensors` (`fixtures/make_swa_fixtures.py`) holds 8 steps of
//! `scaler.scale(loss).backward(); scaler.step(opt); scaler.update()` with SGD (momentum 0.9) and
//! `growth_interval=3`, step 2's input holding an inf; `grad_scaler.pt` the scaler's state dict
//! after them. Here the same run must skip the same step (parameters and momentum untouched to
//! the bit, the scale halved), grow the scale after 3 clean steps, and end with PyTorch's
//! parameters (within 1e-6) and state.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::nn::Linear;
use module_runtime::optim::{
    read_pth_grad_scaler_state, Error, GradScaler, GradScalerOptions, Optimizer, SgdOptions,
    StateError, TrainerState, TrainingCheckpoint, SGD,
};
use module_runtime::prelude::*;
use module_runtime::PthValues;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/pytorch/swa")
        .join(name)
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("grad_scaler.safetensors"), &Device::Cpu).unwrap()
}

fn values(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1::<f32>().unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    let a = values(a);
    let b = values(b);
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn model(r: &HashMap<String, Tensor>) -> Linear {
    let fc = Linear::new(3, 2, &Device::Cpu).unwrap();
    fc.weight.set(&r["init.weight"]).unwrap();
    fc.bias.as_ref().unwrap().set(&r["init.bias"]).unwrap();
    fc
}

fn scaler() -> GradScaler {
    GradScaler::new(GradScalerOptions::default().growth_interval(3)).unwrap()
}

fn state_value(sd: &StateDict, key: &str) -> f64 {
    sd.get(key)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

#[test]
fn skips_the_inf_step_and_grows_the_scale_as_pytorch() {
    let r = reference();
    let fc = model(&r);
    let mut opt = SGD::new(&fc, SgdOptions::new(0.05).momentum(0.9)).unwrap();
    let mut scaler = scaler();
    assert_eq!(scaler.get_scale(), 65536.0);
    for k in 0..8 {
        let (x, y) = (&r[&format!("input.{k}")], &r[&format!("target.{k}")]);
        let before = (fc.weight.tensor().unwrap(), opt.state_dict().unwrap());
        let loss = (fc.call(x).unwrap() - y)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
        let stepped = scaler.step(&mut opt, &mut grads).unwrap();
        scaler.update(None).unwrap();
        assert_eq!(stepped, k != 2, "step {k}");
        if k == 2 {
            // Skipped: the parameters and the optimizer's state are untouched, to the bit.
            assert_eq!(values(&fc.weight.tensor().unwrap()), values(&before.0));
            let after = opt.state_dict().unwrap();
            assert_eq!(after.len(), before.1.len());
            for (key, t) in after.iter() {
                assert_eq!(
                    values(t.to_dtype(DType::F32).as_ref().unwrap()),
                    values(
                        before
                            .1
                            .get(key)
                            .unwrap()
                            .to_dtype(DType::F32)
                            .as_ref()
                            .unwrap()
                    ),
                    "{key}"
                );
            }
        }
        let w = fc.weight.tensor().unwrap();
        let b = fc.bias.as_ref().unwrap().tensor().unwrap();
        assert!(
            max_diff(&w, &r[&format!("step{k}.weight")]) <= 1e-6,
            "step {k}"
        );
        assert!(
            max_diff(&b, &r[&format!("step{k}.bias")]) <= 1e-6,
            "step {k}"
        );
        let sd = opt.state_dict().unwrap();
        for name in ["weight", "bias"] {
            let theirs = &r[&format!("step{k}.momentum.{name}")];
            match sd.get(&format!("state.{name}.momentum_buffer")) {
                Some(ours) => assert!(max_diff(ours, theirs) <= 1e-6, "step {k} {name}"),
                None => assert!(values(theirs).iter().all(|v| *v == 0.0)),
            }
        }
        let scale = r[&format!("step{k}.scale")].to_scalar::<f64>().unwrap();
        assert_eq!(scaler.get_scale(), scale, "step {k}");
        let tracker = r[&format!("step{k}.growth_tracker")]
            .to_scalar::<i64>()
            .unwrap();
        assert_eq!(
            state_value(&scaler.state_dict().unwrap(), "_growth_tracker"),
            tracker as f64
        );
    }
    // The scale halved at step 2, then grew back after 3 clean steps.
    assert_eq!(scaler.get_scale(), 65536.0);

    // PyTorch's saved state dict reads into the one we have, key for key.
    let ckpt = PthValues::load(fixture("grad_scaler.pt")).unwrap();
    let theirs = read_pth_grad_scaler_state(ckpt.get("scaler").unwrap()).unwrap();
    let ours = scaler.state_dict().unwrap();
    assert_eq!(
        ours.keys().collect::<Vec<_>>(),
        theirs.keys().collect::<Vec<_>>()
    );
    for (key, t) in ours.iter() {
        assert_eq!(state_value(&theirs, key), state_value(&ours, key), "{key}");
        assert_eq!(t.dtype(), theirs.get(key).unwrap().dtype(), "{key}");
    }
}

#[test]
fn pytorch_state_loads_and_round_trips_through_a_training_checkpoint() {
    let ckpt = PthValues::load(fixture("grad_scaler.pt")).unwrap();
    let state = read_pth_grad_scaler_state(ckpt.get("scaler").unwrap()).unwrap();
    let mut scaler = GradScaler::new(GradScalerOptions::default().init_scale(4.0)).unwrap();
    scaler.load_state_dict(&state).unwrap();
    assert_eq!(scaler.get_scale(), 65536.0);
    assert_eq!(scaler.get_growth_interval(), 3);
    assert_eq!(
        state_value(&scaler.state_dict().unwrap(), "_growth_tracker"),
        2.0
    );

    let dev = Device::Cpu;
    let fc = Linear::new(3, 2, &dev).unwrap();
    let mut opt = SGD::new(&fc, SgdOptions::new(0.1)).unwrap();
    let path = std::env::temp_dir().join(format!("scaler-{}.safetensors", std::process::id()));
    TrainingCheckpoint::new(&fc)
        .optimizer(&mut opt)
        .grad_scaler(&mut scaler)
        .save(&path, &TrainerState::default())
        .unwrap();
    let keys: Vec<String> = StateDict::read(&path, &LoadOptions::default())
        .unwrap()
        .keys()
        .filter(|k| k.starts_with("grad_scaler."))
        .map(String::from)
        .collect();
    assert_eq!(keys.len(), 5, "{keys:?}");
    let mut fresh = GradScaler::new(GradScalerOptions::default()).unwrap();
    let mut opt2 = SGD::new(&fc, SgdOptions::new(0.1)).unwrap();
    TrainingCheckpoint::new(&fc)
        .optimizer(&mut opt2)
        .grad_scaler(&mut fresh)
        .load(&path)
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(fresh.get_scale(), 65536.0);
    assert_eq!(fresh.get_growth_interval(), 3);
    assert_eq!(
        state_value(&fresh.state_dict().unwrap(), "_growth_tracker"),
        2.0
    );
}

#[test]
fn bad_states_are_refused_and_change_nothing() {
    let mut scaler = scaler();
    let before = scaler.state_dict().unwrap();
    let err = scaler.load_state_dict(&StateDict::new()).unwrap_err();
    assert!(
        err.to_string().contains("disabled instance of GradScaler"),
        "{err}"
    );
    let mut extra = before.clone();
    extra.insert("foo", Tensor::new(1f64, &Device::Cpu).unwrap());
    let err = scaler.load_state_dict(&extra).unwrap_err();
    assert!(
        matches!(err, Error::State(StateError::UnexpectedKeys { .. })),
        "{err}"
    );
    let mut bad = before.clone();
    bad.insert("_growth_tracker", Tensor::new(-1f64, &Device::Cpu).unwrap());
    let err = scaler.load_state_dict(&bad).unwrap_err();
    assert!(err.to_string().contains("_growth_tracker"), "{err}");
    let after = scaler.state_dict().unwrap();
    for (key, _) in before.iter() {
        assert_eq!(state_value(&after, key), state_value(&before, key), "{key}");
    }
}

#[test]
fn misuse_is_reported_as_pytorch_reports_it() {
    let dev = Device::Cpu;
    let fc = Linear::new(3, 2, &dev).unwrap();
    let mut opt = SGD::new(&fc, SgdOptions::new(0.1)).unwrap();
    let mut scaler = scaler();
    let x = Tensor::ones((2, 3), DType::F32, &dev).unwrap();
    let loss = fc.call(&x).unwrap().sum_all().unwrap();
    // update before any scale: no scale yet.
    assert!(scaler.update(None).is_err());
    let mut grads = scaler.scale(&loss).unwrap().backward().unwrap();
    // update before any unscale_ or step: no inf checks.
    let err = scaler.update(None).unwrap_err();
    assert!(
        err.to_string()
            .contains("No inf checks were recorded prior to update"),
        "{err}"
    );
    // unscale_ divides the gradient by the scale (2^16, exactly).
    let scaled = grads
        .get(fc.weight.var().unwrap().as_tensor())
        .unwrap()
        .clone();
    scaler.unscale_(&opt, &mut grads).unwrap();
    let unscaled = grads
        .get(fc.weight.var().unwrap().as_tensor())
        .unwrap()
        .clone();
    assert_eq!(values(&(scaled / 65536.0).unwrap()), values(&unscaled));
    let err = scaler.unscale_(&opt, &mut grads).unwrap_err();
    assert!(
        err.to_string()
            .contains("already been called on this optimizer"),
        "{err}"
    );
    assert!(scaler.step(&mut opt, &mut grads).unwrap());
    let err = scaler.step(&mut opt, &mut grads).unwrap_err();
    assert!(matches!(err, Error::GradScaler { .. }), "{err}");
    scaler.update(None).unwrap();
    // The optimizer's gradients missing from the store: nothing to check.
    let mut empty = candle_core::backprop::GradStore::default();
    let _ = scaler.scale(&loss).unwrap();
    let err = scaler.step(&mut opt, &mut empty).unwrap_err();
    assert!(
        err.to_string()
            .contains("No inf checks were recorded for this optimizer"),
        "{err}"
    );
    // A new scale, set by hand.
    scaler.update(Some(8.0)).unwrap();
    assert_eq!(scaler.get_scale(), 8.0);
}

#[test]
fn float16_gradients_are_refused_untouched() {
    let dev = Device::Cpu;
    let fc = Linear::new(3, 2, &dev).unwrap();
    fc.to_dtype(DType::F16).unwrap();
    let mut opt = SGD::new(&fc, SgdOptions::new(0.1)).unwrap();
    let mut scaler = GradScaler::new(GradScalerOptions::default().init_scale(4.0)).unwrap();
    let x = Tensor::ones((2, 3), DType::F16, &dev).unwrap();
    let loss = fc.call(&x).unwrap().sum_all().unwrap();
    let scaled = scaler.scale(&loss).unwrap();
    // A 0-dimensional float16 loss times the float32 scale is float32, as in PyTorch.
    assert_eq!(scaled.dtype(), DType::F32);
    let mut grads = scaled.backward().unwrap();
    let w = fc.weight.var().unwrap();
    let before = grads
        .get(w.as_tensor())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let err = scaler.unscale_(&opt, &mut grads).unwrap_err();
    assert!(
        err.to_string()
            .contains("Attempting to unscale FP16 gradients"),
        "{err}"
    );
    let after = grads
        .get(w.as_tensor())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    assert_eq!(values(&before), values(&after));
    assert!(scaler.step(&mut opt, &mut grads).is_err());
}

#[test]
fn a_disabled_scaler_only_steps() {
    let dev = Device::Cpu;
    let fc = Linear::new(3, 2, &dev).unwrap();
    let mut opt = SGD::new(&fc, SgdOptions::new(0.1)).unwrap();
    let mut scaler = GradScaler::new(GradScalerOptions::default().enabled(false)).unwrap();
    let x = Tensor::ones((2, 3), DType::F32, &dev).unwrap();
    let loss = fc.call(&x).unwrap().sum_all().unwrap();
    let scaled = scaler.scale(&loss).unwrap();
    assert_eq!(
        scaled.to_scalar::<f32>().unwrap(),
        loss.to_scalar::<f32>().unwrap()
    );
    let before = values(&fc.weight.tensor().unwrap());
    let mut grads = scaled.backward().unwrap();
    assert!(scaler.step(&mut opt, &mut grads).unwrap());
    scaler.update(None).unwrap();
    assert_ne!(values(&fc.weight.tensor().unwrap()), before);
    assert_eq!(scaler.get_scale(), 1.0);
    assert!(scaler.state_dict().unwrap().is_empty());
}

#[test]
fn invalid_options_are_refused() {
    for (options, name) in [
        (
            GradScalerOptions::default().growth_factor(1.0),
            "growth_factor",
        ),
        (
            GradScalerOptions::default().backoff_factor(1.0),
            "backoff_factor",
        ),
        (
            GradScalerOptions::default().growth_interval(0),
            "growth_interval",
        ),
    ] {
        match GradScaler::new(options) {
            Err(Error::InvalidHyperparameter { name: n, .. }) => assert_eq!(n, name),
            other => panic!("{name}: {:?}", other.map(|_| ())),
        }
    }
}

/// A layer that computes in float16 on float32 master weights (what `autocast` does to a
/// product): the gradients that reach the weights went through float16.
#[derive(Module)]
struct HalfLinear {
    weight: Param,
}

impl Forward<&Tensor> for HalfLinear {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let w = self.weight.tensor()?.to_dtype(DType::F16)?;
        let y = x.to_dtype(DType::F16)?.matmul(&w.t()?)?;
        Ok(y.to_dtype(DType::F32)?)
    }
}

#[test]
fn scaling_keeps_float16_gradients_that_would_flush_to_zero() {
    let dev = Device::Cpu;
    let layer = HalfLinear {
        weight: Param::new(Tensor::ones((2, 3), DType::F32, &dev).unwrap()).unwrap(),
    };
    let x = Tensor::ones((4, 3), DType::F32, &dev).unwrap();
    // d loss / d output = 1e-8, below float16's smallest subnormal (6e-8).
    let loss = || (layer.call(&x).unwrap().sum_all().unwrap() * 1e-8).unwrap();
    let w = layer.weight.var().unwrap();
    let plain = loss().backward().unwrap();
    let g = plain.get(w.as_tensor()).unwrap();
    assert!(values(g).iter().all(|v| *v == 0.0), "float16 flushed them");

    let mut opt = SGD::new(&layer, SgdOptions::new(1.0)).unwrap();
    let mut scaler = GradScaler::new(GradScalerOptions::default()).unwrap();
    let mut grads = scaler.scale(&loss()).unwrap().backward().unwrap();
    scaler.unscale_(&opt, &mut grads).unwrap();
    // 4 rows of 1e-8 each, within float16's rounding of the scaled value.
    for v in values(grads.get(w.as_tensor()).unwrap()) {
        assert!((v - 4e-8).abs() < 4e-8 * 1e-3, "{v}");
    }
    assert!(scaler.step(&mut opt, &mut grads).unwrap());
    scaler.update(None).unwrap();
    assert!(values(&layer.weight.tensor().unwrap())
        .iter()
        .all(|v| *v < 1.0));
}
