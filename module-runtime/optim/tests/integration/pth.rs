//! A training run started in PyTorch and continued here: `fixtures/pytorch/optim/` holds, per
//! case, a training checkpoint `{"epoch", "model", "optimizer"}` saved after 3 PyTorch steps and
//! the losses and parameters after 3 more (`fixtures/make_optim_pth_fixtures.py`). The model and
//! the optimizer state are read from the checkpoint, the 3 steps run here, and both must match
//! PyTorch's (1e-5 absolute plus 1e-5 relative). And the errors when the optimizer was not made
//! as PyTorch's was.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::nn::LayerNorm;
use module_runtime::optim::{
    read_pth_state, AdamW, Error, Optimizer, ParamGroups, SgdOptions, StateError, SGD,
};
use module_runtime::prelude::*;

/// `Net` of the fixture script: fc1 Linear(6, 8), norm LayerNorm(8), fc2 Linear(8, 3), tanh.
#[derive(Module)]
struct Net {
    fc1: Linear,
    norm: LayerNorm,
    fc2: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.norm.call(&self.fc1.call(x)?)?.tanh()?)
    }
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/pytorch/optim")
}

fn checkpoint(case: &str) -> PathBuf {
    dir().join(format!("{case}.pt"))
}

/// The model as the checkpoint saved it (strictly, from its `model` entry).
fn net(case: &str) -> Net {
    let dev = Device::Cpu;
    let net = Net {
        fc1: Linear::new(6, 8, &dev).unwrap(),
        norm: LayerNorm::new(8, &dev).unwrap(),
        fc2: Linear::new(8, 3, &dev).unwrap(),
    };
    net.load_state_dict(checkpoint(case), &LoadOptions::default().nested_in("model"))
        .unwrap();
    net
}

fn reference(case: &str) -> HashMap<String, Tensor> {
    let path = dir().join(format!("{case}_reference.safetensors"));
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

fn assert_close(what: &str, got: &Tensor, want: &Tensor) {
    let got: Vec<f32> = got.flatten_all().unwrap().to_vec1().unwrap();
    let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-5 + 1e-5 * w.abs(),
            "{what}[{i}]: got {g}, PyTorch {w}"
        );
    }
}

/// Loads the checkpoint's optimizer state into `opt`, runs the 3 later steps and compares.
fn continue_run(case: &str, model: &Net, opt: &mut dyn Optimizer) {
    let state = read_pth_state(checkpoint(case), Some("optimizer"), &*opt).unwrap();
    opt.load_state_dict(&state).unwrap();
    let fx = reference(case);
    let mut losses = Vec::new();
    for _ in 0..3 {
        let out = model.call(&fx["input"]).unwrap();
        let loss = (out - &fx["target"])
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        losses.push(loss.to_scalar::<f32>().unwrap());
        opt.backward_step(&loss).unwrap();
    }
    assert_close(
        "losses",
        &Tensor::new(losses, &Device::Cpu).unwrap(),
        &fx["losses"],
    );
    for (path, p) in model.named_parameters() {
        assert_close(&path, &p.tensor().unwrap(), &fx[&format!("param.{path}")]);
    }
}

/// Hugging Face's groups as the fixture script lists them: decay first, then no decay.
fn hf_groups() -> ParamGroups {
    ParamGroups::new()
        .rest(|g| g)
        .group(["**.bias", "norm.weight"], |g| g.weight_decay(0.0))
}

/// AdamW with AMSGrad over two groups: the hyperparameters come from the file (the optimizer is
/// made with others), the moments, `max_exp_avg_sq` and step counts from its state.
#[test]
fn adamw_groups_continue() {
    let model = net("adamw_groups");
    let mut opt = AdamW::with_groups(&model, AdamW::options().lr(0.5), &hf_groups()).unwrap();
    continue_run("adamw_groups", &model, &mut opt);
    assert_eq!(opt.lrs(), vec![1e-2, 1e-2]);
    assert!(opt.param_groups()[0].options.amsgrad);
    assert_eq!(opt.param_groups()[0].options.weight_decay, 0.1);
    assert_eq!(opt.param_groups()[1].options.weight_decay, 0.0);
}

