//! `torch.optim.swa_utils` against PyTorch: `fixtures/pytorch/swa/averaging.safetensors`
//! (`fixtures/make_swa_fixtures.py`) holds a 5-step SGD run of a small net with a `BatchNorm1d`,
//! and after each step the state dicts of three `AveragedModel`s (EMA over parameters and buffers
//! with `get_ema_multi_avg_fn(0.9)`, EMA with `get_ema_avg_fn(0.8)`, SWA's default average), then
//! the statistics `update_bn` recomputes; `averaged_model.pt` is PyTorch's saved `AveragedModel`.
//! The same run here must give PyTorch's values within 1e-6 and its keys.

use std::collections::HashMap;
use std::path::PathBuf;

use module_runtime::nn::{BatchNorm1d, Linear};
use module_runtime::optim::swa_utils::{
    get_ema_avg_fn, get_ema_multi_avg_fn, update_bn, AnnealStrategy, AveragedModel, AvgFn, SwaLr,
};
use module_runtime::optim::{
    read_pth_scheduler_state, read_pth_state, Error, LrScheduler, Optimizer, ParamGroups,
    SgdOptions, StepLr, SGD,
};
use module_runtime::prelude::*;
use module_runtime::PthValues;

/// `Net` of the fixture script: fc1 Linear(4, 6), bn BatchNorm1d(6), fc2 Linear(6, 2), relu
/// after the norm.
#[derive(Module, Clone)]
struct Net {
    fc1: Linear,
    bn: BatchNorm1d,
    fc2: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.bn.call(&self.fc1.call(x)?)?.relu()?)
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../fixtures/pytorch/swa")
        .join(name)
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture("averaging.safetensors"), &Device::Cpu).unwrap()
}

fn net(hidden: usize) -> Net {
    let dev = Device::Cpu;
    Net {
        fc1: Linear::new(4, hidden, &dev).unwrap(),
        bn: BatchNorm1d::new(hidden, &dev).unwrap(),
        fc2: Linear::new(hidden, 2, &dev).unwrap(),
    }
}

/// The fixture's net, with PyTorch's initial weights.
fn initial_net(r: &HashMap<String, Tensor>) -> Net {
    let model = net(6);
    let init: StateDict = r
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix("init.")?.to_owned(), v.clone())))
        .collect();
    model
        .load_state_dict(&init, &LoadOptions::default())
        .unwrap();
    model
}

/// `state` has exactly the keys `reference` holds under `prefix`, with their values within 1e-6
/// (integers exactly).
fn assert_state(state: &StateDict, r: &HashMap<String, Tensor>, prefix: &str) {
    let expected: Vec<&str> = r.keys().filter_map(|k| k.strip_prefix(prefix)).collect();
    assert_eq!(
        state.len(),
        expected.len(),
        "{prefix}: {:?}",
        state.keys().collect::<Vec<_>>()
    );
    for (key, ours) in state.iter() {
        let theirs = &r[&format!("{prefix}{key}")];
        assert_eq!(ours.dtype(), theirs.dtype(), "{prefix}{key}");
        assert_eq!(ours.dims(), theirs.dims(), "{prefix}{key}");
        if ours.dtype() == DType::I64 {
            let (a, b) = (
                ours.to_scalar::<i64>().unwrap(),
                theirs.to_scalar::<i64>().unwrap(),
            );
            assert_eq!(a, b, "{prefix}{key}");
        } else {
            let diff = (ours - theirs)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap();
            let max = diff.max(0).unwrap().to_scalar::<f32>().unwrap();
            assert!(max <= 1e-6, "{prefix}{key}: max difference {max}");
        }
    }
}

/// The fixture's 5 SGD steps, each followed by `update_parameters` of the three averages.
fn train(r: &HashMap<String, Tensor>) -> (Net, [AveragedModel<Net>; 3]) {
    let model = initial_net(r);
    let averages = [
        AveragedModel::new(&model)
            .unwrap()
            .multi_avg_fn(get_ema_multi_avg_fn(0.9).unwrap())
            .use_buffers(true),
        AveragedModel::new(&model)
            .unwrap()
            .avg_fn(get_ema_avg_fn(0.8).unwrap()),
        AveragedModel::new(&model).unwrap(),
    ];
    let mut opt = SGD::new(&model, SgdOptions::new(0.1).momentum(0.9)).unwrap();
    for k in 0..5 {
        let (x, y) = (&r[&format!("input.{k}")], &r[&format!("target.{k}")]);
        let loss = (model.call(x).unwrap() - y)
            .unwrap()
            .sqr()
            .unwrap()
            .mean_all()
            .unwrap();
        opt.backward_step(&loss).unwrap();
        assert_state(&model.state_dict().unwrap(), r, &format!("step{k}.net."));
        for (name, avg) in ["ema", "ema_avg_fn", "swa"].iter().zip(&averages) {
            avg.update_parameters(&model).unwrap();
            assert_state(&avg.state_dict().unwrap(), r, &format!("step{k}.{name}."));
        }
    }
    (model, averages)
}

