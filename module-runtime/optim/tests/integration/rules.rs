//! The update rules against PyTorch's formulas computed by hand (in `f64`), the fused pass against
//! the composed one, and clipping.
//!
//! A parameter `w` gets the gradient `c` from `loss = sum(w * c)`, so each step's gradient is
//! chosen by the test.

use candle_core::backprop::GradStore;
use module_runtime::optim::{
    clip_grad_norm, clip_grad_value, Adam, AdamOptions, AdamW, Optimizer, ParamList, SgdOptions,
    SGD,
};
use module_runtime::prelude::*;
use module_runtime::Param;

/// Makes the fused optimizer on its first call, the composed one on its second.
type MakeOpt = Box<dyn FnMut(&Param) -> Box<dyn Optimizer>>;

const W0: [f32; 4] = [0.5, -1.25, 2.0, 0.0];
/// The gradients of the steps (a sign change, a zero, large and small values).
const GRADS: [[f32; 4]; 5] = [
    [0.1, -0.2, 0.3, 1.0],
    [-0.4, 0.5, 0.0, 2.0],
    [0.7, 0.1, -0.3, -1.5],
    [0.05, -0.9, 0.6, 0.25],
    [1.5, 0.3, -0.2, -0.75],
];

fn param(values: &[f32]) -> Param {
    Param::new(Tensor::new(values, &Device::Cpu).unwrap()).unwrap()
}

fn list(p: &Param) -> ParamList {
    ParamList(vec![("w".to_owned(), p.clone())])
}

/// The gradients of `sum(w * c)` (that is, `c`) for every parameter in `ps`.
fn grads(ps: &[&Param], c: &[f32]) -> GradStore {
    let c = Tensor::new(c, &Device::Cpu).unwrap();
    let mut loss = Tensor::new(0f32, &Device::Cpu).unwrap();
    for p in ps {
        loss = (loss + (p.tensor().unwrap() * &c).unwrap().sum_all().unwrap()).unwrap();
    }
    loss.backward().unwrap()
}

fn values(p: &Param) -> Vec<f32> {
    p.tensor().unwrap().to_vec1().unwrap()
}

fn assert_near(what: &str, got: &[f32], want: &[f64], tol: f64) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
            "{what}[{i}]: got {g}, want {w}"
        );
    }
}

/// PyTorch's SGD in f64.
fn sgd_reference(o: &SgdOptions, steps: usize) -> Vec<f64> {
    let mut p: Vec<f64> = W0.iter().map(|&x| f64::from(x)).collect();
    let mut buf: Option<Vec<f64>> = None;
    for g in GRADS.iter().take(steps) {
        let mut d: Vec<f64> = g
            .iter()
            .zip(&p)
            .map(|(&g, &p)| {
                let g = if o.maximize {
                    -f64::from(g)
                } else {
                    f64::from(g)
                };
                g + o.weight_decay * p
            })
            .collect();
        if o.momentum != 0.0 {
            let b = match buf {
                None => d.clone(),
                Some(b) => b
                    .iter()
                    .zip(&d)
                    .map(|(b, d)| o.momentum * b + (1.0 - o.dampening) * d)
                    .collect(),
            };
            d = if o.nesterov {
                d.iter().zip(&b).map(|(d, b)| d + o.momentum * b).collect()
            } else {
                b.clone()
            };
            buf = Some(b);
        }
        for (p, d) in p.iter_mut().zip(&d) {
            *p -= o.lr * d;
        }
    }
    p
}

/// PyTorch's Adam / AdamW in f64.
fn adam_reference(o: &AdamOptions, steps: usize) -> Vec<f64> {
    let n = W0.len();
    let mut p: Vec<f64> = W0.iter().map(|&x| f64::from(x)).collect();
    let (mut m, mut v, mut vmax) = (vec![0.0; n], vec![0.0; n], vec![0.0f64; n]);
    let (b1, b2) = o.betas;
    for (t, g) in GRADS.iter().take(steps).enumerate() {
        let t = (t + 1) as f64;
        for i in 0..n {
            let mut g = f64::from(g[i]);
            if o.maximize {
                g = -g;
            }
            if o.weight_decay != 0.0 {
                if o.decoupled_weight_decay {
                    p[i] *= 1.0 - o.lr * o.weight_decay;
                } else {
                    g += o.weight_decay * p[i];
                }
            }
            m[i] = b1 * m[i] + (1.0 - b1) * g;
            v[i] = b2 * v[i] + (1.0 - b2) * g * g;
            vmax[i] = vmax[i].max(v[i]);
            let second = if o.amsgrad { vmax[i] } else { v[i] };
            let denom = second.sqrt() / (1.0 - b2.powf(t)).sqrt() + o.eps;
            p[i] -= o.lr / (1.0 - b1.powf(t)) * m[i] / denom;
        }
    }
    p
}

