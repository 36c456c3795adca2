//! The module layer's own costs, each beside the same work written directly on candle / candle-nn:
//! traversal and state dicts of a BERT-base-sized model (random weights), `to_dtype(F16)`, one AdamW
//! step of the digits model, and `call` against `forward` on a tiny module (one and three levels
//! deep, a failing call's error path, and calls with a no-op hook attached).
//!
//! ```text
//! cargo bench -p minilm --bench modules
//! ```

use std::hint::black_box;

use candle_module::DigitNet;
use candle_nn::{linear, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, Criterion};
use minilm::bert::{BertConfig, BertModel};
use module_runtime::prelude::*;

/// A VarMap holding the same tensors as `model`, under the same names: candle-nn's registry.
fn varmap_of(model: &BertModel) -> VarMap {
    let map = VarMap::new();
    {
        let mut data = map.data().lock().unwrap();
        for (name, p) in model.named_parameters() {
            data.insert(name, p.var().unwrap());
        }
    }
    map
}

fn traversal(c: &mut Criterion) {
    let model = BertModel::new(&BertConfig::base(), &Device::Cpu).unwrap();
    let varmap = varmap_of(&model);
    let mut group = c.benchmark_group("bert_base_traversal");
    group.bench_function("derived_named_parameters", |b| {
        b.iter(|| black_box(model.named_parameters()))
    });
    group.bench_function("candle_nn_varmap_all_vars", |b| {
        b.iter(|| black_box(varmap.all_vars()))
    });
    group.bench_function("candle_nn_varmap_named_vars", |b| {
        b.iter(|| {
            let data = varmap.data().lock().unwrap();
            black_box(
                data.iter()
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<Vec<_>>(),
            )
        })
    });
    group.bench_function("derived_named_modules", |b| {
        b.iter(|| black_box(model.named_modules().len()))
    });
    group.bench_function("derived_state_dict", |b| {
        b.iter(|| black_box(model.state_dict().unwrap()))
    });
    // Attaching hooks to the model (a `run` that calls nothing): with a global hook only, and with
    // a hook on one module (its pattern checked against every path).
    let global = Hooks::new();
    global.register_global_forward_hook(|_, _, _| Ok(None), HookOptions::default());
    group.bench_function("derived_attach_global_hook", |b| {
        b.iter(|| {
            black_box(
                global
                    .run(&model, |_| Ok::<_, module_runtime::Error>(1))
                    .unwrap(),
            )
        })
    });
    let last = model.named_modules().last().unwrap().0.clone();
    let targeted = Hooks::new();
    targeted
        .register_forward_hook(&last, |_, _, _| Ok(None), HookOptions::default())
        .unwrap();
    group.bench_function("derived_attach_targeted_hook", |b| {
        b.iter(|| {
            black_box(
                targeted
                    .run(&model, |_| Ok::<_, module_runtime::Error>(1))
                    .unwrap(),
            )
        })
    });
    group.finish();
}

fn to_dtype(c: &mut Criterion) {
    let mut group = c.benchmark_group("bert_base_to_dtype_f16");
    group.sample_size(10);
    group.bench_function("derived_to_dtype", |b| {
        b.iter_batched(
            || BertModel::new(&BertConfig::base(), &Device::Cpu).unwrap(),
            |model| {
                model.to_dtype(DType::F16).unwrap();
                model
            },
            criterion::BatchSize::PerIteration,
        )
    });
    group.bench_function("candle_vars_to_dtype", |b| {
        b.iter_batched(
            || {
                let model = BertModel::new(&BertConfig::base(), &Device::Cpu).unwrap();
                model
                    .named_parameters()
                    .into_iter()
                    .map(|(_, p)| p.var().unwrap())
                    .collect::<Vec<_>>()
            },
            |vars| {
                vars.iter()
                    .map(|v| candle_core::Var::from_tensor(&v.to_dtype(DType::F16).unwrap()))
                    .collect::<candle_core::Result<Vec<_>>>()
                    .unwrap()
            },
            criterion::BatchSize::PerIteration,
        )
    });
    group.finish();
}

/// The same network on candle-nn's `Linear` and `VarMap`.
struct PlainDigitNet {
    fc1: candle_nn::Linear,
    fc2: candle_nn::Linear,
    head: candle_nn::Linear,
}

impl candle_core::Module for PlainDigitNet {
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let h = self.fc1.forward(x)?.relu()?;
        let h = self.fc2.forward(&h)?.relu()?;
        self.head.forward(&h)
    }
}

