//! A training run with a learning-rate schedule started in PyTorch and continued here:
//! `fixtures/pytorch/scheduler/` holds, per schedule, a training checkpoint `{"model",
//! "optimizer", "scheduler", "epoch", "step", "extra"}` saved after 4 PyTorch steps, and the
//! learning rates, losses and parameters of 5 more (`fixtures/make_scheduler_pth_fixtures.py`).
//! The model, the optimizer and the schedule are read from the checkpoint, the 5 steps run here:
//! the learning rates must be PyTorch's to the bit, the parameters within 1e-6. And the plain
//! values read back, and the errors for a schedule of another kind or a field we do not know.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::nn::LayerNorm;
use module_runtime::optim::{
    read_pth_scheduler_state, read_pth_state, AdamW, Error, ExponentialLr, LambdaLr, LrScheduler,
    Optimizer, StateError, StepLr,
};
use module_runtime::prelude::*;
use module_runtime::{PthValues, PyValue};

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

fn checkpoint(case: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/pytorch/scheduler")
        .join(format!("{case}.pt"))
}

fn reference(case: &str) -> HashMap<String, Tensor> {
    let path = checkpoint(case).with_file_name(format!("{case}_reference.safetensors"));
    candle_core::safetensors::load(path, &Device::Cpu).unwrap()
}

/// The model (as the checkpoint saved it) and an AdamW made with another learning rate, which
/// the optimizer state replaces.
fn model_and_optimizer(case: &str) -> (Net, AdamW) {
    let dev = Device::Cpu;
    let net = Net {
        fc1: Linear::new(6, 8, &dev).unwrap(),
        norm: LayerNorm::new(8, &dev).unwrap(),
        fc2: Linear::new(8, 3, &dev).unwrap(),
    };
    net.load_state_dict(checkpoint(case), &LoadOptions::default().nested_in("model"))
        .unwrap();
    let opt = AdamW::new(&net, AdamW::options().lr(0.5).weight_decay(0.1)).unwrap();
    (net, opt)
}

/// Loads the optimizer and `schedule` from the checkpoint, runs the 5 later steps and compares
/// the learning rates (exactly) and the parameters (1e-6) with PyTorch's.
fn continue_run(case: &str, make: impl FnOnce(&mut AdamW) -> Box<dyn LrScheduler>) {
    let (model, mut opt) = model_and_optimizer(case);
    let mut schedule = make(&mut opt);
    let state = read_pth_state(checkpoint(case), Some("optimizer"), &opt).unwrap();
    opt.load_state_dict(&state).unwrap();
    let ckpt = PthValues::load(checkpoint(case)).unwrap();
    let state = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &*schedule).unwrap();
    schedule.load_state_dict(&state, &mut opt).unwrap();
    assert_eq!(schedule.last_epoch(), 4);

    let fx = reference(case);
    let mut lrs = Vec::new();
    for _ in 0..5 {
        lrs.push(opt.lrs()[0]);
        let out = model.call(&fx["input"]).unwrap();
        let loss = (out - &fx["target"])
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        opt.backward_step(&loss).unwrap();
        schedule.step(&mut opt);
    }
    let want: Vec<f64> = fx["lrs"].to_vec1().unwrap();
    assert_eq!(lrs, want, "{case}: learning rates");
    for (path, p) in model.named_parameters() {
        let got: Vec<f32> = p
            .tensor()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let want: Vec<f32> = fx[&format!("param.{path}")]
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= 1e-6,
                "{case}: {path}[{i}]: got {g}, PyTorch {w}"
            );
        }
    }
}

#[test]
fn step_lr_continues() {
    continue_run("step_lr", |opt| Box::new(StepLr::new(opt, 7, 0.9)));
}

#[test]
fn exponential_lr_continues() {
    continue_run("exponential_lr", |opt| {
        Box::new(ExponentialLr::new(opt, 0.8))
    });
}

#[test]
fn lambda_lr_continues() {
    continue_run("lambda_lr", |opt| {
        Box::new(LambdaLr::new(opt, |step| 1.0 / (1.0 + step as f64)))
    });
}

/// transformers' `get_linear_schedule_with_warmup`: a `LambdaLR` over a `functools.partial`,
/// whose state is `lr_lambdas: [{}]`.
#[test]
fn hf_linear_warmup_continues() {
    continue_run("hf_linear", |opt| {
        Box::new(LambdaLr::linear_with_warmup(opt, 2, 10))
    });
}