#[test]
fn ema_and_swa_traces_match_pytorch() {
    let r = reference();
    let (_, [ema, _, swa]) = train(&r);
    assert_eq!(ema.n_averaged().unwrap(), 5);
    assert_eq!(swa.n_averaged().unwrap(), 5);
    // The EMA averaged `num_batches_tracked` as PyTorch does (rounded toward zero): 1, not 5.
    let tracked = ema
        .module
        .bn
        .num_batches_tracked
        .as_ref()
        .unwrap()
        .tensor()
        .unwrap();
    assert_eq!(tracked.to_scalar::<i64>().unwrap(), 1);
}

#[test]
fn update_bn_recomputes_pytorch_statistics() {
    let r = reference();
    let (_, [_, _, mut swa]) = train(&r);
    swa.eval();
    let batches: Vec<Tensor> = (0..3)
        .map(|k| r[&format!("bn_input.{k}")].clone())
        .collect();
    update_bn(&batches, &mut swa).unwrap();
    assert_state(&swa.state_dict().unwrap(), &r, "bn.swa.");
    // The momentum and the eval mode are back.
    let momentum = r["bn.momentum"].to_scalar::<f64>().unwrap();
    assert_eq!(swa.module.bn.momentum, Some(momentum));
    assert!(!swa.is_training());
}

#[test]
fn update_bn_puts_everything_back_when_the_model_fails() {
    let r = reference();
    let (_, [_, _, mut swa]) = train(&r);
    let before = swa.state_dict().unwrap();
    swa.eval();
    // The second batch has 5 features, not 4: the model fails on it.
    let batches = [
        r["bn_input.0"].clone(),
        Tensor::zeros((8, 5), DType::F32, &Device::Cpu).unwrap(),
    ];
    assert!(update_bn(&batches, &mut swa).is_err());
    assert_state(
        &swa.state_dict().unwrap(),
        &as_reference(&before, "s."),
        "s.",
    );
    assert_eq!(swa.module.bn.momentum, Some(0.1));
    assert!(!swa.is_training());
}

fn as_reference(state: &StateDict, prefix: &str) -> HashMap<String, Tensor> {
    state
        .iter()
        .map(|(k, v)| (format!("{prefix}{k}"), v.clone()))
        .collect()
}

#[test]
fn pytorch_averaged_model_state_dict_loads_strictly_and_ours_has_its_keys() {
    let r = reference();
    let (model, [_, _, swa]) = train(&r);
    // torch.save(swa_model.state_dict(), "averaged_model.pt"), loaded strictly into a new average.
    let loaded = AveragedModel::new(&model).unwrap();
    loaded
        .load_state_dict(fixture("averaged_model.pt"), &LoadOptions::default())
        .unwrap();
    assert_eq!(loaded.n_averaged().unwrap(), 5);
    assert_state(&loaded.state_dict().unwrap(), &r, "step4.swa.");
    // Ours: PyTorch's keys in PyTorch's order (`n_averaged` first), and it round-trips through
    // a file.
    let keys: Vec<&str> = vec![
        "n_averaged",
        "module.fc1.weight",
        "module.fc1.bias",
        "module.bn.weight",
        "module.bn.bias",
        "module.bn.running_mean",
        "module.bn.running_var",
        "module.bn.num_batches_tracked",
        "module.fc2.weight",
        "module.fc2.bias",
    ];
    let ours = swa.state_dict().unwrap();
    assert_eq!(ours.keys().collect::<Vec<_>>(), keys);
    let n = ours.get("n_averaged").unwrap();
    assert_eq!((n.dtype(), n.rank()), (DType::I64, 0));
    let path = std::env::temp_dir().join(format!("averaged-{}.safetensors", std::process::id()));
    swa.save_safetensors(&path).unwrap();
    // `SWA_WRITE_RUST_SAVED=FILE`: keep a copy for `make_swa_fixtures.py --check FILE`, which
    // loads it strictly into PyTorch's AveragedModel.
    if let Ok(keep) = std::env::var("SWA_WRITE_RUST_SAVED") {
        std::fs::copy(&path, keep).unwrap();
    }
    let again = AveragedModel::new(&net(6)).unwrap();
    again
        .load_state_dict(&path, &LoadOptions::default())
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_state(&again.state_dict().unwrap(), &r, "step4.swa.");
    // The class name and the forward are the averaged copy's.
    assert_eq!(swa.class_name(), "AveragedModel");
    let x = &r["input.0"];
    swa.eval();
    let direct = swa.module.call(x).unwrap();
    let through = swa.call(x).unwrap();
    assert_eq!(
        direct.to_vec2::<f32>().unwrap(),
        through.to_vec2::<f32>().unwrap()
    );
}

