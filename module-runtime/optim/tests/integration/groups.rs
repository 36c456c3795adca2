//! Parameter groups by path pattern, and learning-rate schedules against Hugging Face's and
//! PyTorch's formulas.

use module_runtime::nn::LayerNorm;
use module_runtime::optim::{
    Adam, AdamW, Error, ExponentialLr, LambdaLr, LrScheduler, Optimizer, ParamGroups, SgdOptions,
    StepLr, SGD,
};
use module_runtime::prelude::*;

#[derive(Module)]
struct Block {
    dense: Linear,
    layer_norm: LayerNorm,
}

#[derive(Module)]
struct Net {
    encoder: Block,
    head: Linear,
}

fn net() -> Net {
    let dev = Device::Cpu;
    Net {
        encoder: Block {
            dense: Linear::new(4, 4, &dev).unwrap(),
            layer_norm: LayerNorm::new(4, &dev).unwrap(),
        },
        head: Linear::new(4, 2, &dev).unwrap(),
    }
}

fn paths(opt: &dyn Optimizer, group: usize) -> Vec<&str> {
    opt.group_params(group)
        .iter()
        .map(|(p, _)| p.as_str())
        .collect()
}

#[test]
fn hugging_face_no_decay_groups() {
    let model = net();
    let groups =
        ParamGroups::new().group(["**.bias", "**.layer_norm.weight"], |g| g.weight_decay(0.0));
    let opt = AdamW::with_groups(&model, AdamW::options().lr(5e-5), &groups).unwrap();
    assert_eq!(opt.num_param_groups(), 2);
    assert_eq!(
        paths(&opt, 0),
        [
            "encoder.dense.bias",
            "encoder.layer_norm.weight",
            "encoder.layer_norm.bias",
            "head.bias"
        ]
    );
    assert_eq!(paths(&opt, 1), ["encoder.dense.weight", "head.weight"]);
    // PyTorch's numbering of the parameters in a state dict: group by group.
    assert_eq!(
        opt.param_paths(),
        [
            "encoder.dense.bias",
            "encoder.layer_norm.weight",
            "encoder.layer_norm.bias",
            "head.bias",
            "encoder.dense.weight",
            "head.weight"
        ]
    );
    assert_eq!(opt.params().len(), 6);
    let g = opt.param_groups();
    assert_eq!(g[0].options.weight_decay, 0.0);
    assert_eq!(g[1].options.weight_decay, 0.01);
    assert_eq!(g[0].options.lr, 5e-5);
    assert!(g[0].options.decoupled_weight_decay);
}

#[test]
fn groups_in_declared_order_with_rest_placed_and_overridden() {
    let model = net();
    let groups = ParamGroups::new()
        .rest(|g| g.lr(1.0))
        .group("encoder", |g| g.lr(0.1).momentum(0.5))
        .group("head.weight", |g| g.nesterov(true).momentum(0.9));
    let opt = SGD::with_groups(&model, SgdOptions::new(0.01), &groups).unwrap();
    assert_eq!(paths(&opt, 0), ["head.bias"]);
    assert_eq!(opt.lr(0), 1.0);
    assert_eq!(
        paths(&opt, 1),
        [
            "encoder.dense.weight",
            "encoder.dense.bias",
            "encoder.layer_norm.weight",
            "encoder.layer_norm.bias"
        ]
    );
    assert_eq!(opt.param_groups()[1].options.momentum, 0.5);
    assert_eq!(paths(&opt, 2), ["head.weight"]);
    assert_eq!(opt.lr(2), 0.01);
    assert!(opt.param_groups()[2].options.nesterov);
}

#[test]
fn frozen_parameters_are_skipped() {
    let model = net();
    model.freeze("encoder").unwrap();
    // A group whose parameters are all frozen still matched: it is empty, not an error.
    let groups = ParamGroups::new().group("encoder", |g| g.lr(1e-5));
    let opt = Adam::with_groups(&model, Adam::options(), &groups).unwrap();
    assert!(paths(&opt, 0).is_empty());
    assert_eq!(paths(&opt, 1), ["head.weight", "head.bias"]);
    model.freeze("head").unwrap();
    assert!(matches!(
        Adam::new(&model, Adam::options()),
        Err(Error::NoParameters)
    ));
}