/// `ckpt["epoch"]`, `ckpt["step"]` and the nested `extra` read back, typed; the schedule's own
/// fields come from the file (the `StepLr` was made with `step_size` 7).
#[test]
fn plain_values_read_back() {
    let ckpt = PthValues::load(checkpoint("step_lr")).unwrap();
    assert_eq!(ckpt.extract::<i64>("epoch").unwrap(), 3);
    assert_eq!(ckpt.extract::<usize>("step").unwrap(), 12);
    assert_eq!(ckpt.extract::<f64>("extra.best").unwrap(), 0.5);
    assert_eq!(
        ckpt.extract::<Vec<String>>("extra.tags").unwrap(),
        ["a", "b"]
    );
    assert_eq!(ckpt.extract::<String>("extra.tags.1").unwrap(), "b");
    assert!(ckpt.extract::<bool>("extra.flag").unwrap());
    assert!(matches!(ckpt.get("extra.none").unwrap(), PyValue::None));
    assert_eq!(ckpt.extract::<i64>("scheduler.step_size").unwrap(), 3);
    // A state dict key with dots, and an optimizer state keyed by parameter number.
    let w: Tensor = ckpt.extract("model.fc1.weight").unwrap();
    assert_eq!(w.dims(), [8, 6]);
    let exp_avg: Tensor = ckpt.extract("optimizer.state.0.exp_avg").unwrap();
    assert_eq!(exp_avg.dims(), [8, 6]);
    let lr: f64 = ckpt.extract("optimizer.param_groups.0.lr").unwrap();
    assert_eq!(lr, 0.005);

    let (_, mut opt) = model_and_optimizer("step_lr");
    let mut schedule = StepLr::new(&mut opt, 7, 0.9);
    let state = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &schedule).unwrap();
    schedule.load_state_dict(&state, &mut opt).unwrap();
    assert_eq!(
        schedule
            .state_dict()
            .unwrap()
            .get("step_size")
            .unwrap()
            .to_scalar::<f64>()
            .unwrap(),
        3.0
    );
    assert_eq!(opt.lrs(), vec![0.005]);
}

/// A missing key and a value of another type: typed errors naming the path.
#[test]
fn value_errors_name_the_path() {
    let ckpt = PthValues::load(checkpoint("step_lr")).unwrap();
    let err = ckpt.get("extra.missing").unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, module_runtime::Error::Pth { .. }), "{msg}");
    assert!(
        msg.contains("`extra.missing`") && msg.contains("extra has no key `missing`"),
        "{msg}"
    );
    assert!(msg.contains("best, tags"), "{msg}");
    let err = ckpt.extract::<i64>("extra.best").unwrap_err().to_string();
    assert!(
        err.contains("`extra.best`: is the float 0.5, not an integer"),
        "{err}"
    );
    let err = ckpt.get("extra.tags.5").unwrap_err().to_string();
    assert!(err.contains("has no index `5` (it has 2 items)"), "{err}");
}

/// A StepLR's state into an ExponentialLr, a LambdaLR's into a StepLr: refused, naming both
/// kinds, and nothing changed.
#[test]
fn another_kind_of_schedule_is_refused() {
    let ckpt = PthValues::load(checkpoint("step_lr")).unwrap();
    let (_, mut opt) = model_and_optimizer("step_lr");
    let schedule = ExponentialLr::new(&mut opt, 0.8);
    let err = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &schedule).unwrap_err();
    assert!(
        matches!(&err, Error::State(StateError::SchedulerKind { expected: "ExponentialLR", found, .. }) if found == "StepLR"),
        "{err}"
    );
    assert!(
        err.to_string()
            .contains("the state is StepLR's (fields step_size, gamma), not ExponentialLR's"),
        "{err}"
    );

    let ckpt = PthValues::load(checkpoint("lambda_lr")).unwrap();
    let mut schedule = StepLr::new(&mut opt, 2, 0.5);
    let err = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &schedule).unwrap_err();
    assert!(
        err.to_string()
            .contains("state is LambdaLR's (fields lr_lambdas), not StepLR's"),
        "{err}"
    );
    // Our own LambdaLr state into a StepLr: the same error, and the StepLr is unchanged.
    let lambda = LambdaLr::new(&mut opt, |_| 0.5);
    let before = schedule.state_dict().unwrap();
    let err = schedule
        .load_state_dict(&lambda.state_dict().unwrap(), &mut opt)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::State(StateError::SchedulerKind {
                expected: "StepLR",
                ..
            })
        ),
        "{err}"
    );
    let after = schedule.state_dict().unwrap();
    for (k, t) in before.iter() {
        assert_eq!(
            t.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap(),
            after
                .get(k)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        );
    }
}