fn run_sgd(o: &SgdOptions, fused: bool) -> Vec<f32> {
    let p = param(&W0);
    let mut opt = SGD::new(&list(&p), o.clone()).unwrap();
    opt.set_fused(fused);
    for g in &GRADS {
        opt.step(&grads(&[&p], g)).unwrap();
    }
    values(&p)
}

fn run_adam(o: &AdamOptions, fused: bool) -> Vec<f32> {
    let p = param(&W0);
    let mut opt = Adam::new(&list(&p), o.clone()).unwrap();
    opt.set_fused(fused);
    for g in &GRADS {
        opt.step(&grads(&[&p], g)).unwrap();
    }
    values(&p)
}

fn sgd_cases() -> Vec<(&'static str, SgdOptions)> {
    vec![
        ("plain", SgdOptions::new(0.1)),
        ("momentum", SgdOptions::new(0.1).momentum(0.9)),
        (
            "momentum + dampening",
            SgdOptions::new(0.05).momentum(0.8).dampening(0.3),
        ),
        (
            "nesterov",
            SgdOptions::new(0.1).momentum(0.9).nesterov(true),
        ),
        (
            "weight decay",
            SgdOptions::new(0.1).momentum(0.5).weight_decay(0.1),
        ),
        (
            "maximize",
            SgdOptions::new(0.1).momentum(0.9).maximize(true),
        ),
    ]
}

fn adam_cases() -> Vec<(&'static str, AdamOptions)> {
    vec![
        ("defaults", Adam::options().lr(0.01)),
        (
            "L2 weight decay",
            Adam::options().lr(0.01).weight_decay(0.1),
        ),
        ("amsgrad", Adam::options().lr(0.01).amsgrad(true)),
        (
            "amsgrad + L2 + maximize",
            Adam::options()
                .lr(0.02)
                .amsgrad(true)
                .weight_decay(0.05)
                .maximize(true),
        ),
        ("adamw", AdamW::options().lr(0.01).weight_decay(0.1)),
        (
            "betas, eps",
            Adam::options().lr(0.01).betas(0.5, 0.9).eps(1e-3),
        ),
        (
            "beta1 below 0.5 (the other lerp branch)",
            Adam::options().lr(0.01).betas(0.3, 0.99),
        ),
    ]
}

#[test]
fn sgd_matches_pytorch_formulas() {
    for (name, o) in sgd_cases() {
        let want = sgd_reference(&o, GRADS.len());
        for fused in [true, false] {
            assert_near(
                &format!("{name} (fused {fused})"),
                &run_sgd(&o, fused),
                &want,
                1e-6,
            );
        }
    }
}

#[test]
fn adam_matches_pytorch_formulas() {
    for (name, o) in adam_cases() {
        let want = adam_reference(&o, GRADS.len());
        for fused in [true, false] {
            assert_near(
                &format!("{name} (fused {fused})"),
                &run_adam(&o, fused),
                &want,
                1e-5,
            );
        }
    }
}

/// The fused pass rounds as the composed candle ops do: the same bits, on a parameter large
/// enough to be split over several threads.
#[test]
fn fused_equals_composed_bit_for_bit() {
    let n = 100_003;
    let init: Vec<f32> = (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 250.0 - 2.0)
        .collect();
    let grad_of = |k: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i + 31 * k) * 104_729) % 2001) as f32 / 1000.0 - 1.0)
            .collect()
    };
    let check = |name: &str, mut make: MakeOpt| {
        let (a, b) = (param(&init), param(&init));
        let mut fused = make(&a);
        let mut composed = make(&b);
        for k in 0..4 {
            let g = grad_of(k);
            fused.step(&grads(&[&a], &g)).unwrap();
            composed.step(&grads(&[&b], &g)).unwrap();
        }
        let (va, vb) = (values(&a), values(&b));
        let differ = va
            .iter()
            .zip(&vb)
            .filter(|(x, y)| x.to_bits() != y.to_bits())
            .count();
        assert_eq!(differ, 0, "{name}: {differ} values differ");
        let max_diff = va
            .iter()
            .zip(&vb)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(max_diff <= 1e-6, "{name}: {max_diff}");
    };
    for (name, o) in adam_cases() {
        let mut first = true;
        check(
            name,
            Box::new(move |p| {
                let mut opt = Adam::new(&list(p), o.clone()).unwrap();
                opt.set_fused(first);
                first = false;
                Box::new(opt)
            }),
        );
    }
    for (name, o) in sgd_cases() {
        let mut first = true;
        check(
            name,
            Box::new(move |p| {
                let mut opt = SGD::new(&list(p), o.clone()).unwrap();
                opt.set_fused(first);
                first = false;
                Box::new(opt)
            }),
        );
    }
}

