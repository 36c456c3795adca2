//! all-MiniLM-L6-v2 on the CPU: our derived BERT against candle-transformers' `BertModel` (the
//! model people run with candle today) and the same BERT written directly on candle-nn, for the
//! forward pass (batch of 32 sentences of 25 tokens, as in DESIGN.md §6), for a strict load of the
//! checkpoint, and for the time to a ready model (construct + load).
//!
//! Ours runs in three inference set-ups: `eval()` only (what a PyTorch user writes without
//! `no_grad`: every parameter records a graph), `eval()` + `no_grad()` (PyTorch's habit), and
//! `eval()` + `freeze("**")`.
//!
//! ```text
//! cargo bench -p minilm --features peers --bench minilm
//! ```
//!
//! The checkpoint comes from `MINILM_DIR` or `../shared/models/all-MiniLM-L6-v2`; without it the
//! benchmark says so and measures nothing. The device is `MODULE_DEVICE`'s (the CPU when unset).

use std::hint::black_box;
use std::path::Path;
use std::time::Duration;

use candle_nn::VarBuilder;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use module_runtime::prelude::*;
use module_runtime::{no_grad, Hooks};

#[path = "support/mod.rs"]
mod support;
use support::{inputs, peer, BATCH};

/// The same BERT, written directly against candle-nn: the baseline a user would otherwise write.
mod plain {
    use candle_core::{DType, Module, Result, Tensor};
    use candle_nn::{embedding, layer_norm, linear, Embedding, LayerNorm, Linear, VarBuilder};

    pub struct Layer {
        query: Linear,
        key: Linear,
        value: Linear,
        attention_out: Linear,
        attention_norm: LayerNorm,
        intermediate: Linear,
        output: Linear,
        output_norm: LayerNorm,
    }

    pub struct Bert {
        words: Embedding,
        positions: Embedding,
        token_types: Embedding,
        norm: LayerNorm,
        layers: Vec<Layer>,
        heads: usize,
    }

    impl Bert {
        pub fn load(vb: VarBuilder, layers: usize, hidden: usize, heads: usize) -> Result<Self> {
            let e = vb.pp("embeddings");
            let eps = 1e-12;
            let layers = (0..layers)
                .map(|i| {
                    let l = vb.pp(format!("encoder.layer.{i}"));
                    Ok(Layer {
                        query: linear(hidden, hidden, l.pp("attention.self.query"))?,
                        key: linear(hidden, hidden, l.pp("attention.self.key"))?,
                        value: linear(hidden, hidden, l.pp("attention.self.value"))?,
                        attention_out: linear(hidden, hidden, l.pp("attention.output.dense"))?,
                        attention_norm: layer_norm(
                            hidden,
                            eps,
                            l.pp("attention.output.LayerNorm"),
                        )?,
                        intermediate: linear(hidden, 4 * hidden, l.pp("intermediate.dense"))?,
                        output: linear(4 * hidden, hidden, l.pp("output.dense"))?,
                        output_norm: layer_norm(hidden, eps, l.pp("output.LayerNorm"))?,
                    })
                })
                .collect::<Result<_>>()?;
            Ok(Self {
                words: embedding(30522, hidden, e.pp("word_embeddings"))?,
                positions: embedding(512, hidden, e.pp("position_embeddings"))?,
                token_types: embedding(2, hidden, e.pp("token_type_embeddings"))?,
                norm: layer_norm(hidden, eps, e.pp("LayerNorm"))?,
                layers,
                heads,
            })
        }

        pub fn forward(&self, ids: &Tensor, mask: &Tensor) -> Result<Tensor> {
            let (b, t) = ids.dims2()?;
            let device = ids.device();
            let positions = Tensor::arange(0u32, t as u32, device)?.unsqueeze(0)?;
            let types = Tensor::zeros((b, t), DType::U32, device)?;
            let x = self
                .words
                .forward(ids)?
                .broadcast_add(&self.positions.forward(&positions)?)?
                .add(&self.token_types.forward(&types)?)?;
            let mut x = self.norm.forward(&x)?;
            let bias = ((1.0 - mask.to_dtype(DType::F32)?)? * f64::from(f32::MIN))?
                .reshape((b, 1, 1, t))?;
            for l in &self.layers {
                x = l.forward(&x, &bias, self.heads)?;
            }
            Ok(x)
        }
    }

    impl Layer {
        fn forward(&self, x: &Tensor, bias: &Tensor, heads: usize) -> Result<Tensor> {
            let (b, t, h) = x.dims3()?;
            let d = h / heads;
            let split = |y: Tensor| y.reshape((b, t, heads, d))?.transpose(1, 2)?.contiguous();
            let q = split((self.query.forward(x)? / (d as f64).sqrt())?)?;
            let k = split(self.key.forward(x)?)?;
            let v = split(self.value.forward(x)?)?;
            let scores = q.matmul(&k.t()?)?.broadcast_add(bias)?;
            let probs = candle_nn::ops::softmax_last_dim(&scores)?;
            let context = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h))?;
            let attended = self
                .attention_norm
                .forward(&(self.attention_out.forward(&context)? + x)?)?;
            let inner = self.intermediate.forward(&attended)?.gelu_erf()?;
            self.output_norm
                .forward(&(self.output.forward(&inner)? + &attended)?)
        }
    }
}