#[test]
fn group_errors_are_typed_and_name_the_pattern() {
    let model = net();
    let err = AdamW::with_groups(
        &model,
        AdamW::options(),
        &ParamGroups::new().group("**.LayerNorm.weight", |g| g.weight_decay(0.0)),
    )
    .err()
    .unwrap();
    assert!(
        matches!(&err, Error::PatternMatchesNothing { pattern, .. } if pattern == "**.LayerNorm.weight"),
        "{err}"
    );
    assert!(
        err.to_string().contains("encoder.layer_norm.weight"),
        "{err}"
    );

    let err = AdamW::with_groups(
        &model,
        AdamW::options(),
        &ParamGroups::new()
            .group("**.bias", |g| g.weight_decay(0.0))
            .group("head", |g| g.lr(1.0)),
    )
    .err()
    .unwrap();
    match &err {
        Error::ParamInTwoGroups {
            path,
            first,
            second,
            first_group,
            second_group,
        } => {
            assert_eq!(path, "head.bias");
            assert_eq!((first.as_str(), *first_group), ("**.bias", 0));
            assert_eq!((second.as_str(), *second_group), ("head", 1));
        }
        e => panic!("{e}"),
    }

    let err = SGD::with_groups(
        &model,
        SgdOptions::new(0.1),
        &ParamGroups::new().group("head", |g| g.betas(0.8, 0.9)),
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            err,
            Error::NotApplicable {
                option: "betas",
                group: 0,
                ..
            }
        ),
        "{err}"
    );

    let err = Adam::with_groups(
        &model,
        Adam::options(),
        &ParamGroups::new().group("head", |g| g.betas(1.0, 0.9)),
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            err,
            Error::InvalidHyperparameter {
                name: "betas.0",
                group: Some(0),
                ..
            }
        ),
        "{err}"
    );
    assert!(SGD::new(&model, SgdOptions::new(-1.0)).is_err());
    assert!(SGD::new(&model, SgdOptions::new(0.1).nesterov(true)).is_err());
    // An invalid pattern is module-runtime's error.
    assert!(matches!(
        SGD::with_groups(
            &model,
            SgdOptions::new(0.1),
            &ParamGroups::new().group("a..b", |g| g)
        ),
        Err(Error::Runtime(_))
    ));
}

#[test]
fn lr_set_on_a_group_is_used_by_the_next_step() {
    let model = net();
    let mut opt = SGD::new(&model, SgdOptions::new(0.1)).unwrap();
    opt.param_groups_mut()[0].options.lr = 0.0;
    let before = model
        .head
        .weight
        .tensor()
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let x = Tensor::ones((2, 4), DType::F32, &Device::Cpu).unwrap();
    let loss = model.head.call(&x).unwrap().sum_all().unwrap();
    opt.backward_step(&loss).unwrap();
    assert_eq!(
        model
            .head
            .weight
            .tensor()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap(),
        before
    );
}

// Hugging Face's lambdas (transformers/optimization.py), written out independently.
fn hf_linear(step: usize, warmup: usize, total: usize) -> f64 {
    if step < warmup {
        return step as f64 / (warmup.max(1)) as f64;
    }
    (0f64).max((total as f64 - step as f64) / ((total as i64 - warmup as i64).max(1)) as f64)
}

fn hf_cosine(step: usize, warmup: usize, total: usize, cycles: f64) -> f64 {
    if step < warmup {
        return step as f64 / (warmup.max(1)) as f64;
    }
    let progress = (step - warmup) as f64 / ((total - warmup).max(1)) as f64;
    (0f64).max(0.5 * (1.0 + (std::f64::consts::PI * cycles * 2.0 * progress).cos()))
}

/// The rates a schedule gives at steps 0..n (each read before `step`).
fn trace(opt: &mut SGD, schedule: &mut dyn LrScheduler, n: usize) -> Vec<(f64, f64)> {
    let mut out = Vec::new();
    for _ in 0..n {
        assert_eq!(schedule.get_last_lr(), opt.lrs().as_slice());
        out.push((opt.lr(0), opt.lr(1)));
        schedule.step(opt);
    }
    out
}

fn two_groups() -> (Net, SGD) {
    let model = net();
    let groups = ParamGroups::new().group("head", |g| g.lr(0.5));
    let opt = SGD::with_groups(&model, SgdOptions::new(0.1), &groups).unwrap();
    (model, opt)
}

