//! Atomic weight updates (issue 46, item 1): threads calling a model while another thread keeps
//! replacing its weights — by `load_state_dict`, by several `Param::set`s in one
//! `atomic_update`, into a quantized model — must each get exactly the output of the weights of
//! before or of after, never of a mix. Every mode is also run with hooks and with a functional
//! call that substitutes one parameter.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use module_runtime::nn::{quantize, GgmlDType};
use module_runtime::prelude::*;
use module_runtime::{atomic_update, HookOptions};

const WIDTH: usize = 512;
const LAYERS: usize = 6;
const CALLERS: usize = 4;
const RUN_FOR: Duration = Duration::from_millis(1200);

#[derive(Module)]
struct Deep {
    layers: Vec<Linear>,
}

impl Forward<&Tensor> for Deep {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut x = x.clone();
        for layer in &self.layers {
            x = layer.call(&x)?.tanh()?;
        }
        Ok(x)
    }
}

fn deep() -> Deep {
    let dev = Device::Cpu;
    Deep {
        layers: (0..LAYERS)
            .map(|_| Linear::new(WIDTH, WIDTH, &dev).unwrap())
            .collect(),
    }
}

fn bits(t: &Tensor) -> Vec<u32> {
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    v.into_iter().map(f32::to_bits).collect()
}

/// How a caller thread runs the model.
#[derive(Clone, Copy, Debug)]
enum Caller {
    Plain,
    Hooked,
    Functional,
}

/// How the updating thread replaces the weights.
#[derive(Clone, Copy, Debug)]
enum Update {
    Load,
    SetEach,
}

fn update(model: &Deep, sd: &StateDict, how: Update) {
    match how {
        Update::Load => {
            model.load_state_dict(sd, &LoadOptions::default()).unwrap();
        }
        Update::SetEach => atomic_update(|| {
            for (name, p) in model.named_parameters() {
                p.set(sd.get(&name).unwrap()).unwrap();
            }
        }),
    }
}

/// Races `CALLERS` threads calling `model` as `caller` against one thread alternating the two state
/// dicts as `how` says, for `RUN_FOR`. An output of neither model fails the test, and so does a run
/// in which the callers did not see both.
fn race(model: Deep, how: Update, caller: Caller) {
    let dev = Device::Cpu;
    let model = Arc::new(model);
    let x = Tensor::randn(0f32, 1., (4, WIDTH), &dev).unwrap();
    // Copies: a state dict's tensors share the parameters' storage, which the loads overwrite.
    let (mut a, mut b) = (StateDict::new(), StateDict::new());
    for (k, t) in model.state_dict().unwrap().iter() {
        a.insert(k.to_owned(), t.copy().unwrap());
        b.insert(k.to_owned(), (t.neg().unwrap() * 1.5).unwrap());
    }
    let hooks = Hooks::new();
    hooks
        .register_forward_hook(
            "layers.2",
            |_, _, out| Ok(Some(vec![(&out[0] + 1.0)?])),
            HookOptions::default(),
        )
        .unwrap();
    let mut substitute = StateDict::new();
    substitute.insert("layers.0.bias", Tensor::full(0.25f32, WIDTH, &dev).unwrap());
    let run = {
        let (hooks, substitute, x) = (hooks.clone(), substitute.clone(), x.clone());
        move |m: &Deep| -> Vec<u32> {
            let y = match caller {
                Caller::Plain => m.call(&x),
                Caller::Hooked => hooks.run(m, |m| m.call(&x)),
                Caller::Functional => m.functional_call(&substitute, &x),
            };
            bits(&y.unwrap())
        }
    };
    update(&model, &a, how);
    let out_a = run(&model);
    update(&model, &b, how);
    let out_b = run(&model);
    assert_ne!(out_a, out_b);

    let stop = Arc::new(AtomicBool::new(false));
    let barrier = Arc::new(Barrier::new(CALLERS + 1));
    let (seen_a, seen_b) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (model, run, stop, barrier) =
                (model.clone(), run.clone(), stop.clone(), barrier.clone());
            let (out_a, out_b) = (out_a.clone(), out_b.clone());
            let (seen_a, seen_b) = (seen_a.clone(), seen_b.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut torn = 0;
                while !stop.load(Ordering::Relaxed) {
                    let y = run(&model);
                    if y == out_a {
                        seen_a.fetch_add(1, Ordering::Relaxed);
                    } else if y == out_b {
                        seen_b.fetch_add(1, Ordering::Relaxed);
                    } else {
                        torn += 1;
                    }
                }
                torn
            })
        })
        .collect();
    barrier.wait();
    let start = Instant::now();
    let mut loads = 0;
    while start.elapsed() < RUN_FOR {
        update(&model, if loads % 2 == 0 { &a } else { &b }, how);
        loads += 1;
    }
    stop.store(true, Ordering::Relaxed);
    let torn: usize = callers.into_iter().map(|h| h.join().unwrap()).sum();
    let (seen_a, seen_b) = (
        seen_a.load(Ordering::Relaxed),
        seen_b.load(Ordering::Relaxed),
    );
    eprintln!(
        "{how:?}/{caller:?}: {loads} updates, {seen_a} outputs of the first weights, {seen_b} of \
         the second, {torn} of neither"
    );
    assert_eq!(
        torn, 0,
        "{torn} outputs matched neither model ({how:?}, {caller:?})"
    );
    // The race really happened: callers saw both models.
    assert!(
        seen_a > 0 && seen_b > 0,
        "{seen_a} and {seen_b} outputs of each model"
    );
}

#[test]
fn calls_racing_loads_see_one_model_whole() {
    race(deep(), Update::Load, Caller::Plain);
}

#[test]
fn calls_racing_several_sets_in_one_update_see_one_model_whole() {
    race(deep(), Update::SetEach, Caller::Plain);
}

#[test]
fn hooked_and_functional_calls_racing_loads_see_one_model_whole() {
    race(deep(), Update::Load, Caller::Hooked);
    race(deep(), Update::Load, Caller::Functional);
}

#[test]
fn calls_racing_loads_into_a_quantized_model_see_one_model_whole() {
    let model = deep();
    let report = quantize(&model, "layers.*", GgmlDType::Q8_0).unwrap();
    assert_eq!(report.quantized.len(), LAYERS);
    race(model, Update::Load, Caller::Plain);
}

#[test]
fn an_update_inside_a_call_runs_without_waiting_for_itself() {
    // A forward hook writing a parameter of the model being called: the thread holds the call's
    // side of the lock, so the write must not wait for it (it would never return).
    let model = deep();
    let hooks = Hooks::new();
    let target = model.layers[5].bias.clone().unwrap();
    hooks
        .register_forward_hook(
            "layers.0",
            move |_, _, _| {
                target.set(&Tensor::zeros(WIDTH, DType::F32, &Device::Cpu)?)?;
                Ok(None)
            },
            HookOptions::default(),
        )
        .unwrap();
    let x = Tensor::ones((1, WIDTH), DType::F32, &Device::Cpu).unwrap();
    hooks.run(&model, |m| m.call(&x)).unwrap();
    let bias = model.layers[5].bias.as_ref().unwrap().tensor().unwrap();
    assert_eq!(
        bias.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        0.0
    );
}