/// SGD with Nesterov momentum and weight decay, one group over `model.parameters()`.
#[test]
fn sgd_nesterov_continue() {
    let model = net("sgd_nesterov");
    let options = SgdOptions::new(0.05)
        .momentum(0.9)
        .nesterov(true)
        .weight_decay(1e-3);
    let mut opt = SGD::new(&model, options).unwrap();
    continue_run("sgd_nesterov", &model, &mut opt);
}

/// The state of parameter `i` lands on `param_paths()[i]`: with the groups in another order, the
/// shapes no longer fit, and the load is refused without changing the optimizer.
#[test]
fn groups_in_another_order_are_refused() {
    let model = net("adamw_groups");
    let groups = ParamGroups::new()
        .group(["**.bias", "norm.weight"], |g| g.weight_decay(0.0))
        .rest(|g| g);
    let opt = AdamW::with_groups(&model, AdamW::options(), &groups).unwrap();
    // Group 0 now has 4 parameters, PyTorch's 2.
    let err = read_pth_state(checkpoint("adamw_groups"), Some("optimizer"), &opt).unwrap_err();
    assert!(
        matches!(
            err,
            Error::State(StateError::ParamCount {
                group: 0,
                expected: 4,
                found: 2
            })
        ),
        "{err}"
    );
    assert!(
        err.to_string().contains("same groups, in the same order"),
        "{err}"
    );
}

#[test]
fn another_number_of_groups_is_refused() {
    let model = net("adamw_groups");
    let opt = AdamW::new(&model, AdamW::options()).unwrap();
    let err = read_pth_state(checkpoint("adamw_groups"), Some("optimizer"), &opt).unwrap_err();
    assert!(
        matches!(
            err,
            Error::State(StateError::GroupCount {
                expected: 1,
                found: 2
            })
        ),
        "{err}"
    );
}

/// Same counts, other sizes: the state tensors do not fit, and nothing changes.
#[test]
fn state_of_another_shape_is_refused_and_nothing_changes() {
    let dev = Device::Cpu;
    let other = Net {
        fc1: Linear::new(6, 4, &dev).unwrap(),
        norm: LayerNorm::new(4, &dev).unwrap(),
        fc2: Linear::new(4, 3, &dev).unwrap(),
    };
    let options = SgdOptions::new(0.7).momentum(0.5);
    let mut opt = SGD::new(&other, options).unwrap();
    let state = read_pth_state(checkpoint("sgd_nesterov"), Some("optimizer"), &opt).unwrap();
    let err = opt.load_state_dict(&state).unwrap_err();
    // Every parameter's mismatch at once, and what to do.
    assert!(
        matches!(&err, Error::State(StateError::Mismatches { problems })
            if problems.len() == 5 && problems.iter().all(|p| matches!(p, StateError::ShapeMismatch { .. }))),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("make the model with the saved run's configuration"),
        "{err}"
    );
    assert!(
        err.to_string().contains("state.fc1.weight.momentum_buffer"),
        "{err}"
    );
    assert_eq!(opt.lrs(), vec![0.7]);
    assert!(opt
        .state_dict()
        .unwrap()
        .keys()
        .all(|k| !k.starts_with("state.")));
}

/// Without the key, a training checkpoint is not an optimizer state: the error names the key.
#[test]
fn a_training_checkpoint_needs_its_key() {
    let model = net("sgd_nesterov");
    let opt = SGD::new(&model, SgdOptions::new(0.1)).unwrap();
    let err = read_pth_state(checkpoint("sgd_nesterov"), None, &opt).unwrap_err();
    assert!(
        matches!(&err, Error::State(StateError::NotAnOptimizerState { candidates, .. }) if candidates == &["optimizer"]),
        "{err}"
    );
    assert!(err.to_string().contains("`optimizer`"), "{err}");
    let err = read_pth_state(checkpoint("sgd_nesterov"), Some("optim"), &opt).unwrap_err();
    let message = err.to_string();
    assert!(
        message.contains("optim") && message.contains("epoch, model, optimizer"),
        "{message}"
    );
    // A model's state dict is not an optimizer's either.
    let err = read_pth_state(checkpoint("sgd_nesterov"), Some("model"), &opt).unwrap_err();
    assert!(
        matches!(err, Error::State(StateError::NotAnOptimizerState { .. })),
        "{err}"
    );
}
