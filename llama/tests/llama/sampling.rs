//! Generation's logits processors against transformers' (`tests/fixtures/processors.json`, made
//! by `make_processors.py`), and seeded sampling's reproducibility.

use llama::generate::{apply_repetition_penalty, apply_top_k, apply_top_p};
use llama::{generate, GenerationConfig};

use super::{fixture, model, reference_json};

fn processors() -> serde_json::Value {
    let path = fixture().join("../processors.json");
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn floats(v: &serde_json::Value) -> Vec<f32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().map_or(f32::NEG_INFINITY, |x| x as f32))
        .collect()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        let same = (a.is_infinite() && a == b) || (a - b).abs() <= 1e-5 * b.abs().max(1.0);
        assert!(same, "{what}[{i}]: {a} vs transformers' {b}");
    }
}

/// transformers' `_compute_llama3_parameters` frequencies for head_dim 64, theta 500000.
pub fn llama3_inv_freq() -> Vec<f32> {
    floats(&processors()["llama3_inv_freq"])
}

#[test]
fn processors_match_transformers() {
    let p = processors();
    let scores = floats(&p["scores"]);
    let seen: Vec<u32> = serde_json::from_value(p["seen"].clone()).unwrap();
    let mut s = scores.clone();
    apply_repetition_penalty(&mut s, &seen, 1.3);
    assert_close(&s, &floats(&p["repetition_1.3"]), "repetition penalty");
    let mut s: Vec<f32> = scores.iter().map(|x| x / 0.7).collect();
    apply_top_k(&mut s, 5);
    assert_close(
        &s,
        &floats(&p["temperature_0.7_top_k_5"]),
        "temperature, top-k",
    );
    let mut s = scores.clone();
    apply_top_p(&mut s, 0.8);
    assert_close(&s, &floats(&p["top_p_0.8"]), "top-p");
}

#[test]
fn seeded_sampling_is_reproducible() {
    let model = model();
    let (prompts, greedy) = reference_json();
    let config = GenerationConfig {
        max_new_tokens: 12,
        temperature: Some(1.5),
        top_k: Some(40),
        top_p: Some(0.95),
        repetition_penalty: 1.1,
        seed: 7,
        ..Default::default()
    };
    let a = generate(&model, &prompts, &config).unwrap();
    assert_eq!(a, generate(&model, &prompts, &config).unwrap());
    assert_ne!(a[0], greedy[0][..12]);
    let other = generate(
        &model,
        &prompts,
        &GenerationConfig {
            seed: 8,
            ..config.clone()
        },
    )
    .unwrap();
    assert_ne!(a, other);
    // top_k 1 is greedy whatever the temperature and seed.
    let top1 = GenerationConfig {
        top_k: Some(1),
        top_p: None,
        repetition_penalty: 1.0,
        ..config
    };
    assert_eq!(
        generate(&model, &prompts, &top1).unwrap()[1],
        greedy[1][..12]
    );
}

#[test]
fn stop_tokens_end_a_row_and_bad_configs_are_errors() {
    let model = model();
    let (prompts, greedy) = reference_json();
    // Stop at the 5th greedy token of the first prompt: it is the last one printed.
    let stop = greedy[0][4];
    let config = GenerationConfig {
        max_new_tokens: 40,
        stop_tokens: vec![stop],
        ..Default::default()
    };
    let out = generate(&model, &prompts, &config).unwrap();
    assert_eq!(out[0], greedy[0][..5]);
    let bad = GenerationConfig {
        top_p: Some(1.5),
        ..Default::default()
    };
    let err = generate(&model, &prompts, &bad).unwrap_err();
    assert!(err.to_string().contains("top_p"), "{err}");
    let err = generate(&model, &[vec![1000]], &GenerationConfig::default()).unwrap_err();
    assert!(err.to_string().contains("1000"), "{err}");
}