fn train_step(c: &mut Criterion) {
    let device = Device::Cpu;
    let x = Tensor::rand(0f32, 1f32, (32, 64), &device).unwrap();
    let labels = Tensor::from_vec((0..32u32).map(|i| i % 10).collect(), 32, &device).unwrap();
    let params = ParamsAdamW {
        lr: 3e-3,
        ..ParamsAdamW::default()
    };

    let model = DigitNet::new(&device).unwrap();
    let mut opt = candle_nn::AdamW::new(model.trainable_vars().unwrap(), params.clone()).unwrap();

    let varmap = VarMap::new();
    let vb = VarBuilder::from_varmap(&varmap, DType::F32, &device);
    let plain = PlainDigitNet {
        fc1: linear(64, 128, vb.pp("fc1")).unwrap(),
        fc2: linear(128, 64, vb.pp("fc2")).unwrap(),
        head: linear(64, 10, vb.pp("head")).unwrap(),
    };
    let mut plain_opt = candle_nn::AdamW::new(varmap.all_vars(), params).unwrap();

    let mut group = c.benchmark_group("digits_adamw_step_batch32");
    group.bench_function("candle_nn_by_hand", |b| {
        b.iter(|| {
            let logits = candle_core::Module::forward(&plain, &x).unwrap();
            let loss = candle_nn::loss::cross_entropy(&logits, &labels).unwrap();
            plain_opt.backward_step(&loss).unwrap();
        })
    });
    group.bench_function("derived", |b| {
        b.iter(|| {
            let logits = model.call(&x).unwrap();
            let loss = candle_nn::loss::cross_entropy(&logits, &labels).unwrap();
            opt.backward_step(&loss).unwrap();
        })
    });
    group.finish();
}

/// A module whose forward does almost nothing, so the cost of `call` itself shows.
#[derive(Module)]
struct Tiny {
    scale: f64,
}

impl Forward<f64> for Tiny {
    type Output = f64;

    fn forward(&self, x: f64) -> Result<f64> {
        Ok(x * self.scale)
    }
}

/// Three levels of `call` around [`Tiny`]: every level's success path (hook check and forward
/// error naming, which must cost nothing when nothing fails) shows against one `forward`.
#[derive(Module)]
struct Outer {
    mid: Mid,
}

#[derive(Module)]
struct Mid {
    inner: Tiny,
}

impl Forward<f64> for Outer {
    type Output = f64;

    fn forward(&self, x: f64) -> Result<f64> {
        self.mid.call(x)
    }
}

impl Forward<f64> for Mid {
    type Output = f64;

    fn forward(&self, x: f64) -> Result<f64> {
        // A negative input fails, so the error path can be timed too.
        if x < 0.0 {
            return Err(module_runtime::Error::InvalidDevice {
                name: String::from("negative"),
            });
        }
        self.inner.call(x)
    }
}

fn call_overhead(c: &mut Criterion) {
    let tiny = Tiny { scale: 1.5 };
    let mut group = c.benchmark_group("call_overhead");
    group.bench_function("forward", |b| {
        b.iter(|| black_box(tiny.forward(black_box(2.0)).unwrap()))
    });
    group.bench_function("call_no_hooks", |b| {
        b.iter(|| black_box(tiny.call(black_box(2.0)).unwrap()))
    });
    let outer = Outer {
        mid: Mid {
            inner: Tiny { scale: 1.5 },
        },
    };
    // Within noise of `forward` (plus two calls' worth of `call_no_hooks`).
    group.bench_function("call_no_hooks_3_deep", |b| {
        b.iter(|| black_box(outer.call(black_box(2.0)).unwrap()))
    });
    // The cold path, for the record: an error named by path through two frames.
    group.bench_function("call_error_3_deep", |b| {
        b.iter(|| black_box(outer.call(black_box(-2.0)).unwrap_err()))
    });
    // With a registry attached: what dispatch costs per call when every call must find its
    // path and fire a hook. One `run` per three-deep call (attaching included), and one `run`
    // around 100 of them (per-call dispatch dominates).
    let global = Hooks::new();
    global.register_global_forward_hook(|_, _, _| Ok(None), HookOptions::default());
    group.bench_function("global_noop_hook_run_3_deep", |b| {
        b.iter(|| black_box(global.run(&outer, |m| m.call(black_box(2.0))).unwrap()))
    });
    // 100 three-deep calls under one `run` of `hooks`.
    let hundred_calls = |hooks: &Hooks| {
        hooks
            .run(&outer, |m| -> Result<f64> {
                let mut sum = 0.0;
                for _ in 0..100 {
                    sum += m.call(black_box(2.0))?;
                }
                Ok(sum)
            })
            .unwrap()
    };
    group.bench_function("global_noop_hook_100_calls_3_deep", |b| {
        b.iter(|| hundred_calls(&global))
    });
    // A hook on the innermost module only: the other two calls find their path and fire nothing.
    let targeted = Hooks::new();
    targeted
        .register_forward_hook("mid.inner", |_, _, _| Ok(None), HookOptions::default())
        .unwrap();
    group.bench_function("targeted_noop_hook_100_calls_3_deep", |b| {
        b.iter(|| hundred_calls(&targeted))
    });
    group.finish();
}

criterion_group!(benches, traversal, to_dtype, train_step, call_overhead);
criterion_main!(benches);
