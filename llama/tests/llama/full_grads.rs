//! Full fine-tuning's gradients on the tiny-llama fixture: transformers' (every parameter's
//! gradient norm, and the whole gradients of the projections the fused rotary embedding and
//! SwiGLU product reach, `tests/fixtures/make_tiny_llama_grads.py`), and the same with fusion
//! off (candle's composed ops), with less held in the graph when fused.

use std::collections::HashMap;

use module_runtime::nn::{without_fusion, CrossEntropyLoss};
use module_runtime::prelude::*;

use super::{fixture, max_diff, reference};

/// transformers' loss (`labels=ids`): next-token cross-entropy over every position but the last.
fn loss(logits: &Tensor, ids: &Tensor) -> Tensor {
    let (b, t, vocab) = logits.dims3().unwrap();
    let logits = logits.narrow(1, 0, t - 1).unwrap();
    let logits = logits.reshape((b * (t - 1), vocab)).unwrap();
    let targets = ids.narrow(1, 1, t - 1).unwrap().flatten_all().unwrap();
    let targets = targets.to_dtype(DType::I64).unwrap();
    CrossEntropyLoss::new().call((&logits, &targets)).unwrap()
}

/// One training step's loss, the values the graph's intermediate tensors hold, and every
/// parameter's gradient by name.
fn step(model: &llama::LlamaForCausalLM) -> (f32, usize, HashMap<String, Tensor>) {
    let ids = reference()["prompts"].to_dtype(DType::U32).unwrap();
    let logits = model.call(&ids).unwrap();
    let loss = loss(&logits, &ids);
    let held = loss
        .sorted_nodes()
        .iter()
        .filter(|n| !n.is_variable())
        .map(|n| n.elem_count())
        .sum();
    let grads = loss.backward().unwrap();
    let grads = model
        .named_parameters()
        .into_iter()
        .map(|(name, p)| {
            let g = grads
                .get(&p.tensor().unwrap())
                .expect("every parameter's gradient");
            (name, g.clone())
        })
        .collect();
    (loss.to_scalar().unwrap(), held, grads)
}

fn norm(t: &Tensor) -> f32 {
    t.sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .sqrt()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// Every parameter's gradient of the training loss is transformers': the loss within 1e-5, each
/// gradient's norm within 1e-4 of it (relative), and the q/k projections' (through the rotary
/// embedding) and gate/up projections' (through the SwiGLU product) gradients value by value.
#[test]
fn full_fine_tuning_gradients_match_transformers() {
    let model = super::model();
    model.train();
    let torch =
        candle_core::safetensors::load(fixture().join("gradients.safetensors"), &Device::Cpu)
            .unwrap();
    let (loss, _, grads) = step(&model);
    let torch_loss = torch["loss"].to_vec1::<f32>().unwrap()[0];
    assert!(
        (loss - torch_loss).abs() < 1e-5,
        "loss {loss} vs {torch_loss}"
    );
    assert_eq!(grads.len(), 20, "{:?}", grads.keys());
    for (name, g) in &grads {
        let theirs = torch[&format!("norm.{name}")].to_vec1::<f32>().unwrap()[0];
        let ours = norm(g);
        assert!(
            (ours - theirs).abs() <= 1e-4 * theirs.max(1e-3),
            "{name}: gradient norm {ours} vs transformers' {theirs}"
        );
        if let Some(t) = torch.get(name) {
            let g = g.to_device(&Device::Cpu).unwrap();
            let diff = max_diff(&g, t);
            let scale = t
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert!(
                diff <= 1e-4 * scale,
                "{name}: {diff} from transformers' (max {scale})"
            );
        }
    }
}

/// With fusion (the rotary embedding and SwiGLU product as single ops, among the others) the
/// gradients are those of candle's composed ops within float32 rounding, and the graph holds
/// less: no rotated copies of the queries and keys, no `silu(gate)`.
#[test]
fn fused_training_ops_give_the_composed_gradients_and_hold_less() {
    let model = super::model();
    model.train();
    let (loss, held, grads) = step(&model);
    let (plain_loss, plain_held, plain) = without_fusion(|| step(&model));
    assert!((loss - plain_loss).abs() < 1e-5, "{loss} vs {plain_loss}");
    for (name, g) in &grads {
        let diff = max_diff(g, &plain[name]);
        let scale = norm(&plain[name]).max(1e-3);
        assert!(diff <= 1e-5 * scale, "{name}: {diff} (norm {scale})");
    }
    // (270 293 against 367 667 values: the composed rotations' copies and `silu(gate)`.) The
    // fused ops are CPU kernels: on another device (`MODULE_DEVICE`) both runs compose.
    if super::device().is_cpu() {
        assert!(
            held * 4 < plain_held * 3,
            "{held} values held fused, {plain_held} composed"
        );
    }
}