/// The scheduler's state with a field we do not know, and a `LambdaLR` over a callable object
/// with state: typed errors naming the field.
#[test]
fn unknown_fields_are_refused() {
    let ckpt = PthValues::load(checkpoint("step_lr")).unwrap();
    let mut items = ckpt.get("scheduler").unwrap().as_dict().unwrap().to_vec();
    items.push((PyValue::Str("warmup".into()), PyValue::Int(3)));
    let (_, mut opt) = model_and_optimizer("step_lr");
    let mut schedule = StepLr::new(&mut opt, 2, 0.5);
    let state = read_pth_scheduler_state(&PyValue::Dict(items), &schedule).unwrap();
    let err = schedule.load_state_dict(&state, &mut opt).unwrap_err();
    assert!(
        matches!(&err, Error::State(StateError::UnexpectedKeys { keys }) if keys == &["warmup"]),
        "{err}"
    );

    let ckpt = PthValues::load(checkpoint("lambda_lr")).unwrap();
    let items: Vec<(PyValue, PyValue)> = ckpt
        .get("scheduler")
        .unwrap()
        .as_dict()
        .unwrap()
        .iter()
        .map(|(k, v)| match k {
            PyValue::Str(s) if s == "lr_lambdas" => {
                let state =
                    PyValue::Dict(vec![(PyValue::Str("factor".into()), PyValue::Float(0.5))]);
                (k.clone(), PyValue::List(vec![state]))
            }
            _ => (k.clone(), v.clone()),
        })
        .collect();
    let schedule = LambdaLr::new(&mut opt, |_| 1.0);
    let err = read_pth_scheduler_state(&PyValue::Dict(items), &schedule)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("scheduler['lr_lambdas'][0]") && err.contains("callable object"),
        "{err}"
    );
}

/// A state saved by this crate before it took PyTorch's names (`last_lr`): a clear error.
#[test]
fn old_names_are_refused_clearly() {
    let (_, mut opt) = model_and_optimizer("step_lr");
    let mut schedule = ExponentialLr::new(&mut opt, 0.8);
    let mut old = module_runtime::StateDict::new();
    old.insert("last_epoch", Tensor::new(2f64, &Device::Cpu).unwrap());
    old.insert("last_lr", Tensor::new(&[0.01f64], &Device::Cpu).unwrap());
    let err = schedule
        .load_state_dict(&old, &mut opt)
        .unwrap_err()
        .to_string();
    assert!(err.contains("before it took PyTorch's names"), "{err}");
}

/// Our schedules save what PyTorch's save, under the same names: the state read from PyTorch's
/// file and the one the loaded schedule gives back have the same keys and values.
#[test]
fn our_state_has_pytorchs_names() {
    for case in ["step_lr", "exponential_lr", "lambda_lr"] {
        let (_, mut opt) = model_and_optimizer(case);
        let mut schedule: Box<dyn LrScheduler> = match case {
            "step_lr" => Box::new(StepLr::new(&mut opt, 1, 1.0)),
            "exponential_lr" => Box::new(ExponentialLr::new(&mut opt, 1.0)),
            _ => Box::new(LambdaLr::new(&mut opt, |_| 1.0)),
        };
        let ckpt = PthValues::load(checkpoint(case)).unwrap();
        let theirs = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &*schedule).unwrap();
        schedule.load_state_dict(&theirs, &mut opt).unwrap();
        let ours = schedule.state_dict().unwrap();
        let mut keys: Vec<&str> = ours.keys().collect();
        let mut want: Vec<&str> = theirs.keys().collect();
        keys.sort();
        want.sort();
        assert_eq!(keys, want, "{case}");
        for k in want {
            let values = |sd: &module_runtime::StateDict| -> Vec<f64> {
                sd.get(k).unwrap().flatten_all().unwrap().to_vec1().unwrap()
            };
            assert_eq!(values(&ours), values(&theirs), "{case}: {k}");
        }
    }
}

/// PyTorch 2.0–2.6 saved a deprecated `verbose` (a bool, later the string "deprecated"): read
/// past, as `_is_initial` and `_get_lr_called_within_step` are.
#[test]
fn verbose_of_older_pytorch_is_read_past() {
    let ckpt = PthValues::load(checkpoint("exponential_lr")).unwrap();
    let (_, mut opt) = model_and_optimizer("exponential_lr");
    let mut schedule = ExponentialLr::new(&mut opt, 0.5);
    for verbose in [PyValue::Bool(false), PyValue::Str("deprecated".into())] {
        let mut items = ckpt.get("scheduler").unwrap().as_dict().unwrap().to_vec();
        items.push((PyValue::Str("verbose".into()), verbose));
        let state = read_pth_scheduler_state(&PyValue::Dict(items), &schedule).unwrap();
        assert!(!state.contains_key("verbose"));
        schedule.load_state_dict(&state, &mut opt).unwrap();
        assert_eq!(schedule.last_epoch(), 4);
    }
}