#[test]
fn clip_grad_norm_is_pytorchs() {
    let (a, b) = (param(&[3.0, 0.0]), param(&[0.0, 0.0, 4.0]));
    let c = param(&[1.0]); // never gets a gradient
    let mut g = {
        let ta = Tensor::new(&[3f32, 0.0], &Device::Cpu).unwrap();
        let tb = Tensor::new(&[0f32, 0.0, 4.0], &Device::Cpu).unwrap();
        let loss = ((a.tensor().unwrap() * ta).unwrap().sum_all().unwrap()
            + (b.tensor().unwrap() * tb).unwrap().sum_all().unwrap())
        .unwrap();
        loss.backward().unwrap()
    };
    let params = [a.clone(), b.clone(), c.clone()];
    let total = clip_grad_norm(&mut g, &params, 1.0, 2.0, true).unwrap();
    assert_eq!(total, 5.0);
    let coef = (1.0f32 / (5.0f32 + 1e-6)) * 1.0;
    let ga: Vec<f32> = g
        .get(a.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    let gb: Vec<f32> = g
        .get(b.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(ga, vec![3.0 * coef, 0.0]);
    assert_eq!(gb, vec![0.0, 0.0, 4.0 * coef]);
    assert!(g.get(c.var().unwrap().as_tensor()).is_none());

    // Within the bound: multiplied by 1, unchanged; the total is returned.
    let total = clip_grad_norm(&mut g, &params, 10.0, 2.0, true).unwrap();
    assert!((total - 1.0).abs() < 1e-6);
    let ga2: Vec<f32> = g
        .get(a.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(ga2, ga);

    // The infinity norm is the largest magnitude; order 1 the sum of magnitudes.
    let mut g = grads(&[&a], &[-3.0, 2.0]);
    let inf = clip_grad_norm(&mut g, [&a], 100.0, f64::INFINITY, true).unwrap();
    assert_eq!(inf, 3.0);
    let one = clip_grad_norm(&mut g, [&a], 100.0, 1.0, true).unwrap();
    assert_eq!(one, 5.0);

    // A bound other than 1: PyTorch's `max_norm / t` is `t.reciprocal() * max_norm`.
    let mut g = grads(&[&a], &[3.0, 4.0]);
    assert_eq!(clip_grad_norm(&mut g, [&a], 3.0, 2.0, true).unwrap(), 5.0);
    let coef = (1.0f32 / (5.0f32 + 1e-6)) * 3.0;
    let got: Vec<f32> = g
        .get(a.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(got, vec![3.0 * coef, 4.0 * coef]);

    // Non-finite: an error with error_if_nonfinite, and nothing is changed.
    let mut g = grads(&[&a], &[f32::NAN, 1.0]);
    let err = clip_grad_norm(&mut g, [&a], 1.0, 2.0, true).unwrap_err();
    assert!(err.to_string().contains("non-finite"), "{err}");
    let kept: Vec<f32> = g
        .get(a.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(kept[1], 1.0);
    assert!(clip_grad_norm(&mut g, [&a], 1.0, 2.0, false)
        .unwrap()
        .is_nan());
    assert!(clip_grad_norm(&mut g, [&a], 1.0, 0.0, false).is_err());
}

#[test]
fn clip_grad_value_clamps() {
    let a = param(&[0.0, 0.0, 0.0]);
    let mut g = grads(&[&a], &[-3.0, 0.25, 2.0]);
    clip_grad_value(&mut g, [&a], 0.5).unwrap();
    let got: Vec<f32> = g
        .get(a.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(got, vec![-0.5, 0.25, 0.5]);
}

/// Accumulated gradients are the sums of the micro-batches', and one step on them equals one step
/// on the sum.
#[test]
fn accumulation_sums_micro_batches() {
    use module_runtime::optim::GradAccumulator;
    let (a, b) = (param(&W0), param(&W0));
    let mut acc = GradAccumulator::new([&a]);
    for g in &GRADS[..3] {
        acc.add(&grads(&[&a], g)).unwrap();
    }
    assert_eq!(acc.micro_batches(), 3);
    let sum: Vec<f32> = (0..4)
        .map(|i| GRADS[0][i] + GRADS[1][i] + GRADS[2][i])
        .collect();
    let got: Vec<f32> = acc
        .grads()
        .get(a.var().unwrap().as_tensor())
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(got, sum);
    let mut opt_a = SGD::new(&list(&a), SgdOptions::new(0.1)).unwrap();
    let mut opt_b = SGD::new(&list(&b), SgdOptions::new(0.1)).unwrap();
    opt_a.step(acc.grads()).unwrap();
    opt_b.step(&grads(&[&b], &sum)).unwrap();
    assert_eq!(values(&a), values(&b));
    acc.zero_grad();
    assert_eq!(acc.micro_batches(), 0);
    assert!(acc.grads().get(a.var().unwrap().as_tensor()).is_none());
}

#[test]
fn a_parameter_listed_twice_is_an_error() {
    let a = param(&W0);
    let twice = ParamList(vec![("a".to_owned(), a.clone()), ("b".to_owned(), a)]);
    let err = SGD::new(&twice, SgdOptions::new(0.1)).err().unwrap();
    assert!(
        matches!(&err, module_runtime::optim::Error::DuplicateParam { path, first } if path == "b" && first == "a"),
        "{err}"
    );
}