/// Our model, loaded strictly and in eval mode (nothing frozen).
fn ours(dir: &Path, device: &Device) -> Result<BertModel> {
    let model = BertModel::new(&BertConfig::minilm_l6(), device)?;
    model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
    model.eval();
    Ok(model)
}

/// Ours, built only to be loaded (`build_empty`), then loaded strictly: the time to a ready model.
fn ours_empty(dir: &Path, device: &Device) -> Result<BertModel> {
    let model = module_runtime::build_empty(|| BertModel::new(&BertConfig::minilm_l6(), device))?;
    model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
    Ok(model)
}

fn varbuilder(path: &Path, device: &Device) -> candle_core::Result<plain::Bert> {
    // SAFETY: the checkpoint is not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[path], DType::F32, device)? };
    plain::Bert::load(vb, 6, 384, 12)
}

fn forward(c: &mut Criterion) {
    let Some(dir) = minilm_dir() else {
        eprintln!("*** SKIPPED: no all-MiniLM-L6-v2 checkpoint (set MINILM_DIR) ***");
        return;
    };
    let device = candle_module::device_from_env().unwrap();
    let model = ours(&dir, &device).unwrap();
    let frozen = ours(&dir, &device).unwrap();
    frozen.freeze("**").unwrap();
    let baseline = varbuilder(&dir.join("model.safetensors"), &device).unwrap();
    let peer = peer(&dir, &device).unwrap();
    let (ids, mask) = inputs(&device).unwrap();
    let token_types = ids.zeros_like().unwrap();

    // All compute the same thing.
    let a = model.call((&ids, &mask)).unwrap();
    let b = baseline.forward(&ids, &mask).unwrap();
    let p = peer.forward(&ids, &token_types, Some(&mask)).unwrap();
    for other in [b, p] {
        let diff = (&a - other).unwrap().abs().unwrap().max_all().unwrap();
        assert!(diff.to_scalar::<f32>().unwrap() < 1e-4);
    }

    let hooks = Hooks::new();
    hooks.register_global_forward_hook(|_, _, _| Ok(None), HookOptions::default());

    let mut group = c.benchmark_group("minilm_forward_32x25");
    group.throughput(Throughput::Elements(BATCH as u64));
    group.measurement_time(Duration::from_secs(10));
    group.bench_function("candle_transformers_bert", |bench| {
        bench.iter(|| black_box(peer.forward(&ids, &token_types, Some(&mask)).unwrap()))
    });
    group.bench_function("plain_candle_nn", |bench| {
        bench.iter(|| black_box(baseline.forward(&ids, &mask).unwrap()))
    });
    group.bench_function("derived_eval_only", |bench| {
        bench.iter(|| black_box(model.call((&ids, &mask)).unwrap()))
    });
    group.bench_function("derived_eval_no_grad", |bench| {
        let _guard = no_grad();
        bench.iter(|| black_box(model.call((&ids, &mask)).unwrap()))
    });
    group.bench_function("derived_eval_freeze", |bench| {
        bench.iter(|| black_box(frozen.call((&ids, &mask)).unwrap()))
    });
    group.bench_function("derived_no_grad_noop_hook_every_module", |bench| {
        let _guard = no_grad();
        bench.iter(|| black_box(hooks.run(&model, |m| m.call((&ids, &mask))).unwrap()))
    });
    group.finish();
}

fn load(c: &mut Criterion) {
    let Some(dir) = minilm_dir() else {
        return;
    };
    let path = dir.join("model.safetensors");
    let device = candle_module::device_from_env().unwrap();
    let model = ours(&dir, &device).unwrap();

    let mut group = c.benchmark_group("minilm_load");
    group.bench_function("derived_strict_load_into_built_model", |bench| {
        bench.iter(|| {
            black_box(
                model
                    .load_state_dict(&path, &LoadOptions::default())
                    .unwrap(),
            )
        })
    });
    // The load alone into a model built only to load: building is outside the timing.
    group.bench_function("derived_strict_load_into_empty_model", |bench| {
        bench.iter_batched(
            || {
                module_runtime::build_empty(|| BertModel::new(&BertConfig::minilm_l6(), &device))
                    .unwrap()
            },
            |empty| {
                black_box(
                    empty
                        .load_state_dict(&path, &LoadOptions::default())
                        .unwrap(),
                )
            },
            criterion::BatchSize::PerIteration,
        )
    });
    group.bench_function("candle_nn_varbuilder_mmaped", |bench| {
        bench.iter(|| black_box(varbuilder(&path, &device).unwrap()))
    });
    group.finish();

    // Time to a ready model: construct + strict load.
    let mut group = c.benchmark_group("minilm_construct_and_load");
    group.bench_function("derived_eager_construct_then_load", |bench| {
        bench.iter(|| black_box(ours(&dir, &device).unwrap()))
    });
    group.bench_function("derived_build_empty_then_load", |bench| {
        bench.iter(|| black_box(ours_empty(&dir, &device).unwrap()))
    });
    group.bench_function("candle_transformers_varbuilder_load", |bench| {
        bench.iter(|| black_box(peer(&dir, &device).unwrap()))
    });
    group.finish();
}

criterion_group!(benches, forward, load);
criterion_main!(benches);