#[test]
fn hugging_face_schedules() {
    let (warmup, total) = (3, 10);
    let (_m, mut opt) = two_groups();
    let mut s = LambdaLr::linear_with_warmup(&mut opt, warmup, total);
    for (step, (a, b)) in trace(&mut opt, &mut s, 14).into_iter().enumerate() {
        let f = hf_linear(step, warmup, total);
        assert_eq!((a, b), (0.5 * f, 0.1 * f), "linear, step {step}");
    }
    assert_eq!(s.last_epoch(), 14);
    assert_eq!(s.base_lrs(), [0.5, 0.1]);

    let (_m, mut opt) = two_groups();
    let mut s = LambdaLr::cosine_with_warmup(&mut opt, warmup, total);
    for (step, (a, b)) in trace(&mut opt, &mut s, 14).into_iter().enumerate() {
        let f = hf_cosine(step, warmup, total, 0.5);
        assert_eq!((a, b), (0.5 * f, 0.1 * f), "cosine, step {step}");
    }
    // Chosen values: the first step runs at 0, the peak after warmup, half way down the cosine.
    let (_m, mut opt) = two_groups();
    let mut s = LambdaLr::cosine_with_warmup(&mut opt, 2, 12);
    let t = trace(&mut opt, &mut s, 13);
    assert_eq!(t[0].0, 0.0);
    assert_eq!(t[1].0, 0.25);
    assert_eq!(t[2].0, 0.5);
    assert!((t[7].0 - 0.25).abs() < 1e-15);
    assert!(t[12].0.abs() < 1e-15);

    let (_m, mut opt) = two_groups();
    let mut s = LambdaLr::cosine_with_warmup_cycles(&mut opt, 0, 8, 2.0);
    for (step, (a, _)) in trace(&mut opt, &mut s, 9).into_iter().enumerate() {
        assert_eq!(a, 0.5 * hf_cosine(step, 0, 8, 2.0), "cycles, step {step}");
    }

    let (_m, mut opt) = two_groups();
    let mut s = LambdaLr::constant_with_warmup(&mut opt, 4);
    let t = trace(&mut opt, &mut s, 6);
    let want = [0.0, 0.25, 0.5, 0.75, 1.0, 1.0];
    for (step, w) in want.iter().enumerate() {
        assert_eq!(t[step], (0.5 * w, 0.1 * w));
    }

    let (_m, mut opt) = two_groups();
    let mut s = LambdaLr::constant(&mut opt);
    assert!(trace(&mut opt, &mut s, 3).iter().all(|&r| r == (0.5, 0.1)));
}

#[test]
fn step_and_exponential_lr_are_pytorchs_recursive_forms() {
    let (_m, mut opt) = two_groups();
    let mut s = StepLr::new(&mut opt, 3, 0.1);
    let t = trace(&mut opt, &mut s, 8);
    let mut want = (0.5, 0.1);
    for (epoch, got) in t.iter().enumerate() {
        if epoch > 0 && epoch % 3 == 0 {
            want = (want.0 * 0.1, want.1 * 0.1);
        }
        assert_eq!(*got, want, "StepLR, epoch {epoch}");
    }

    let (_m, mut opt) = two_groups();
    let mut s = ExponentialLr::new(&mut opt, 0.9);
    let t = trace(&mut opt, &mut s, 5);
    let mut want = (0.5, 0.1);
    for (epoch, got) in t.iter().enumerate() {
        if epoch > 0 {
            want = (want.0 * 0.9, want.1 * 0.9);
        }
        assert_eq!(*got, want, "ExponentialLR, epoch {epoch}");
    }
}

#[test]
fn schedules_compose_with_any_optimizer() {
    let model = net();
    let mut opt: Box<dyn Optimizer> = Box::new(AdamW::new(&model, AdamW::options()).unwrap());
    let mut s = LambdaLr::linear_with_warmup(opt.as_mut(), 2, 4);
    assert_eq!(opt.lr(0), 0.0);
    s.step(opt.as_mut());
    assert_eq!(opt.lr(0), 0.5e-3);
}

/// PyTorch's `"bias" in name` habit written as a pattern: `bias` matches only a root parameter
/// named `bias`, and the error suggests `**.bias`, which matches every bias.
#[test]
fn a_substring_style_pattern_suggests_its_anywhere_form() {
    let model = net();
    let err = AdamW::with_groups(
        &model,
        AdamW::options(),
        &ParamGroups::new().group("bias", |g| g.weight_decay(0.0)),
    )
    .err()
    .unwrap();
    assert!(
        matches!(&err, Error::PatternMatchesNothing { suggestion: Some(s), .. } if s == "**.bias"),
        "{err}"
    );
    let message = err.to_string();
    assert!(
        message.contains("did you mean `**.bias` (`bias` at any depth)?"),
        "{message}"
    );
    assert!(message.contains("not a part of a name"), "{message}");
    // No suggestion where the anywhere form matches nothing either.
    let err = AdamW::with_groups(
        &model,
        AdamW::options(),
        &ParamGroups::new().group("gamma", |g| g.weight_decay(0.0)),
    )
    .err()
    .unwrap();
    assert!(
        matches!(
            &err,
            Error::PatternMatchesNothing {
                suggestion: None,
                ..
            }
        ),
        "{err}"
    );
}