#[test]
fn a_model_of_another_shape_is_refused_and_nothing_changes() {
    let model = net(6);
    let avg = AveragedModel::new(&model).unwrap();
    avg.update_parameters(&model).unwrap();
    let before = avg.state_dict().unwrap();
    let other = net(5);
    let err = avg.update_parameters(&other).unwrap_err();
    assert!(
        matches!(&err, Error::AveragedModelMismatch { path, .. } if path == "fc1.weight"),
        "{err}"
    );
    assert!(err.to_string().contains("[6, 4]"), "{err}");
    assert_eq!(avg.n_averaged().unwrap(), 1);
    assert_state(
        &avg.state_dict().unwrap(),
        &as_reference(&before, "b."),
        "b.",
    );
    // An averaging function that returns another shape: refused, nothing written.
    let bad = AveragedModel::new(&model)
        .unwrap()
        .avg_fn(AvgFn::new(|avg, _, _| Ok(avg.flatten_all()?)));
    bad.update_parameters(&model).unwrap(); // the first update copies
    let err = bad.update_parameters(&model).unwrap_err();
    assert!(matches!(err, Error::AveragedModelMismatch { .. }), "{err}");
    assert_eq!(bad.n_averaged().unwrap(), 1);
}

#[test]
fn decay_out_of_range_is_refused() {
    for decay in [-0.1, 1.5, f64::NAN] {
        let err = get_ema_multi_avg_fn(decay).unwrap_err();
        assert!(
            matches!(err, Error::InvalidHyperparameter { name: "decay", .. }),
            "{err}"
        );
        assert!(get_ema_avg_fn(decay).is_err());
    }
}

/// An SGD over a `Linear(3, 2)` in two groups, PyTorch's order and rates: the weight at 0.1,
/// the bias at 0.2.
fn two_groups(model: &Linear) -> SGD {
    let groups = ParamGroups::new().group(["weight"], |g| g.lr(0.1));
    let opt = SGD::with_groups(model, SgdOptions::new(0.2), &groups).unwrap();
    assert_eq!(opt.lrs(), [0.1, 0.2]);
    opt
}

fn swalr_case(opt: &mut SGD, case: &str) -> SwaLr {
    match case {
        "cos" => SwaLr::new(opt, 0.05, 3, AnnealStrategy::Cos),
        "linear" => SwaLr::per_group(opt, vec![0.05, 0.01], 4, AnnealStrategy::Linear).unwrap(),
        _ => SwaLr::new(opt, 0.02, 0, AnnealStrategy::Cos),
    }
}

/// `SWALR` over an SGD with two groups (lr 0.1 and 0.2): `fixtures/pytorch/swa/swalr.safetensors`
/// holds PyTorch's rates after the constructor and 6 steps, per case.
#[test]
fn swalr_rates_are_pytorch_s_to_the_bit() {
    let r = candle_core::safetensors::load(fixture("swalr.safetensors"), &Device::Cpu).unwrap();
    let model = Linear::new(3, 2, &Device::Cpu).unwrap();
    for case in ["cos", "linear", "instant"] {
        let mut opt = two_groups(&model);
        let mut schedule = swalr_case(&mut opt, case);
        let expected = r[&format!("{case}.lrs")].to_vec2::<f64>().unwrap();
        assert_eq!(opt.lrs(), expected[0], "{case}: step 0");
        // Saved after step 2 and loaded into a schedule made otherwise, it continues alike.
        let mut resumed: Option<(SGD, SwaLr)> = None;
        for (k, want) in expected.iter().enumerate().skip(1) {
            schedule.step(&mut opt);
            assert_eq!(&opt.lrs(), want, "{case}: step {k}");
            if let Some((other, again)) = resumed.as_mut() {
                again.step(other);
                assert_eq!(&other.lrs(), want, "{case}: resumed, step {k}");
            }
            if k == 2 {
                let state = schedule.state_dict().unwrap();
                let mut other = two_groups(&model);
                let mut again = SwaLr::new(&mut other, 0.9, 7, AnnealStrategy::Linear);
                again.load_state_dict(&state, &mut other).unwrap();
                assert_eq!(other.lrs(), opt.lrs());
                resumed = Some((other, again));
            }
        }
    }
    let mut opt = two_groups(&model);
    let err = SwaLr::per_group(&mut opt, vec![0.1], 2, AnnealStrategy::Cos)
        .err()
        .unwrap();
    assert!(
        matches!(err, Error::InvalidHyperparameter { name: "swa_lr", .. }),
        "{err}"
    );
}

/// PyTorch's checkpoint of the `linear` case after 2 steps (`swa_lr` in the optimizer's groups,
/// `_anneal_strategy` a string) continues here with PyTorch's rates.
#[test]
fn swalr_continues_a_pytorch_checkpoint() {
    let r = candle_core::safetensors::load(fixture("swalr.safetensors"), &Device::Cpu).unwrap();
    let expected = r["linear.lrs"].to_vec2::<f64>().unwrap();
    let model = Linear::new(3, 2, &Device::Cpu).unwrap();
    let mut opt = two_groups(&model);
    // The schedule made as PyTorch's was (its SWA rates are not in its state).
    let mut schedule = swalr_case(&mut opt, "linear");
    let path = fixture("swalr_linear.pt");
    let opt_state = read_pth_state(&path, Some("optimizer"), &opt).unwrap();
    opt.load_state_dict(&opt_state).unwrap();
    let ckpt = PthValues::load(&path).unwrap();
    let state = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &schedule).unwrap();
    schedule.load_state_dict(&state, &mut opt).unwrap();
    assert_eq!(schedule.last_epoch(), 2);
    assert_eq!(opt.lrs(), expected[2]);
    for want in &expected[3..] {
        schedule.step(&mut opt);
        assert_eq!(&opt.lrs(), want);
    }
    // Another kind of schedule refuses it, naming SWALR.
    let mut other = two_groups(&model);
    let step = StepLr::new(&mut other, 2, 0.5);
    let err = read_pth_scheduler_state(ckpt.get("scheduler").unwrap(), &step).unwrap_err();
    assert!(err.to_string().contains("SWALR"), "{err}");
}

#[test]
fn update_bn_reaches_lazy_batch_norms_and_nested_ones() {
    use module_runtime::nn::LazyBatchNorm1d;

    #[derive(Module)]
    struct Nested {
        norms: Vec<LazyBatchNorm1d>,
    }
    impl Forward<&Tensor> for Nested {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = self.norms[0].call(x)?;
            self.norms[1].call(&h)
        }
    }
    let dev = Device::Cpu;
    let mut model = Nested {
        norms: vec![
            LazyBatchNorm1d::new(&dev).unwrap(),
            LazyBatchNorm1d::new(&dev).unwrap(),
        ],
    };
    let a = Tensor::new(&[[0f32, 10.], [2., 14.]], &dev).unwrap();
    let b = Tensor::new(&[[4f32, 2.], [6., 6.]], &dev).unwrap();
    // Built (and its statistics moved) by a first call with momentum 0.1.
    model.call(&a).unwrap();
    update_bn([&a, &b], &mut model).unwrap();
    // The cumulative average of the two batches' means, not an exponential one.
    let mean = model.norms[0]
        .running_mean
        .as_ref()
        .unwrap()
        .tensor()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert_eq!(mean, [3.0, 8.0]);
    let tracked = model.norms[1]
        .num_batches_tracked
        .as_ref()
        .unwrap()
        .tensor()
        .unwrap();
    assert_eq!(tracked.to_scalar::<i64>().unwrap(), 2);
    assert!(model.norms.iter().all(|n| n.momentum == Some(0.1)));
    assert!(model.is_training());
}
