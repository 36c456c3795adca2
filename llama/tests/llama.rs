//! The tiny random Llama transformers saved (`tests/fixtures/tiny-llama`: multi-query attention,
//! tied embeddings) through the public API: logits and greedy generations against transformers',
//! the KV cache against recomputing, left-padded batches against single prompts, cache clones and
//! truncation, RoPE scaling, and the `generate` example's code path. The device is
//! `MODULE_DEVICE`'s (the CPU when unset), as for the workspace's other tests.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use llama::json_lines::generate_json_lines;
use llama::{generate, GenerationConfig, KvCache, LlamaConfig, LlamaForCausalLM, RopeScaling};
use module_runtime::prelude::*;

#[path = "llama/adapter.rs"]
mod adapter;
#[path = "llama/device_map.rs"]
mod device_map;
#[path = "llama/finetune.rs"]
mod finetune;
#[path = "llama/full_grads.rs"]
mod full_grads;
#[path = "llama/gguf_export.rs"]
mod gguf_export;
#[path = "llama/gguf_metadata.rs"]
mod gguf_metadata;
#[path = "llama/gqa.rs"]
mod gqa;
#[path = "llama/quant.rs"]
mod quant;
#[path = "llama/sampling.rs"]
mod sampling;
#[path = "llama/stream.rs"]
mod stream;
#[path = "llama/tensor_parallel.rs"]
mod tensor_parallel;

/// The device under test: `MODULE_DEVICE` (`cuda:0`), else the CPU.
fn device() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-llama")
}

/// A folder under the system's temporary one, named for `name` and this process.
fn temp_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("llama-{name}-{}", std::process::id()))
}

fn model() -> LlamaForCausalLM {
    LlamaForCausalLM::from_pretrained(&fixture(), &device()).unwrap()
}

fn reference() -> HashMap<String, Tensor> {
    candle_core::safetensors::load(fixture().join("reference.safetensors"), &device()).unwrap()
}

/// The reference prompts and transformers' 40 greedy tokens after each, from `reference.json`.
fn reference_json() -> (Vec<Vec<u32>>, Vec<Vec<u32>>) {
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    let ids = |key: &str| -> Vec<Vec<u32>> { serde_json::from_value(json[key].clone()).unwrap() };
    (ids("prompts"), ids("generated"))
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn ids(rows: &[Vec<u32>]) -> Tensor {
    let width = rows[0].len();
    let flat: Vec<u32> = rows.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (rows.len(), width), &device()).unwrap()
}

#[test]
fn loads_strictly_by_hugging_face_names_with_tied_head() {
    let model = model();
    let names: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(n, _)| n)
        .collect();
    assert_eq!(names.first().unwrap(), "model.embed_tokens.weight");
    assert!(names.contains(&"model.layers.1.self_attn.k_proj.weight".to_owned()));
    assert!(names.contains(&"model.layers.0.mlp.gate_proj.weight".to_owned()));
    assert!(names.contains(&"model.norm.weight".to_owned()));
    // Tied: one parameter, listed once, under the embedding's path.
    assert!(!names.contains(&"lm_head.weight".to_owned()));
    let head = model.lm_head.weight.tensor().unwrap();
    let embed = model.model.embed_tokens.weight.tensor().unwrap();
    assert_eq!(max_diff(&head, &embed), 0.0);
    assert_eq!(
        model.model.layers[0].self_attn.k_proj.weight.shape().dims(),
        [16, 64]
    );
}

/// The MLP's activation is a module, as transformers' `act_fn`: hooks see every layer's gate
/// activations by path, and a hook that replaces them changes the logits.
#[test]
fn hooks_see_and_replace_the_mlp_activation() {
    let model = model();
    let prompts = reference()["prompts"].to_dtype(DType::U32).unwrap();
    let run = |hooks: &Hooks| {
        hooks
            .run(&model, |m| m.scan(&prompts, m.initial_state(3)?))
            .unwrap()
            .0
    };
    let plain = run(&Hooks::new());
    let hooks = Hooks::new();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let record = seen.clone();
    hooks
        .register_forward_hook(
            "model.layers.*.mlp.act_fn",
            move |ctx, input, output| {
                // The SiLU of the gate, here a vectorized kernel: within float32 rounding of
                // candle's.
                let want = input[0].silu()?;
                let diff = (&output[0] - want)?.abs()?.flatten_all()?.max(0)?;
                record.lock().unwrap().push((
                    ctx.path().to_string(),
                    output[0].dims().to_vec(),
                    diff.to_scalar::<f32>()?,
                ));
                Ok(None)
            },
            HookOptions::default(),
        )
        .unwrap();
    assert_eq!(max_diff(&run(&hooks), &plain), 0.0);
    let seen = seen.lock().unwrap();
    let layers = model.model.layers.len();
    assert_eq!(seen.len(), layers);
    for (i, (path, dims, diff)) in seen.iter().enumerate() {
        assert_eq!(path, &format!("model.layers.{i}.mlp.act_fn"));
        assert_eq!(dims, &[3, 7, 176]);
        assert!(*diff < 1e-6, "{path}: {diff}");
    }
    let zeroed = Hooks::new();
    zeroed
        .register_forward_hook(
            "model.layers.0.mlp.act_fn",
            |_, _, output| Ok(Some(vec![output[0].zeros_like()?])),
            HookOptions::default(),
        )
        .unwrap();
    assert!(max_diff(&run(&zeroed), &plain) > 1e-3);
}

#[test]
fn untied_checkpoint_needs_its_head() {
    let mut cfg = LlamaConfig::from_json_file(&fixture().join("config.json")).unwrap();
    cfg.tie_word_embeddings = false;
    let model = LlamaForCausalLM::new(&cfg, &device()).unwrap();
    let err = model
        .load_state_dict(fixture().join("model.safetensors"), &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("lm_head.weight"), "{err}");
}

#[test]
fn logits_match_transformers() {
    let model = model();
    let reference = reference();
    let prompts = reference["prompts"].to_dtype(DType::U32).unwrap();
    let (logits, cache) = model
        .scan(&prompts, model.initial_state(3).unwrap())
        .unwrap();
    assert_eq!(cache.len(), 7);
    let diff = max_diff(&logits, &reference["logits"]);
    assert!(diff < 1e-4, "max logit difference {diff}");
    // Out-of-vocabulary ids and a cache of another batch size are errors, not panics.
    let bad = Tensor::new(&[[1u32, 1000]], &device()).unwrap();
    assert!(model.scan(&bad, model.initial_state(1).unwrap()).is_err());
    let err = model
        .scan(&prompts, model.initial_state(2).unwrap())
        .unwrap_err();
    assert!(err.to_string().contains("2 rows"), "{err}");
}

#[test]
fn greedy_generation_matches_transformers() {
    let model = model();
    let (prompts, expected) = reference_json();
    let config = GenerationConfig {
        max_new_tokens: 40,
        ..Default::default()
    };
    // As a batch, and one prompt at a time.
    assert_eq!(generate(&model, &prompts, &config).unwrap(), expected);
    for (prompt, want) in prompts.iter().zip(&expected) {
        let got = generate(&model, std::slice::from_ref(prompt), &config).unwrap();
        assert_eq!(&got[0], want);
    }
}

#[test]
fn example_code_path_prints_transformers_generations() {
    let model = model();
    let (prompts, expected) = reference_json();
    let input: String = prompts
        .iter()
        .map(|p| serde_json::to_string(p).unwrap() + "\n")
        .collect();
    let config = GenerationConfig {
        max_new_tokens: 40,
        stop_tokens: model.config.eos_token_ids.clone(),
        ..Default::default()
    };
    let mut out = Vec::new();
    generate_json_lines(&model, &config, input.as_bytes(), &mut out).unwrap();
    let lines: Vec<Vec<u32>> = String::from_utf8(out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines, expected);
    let err = generate_json_lines(&model, &config, "[1, x]\n".as_bytes(), Vec::new()).unwrap_err();
    assert!(err.to_string().contains("line 1"), "{err}");
}

#[test]
fn cached_decoding_equals_recomputing_every_step() {
    let model = model();
    let (prompts, generated) = reference_json();
    let seq: Vec<u32> = prompts[0]
        .iter()
        .chain(&generated[0][..10])
        .copied()
        .collect();
    let (_, mut cache) = model
        .scan(
            &ids(&[seq[..7].to_vec()]),
            model.cache_with_capacity(1, 8).unwrap(),
        )
        .unwrap();
    for t in 7..seq.len() {
        let (step, next) = model
            .step(&Tensor::new(&[seq[t]], &device()).unwrap(), cache)
            .unwrap();
        cache = next;
        let (full, _) = model
            .scan(&ids(&[seq[..=t].to_vec()]), model.initial_state(1).unwrap())
            .unwrap();
        let last = full.narrow(1, t, 1).unwrap().squeeze(1).unwrap();
        let diff = max_diff(&step, &last);
        assert!(diff < 1e-4, "step {t}: {diff}");
    }
    // The cache started with room for 8 and grew in place as tokens came.
    assert_eq!(cache.len(), seq.len());
    assert!(cache.capacity() >= seq.len());
}

#[test]
fn left_padded_batch_equals_prompts_one_by_one() {
    let model = model();
    let (prompts, _) = reference_json();
    let short = [
        prompts[0][..3].to_vec(),
        prompts[1].clone(),
        prompts[2][2..].to_vec(),
    ];
    let width = 7;
    let padded: Vec<Vec<u32>> = short
        .iter()
        .map(|p| [vec![0; width - p.len()], p.clone()].concat())
        .collect();
    let mask: Vec<Vec<u32>> = short
        .iter()
        .map(|p| [vec![0; width - p.len()], vec![1; p.len()]].concat())
        .collect();
    let (logits, mut cache) = model
        .scan_masked(&ids(&padded), &ids(&mask), model.initial_state(3).unwrap())
        .unwrap();
    assert_eq!(cache.padding(), [4, 0, 2]);
    let next = Tensor::new(&[5u32, 6, 7], &device()).unwrap();
    let (stepped, next_cache) = model.step(&next, cache).unwrap();
    cache = next_cache;
    assert_eq!(cache.positions(), [4, 8, 6]);
    for (i, p) in short.iter().enumerate() {
        let (alone, alone_cache) = model
            .scan(
                &ids(std::slice::from_ref(p)),
                model.initial_state(1).unwrap(),
            )
            .unwrap();
        let row = logits.narrow(0, i, 1).unwrap();
        let real = row.narrow(1, width - p.len(), p.len()).unwrap();
        let diff = max_diff(&real, &alone);
        assert!(diff < 1e-4, "row {i}: {diff}");
        let token = Tensor::new(&[[5u32, 6, 7][i]], &device()).unwrap();
        let (alone_step, _) = model.step(&token, alone_cache).unwrap();
        let diff = max_diff(&stepped.narrow(0, i, 1).unwrap(), &alone_step);
        assert!(diff < 1e-4, "row {i}, next step: {diff}");
    }
    // A later chunk keeps the first chunk's padding; padding in it is refused.
    let chunk = ids(&[vec![8, 9], vec![8, 9], vec![8, 9]]);
    let ones = ids(&[vec![1, 1], vec![1, 1], vec![1, 1]]);
    let (_, cache) = model.scan_masked(&chunk, &ones, cache).unwrap();
    assert_eq!((cache.padding(), cache.len()), (&[4usize, 0, 2][..], 10));
    let zeros = ids(&[vec![0, 1], vec![1, 1], vec![1, 1]]);
    assert!(model.scan_masked(&chunk, &zeros, cache).is_err());
    // Right padding is refused, naming the row.
    let bad = ids(&[vec![1, 1, 0], vec![1, 1, 1]]);
    let err = model
        .scan_masked(
            &ids(&[vec![1, 2, 3], vec![4, 5, 6]]),
            &bad,
            model.initial_state(2).unwrap(),
        )
        .unwrap_err();
    assert!(err.to_string().contains("row 0"), "{err}");
}

/// The logits of one more token after `cache`.
fn next_logits(model: &LlamaForCausalLM, cache: KvCache, token: u32) -> (Tensor, KvCache) {
    model
        .step(&Tensor::new(&[token], &device()).unwrap(), cache)
        .unwrap()
}

#[test]
fn cloned_caches_are_independent() {
    let model = model();
    let (prompts, _) = reference_json();
    let (_, cache) = model
        .scan(
            &ids(&prompts[..1]),
            model.cache_with_capacity(1, 16).unwrap(),
        )
        .unwrap();
    let branch = cache.clone();
    let (a, cache) = next_logits(&model, cache, 10);
    // The original wrote token 10 into its slot 7; the branch's slot 7 gets token 20, and the
    // original's next step must still see token 10 there.
    let (b, branch) = next_logits(&model, branch, 20);
    assert!(max_diff(&a, &b) > 1e-2);
    let (after_original, _) = next_logits(&model, cache, 30);
    let (full, _) = model
        .scan(
            &ids(&[[prompts[0].clone(), vec![10, 30]].concat()]),
            model.initial_state(1).unwrap(),
        )
        .unwrap();
    let want = full.narrow(1, 8, 1).unwrap().squeeze(1).unwrap();
    assert!(max_diff(&after_original, &want) < 1e-4);
    assert_eq!(branch.len(), 8);
}

#[test]
fn truncated_cache_forgets_the_last_tokens() {
    let model = model();
    let (prompts, _) = reference_json();
    let (_, mut cache) = model
        .scan(&ids(&prompts[..1]), model.initial_state(1).unwrap())
        .unwrap();
    let (_, next) = next_logits(&model, cache, 10);
    cache = next;
    let (_, next) = next_logits(&model, cache, 11);
    cache = next;
    cache.truncate(7).unwrap();
    assert_eq!((cache.len(), cache.positions()), (7, vec![7]));
    let (after, _) = next_logits(&model, cache.clone(), 12);
    let (_, fresh) = model
        .scan(&ids(&prompts[..1]), model.initial_state(1).unwrap())
        .unwrap();
    let (want, _) = next_logits(&model, fresh, 12);
    assert!(max_diff(&after, &want) < 1e-5);
    assert!(cache.truncate(9).is_err());
}

#[test]
fn rope_scaling_follows_transformers() {
    let json = |rope: &str| -> LlamaConfig {
        let text = format!(
            r#"{{"vocab_size": 8, "hidden_size": 64, "intermediate_size": 8,
                "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": 131072,
                {rope}}}"#
        );
        LlamaConfig::from_json(&serde_json::from_str(&text).unwrap()).unwrap()
    };
    // Llama 3.1's rope_scaling (old format), values from transformers'
    // `_compute_llama3_parameters` for head_dim 64, theta 500000.
    let cfg = json(
        r#""rope_theta": 500000.0, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
           "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
    );
    assert!(matches!(cfg.rope_scaling, RopeScaling::Llama3 { .. }));
    let inv = cfg.inv_freq();
    let expected = sampling::llama3_inv_freq();
    for (i, (a, b)) in inv.iter().zip(expected).enumerate() {
        assert!((a - b).abs() <= 1e-6 * b.abs(), "inv_freq[{i}]: {a} vs {b}");
    }
    let linear =
        json(r#""rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}"#);
    let plain = json(r#""rope_theta": 10000.0"#);
    for (l, p) in linear.inv_freq().iter().zip(plain.inv_freq()) {
        assert_eq!(*l, p / 4.0);
    }
    let err = LlamaConfig::from_json(
        &serde_json::from_str(r#"{"rope_scaling": {"type": "yarn", "factor": 2.0}}"#).unwrap(),
    )
    .unwrap_err();
    assert!(err.contains("yarn") || err.contains("missing"), "{err}");
}

/// `gradient_checkpointing_enable()`: the training forward (`call`) checkpoints every decoder
/// layer, and the gradients are the plain run's, bit for bit (on the CPU, where checkpointing
/// runs); generation with a cache is unchanged.
#[test]
fn gradient_checkpointing_gives_the_plain_gradients_bit_for_bit() {
    let model = LlamaForCausalLM::from_pretrained(&fixture(), &Device::Cpu).unwrap();
    let ids = Tensor::new(
        &[[242u32, 175, 307, 12, 99], [5, 17, 301, 44, 2]],
        &Device::Cpu,
    )
    .unwrap();
    model.train();
    // The gradients, and how many values the graph's intermediate tensors hold.
    type Gradients = Vec<(String, Option<Vec<f32>>)>;
    let run = || -> (Gradients, usize) {
        let logits = model.call(&ids).unwrap();
        let held = logits
            .sorted_nodes()
            .iter()
            .filter(|n| !n.is_variable())
            .map(|n| n.elem_count())
            .sum();
        let loss = logits.sqr().unwrap().mean_all().unwrap();
        let grads = loss.backward().unwrap();
        let grads = model
            .named_parameters()
            .into_iter()
            .map(|(name, p)| {
                let g = grads.get(&p.tensor().unwrap());
                (name, g.map(|g| g.flatten_all().unwrap().to_vec1().unwrap()))
            })
            .collect();
        (grads, held)
    };
    let (plain_logits, _) = model.scan(&ids, model.initial_state(2).unwrap()).unwrap();
    let (plain, plain_held) = run();
    model.gradient_checkpointing_enable();
    let (checkpointed, checkpointed_held) = run();
    assert_eq!(checkpointed, plain);
    assert!(plain.iter().all(|(_, g)| g.is_some()));
    assert!(
        checkpointed_held * 2 < plain_held,
        "{checkpointed_held} values held checkpointed, {plain_held} plain"
    );
    let (logits, _) = model.scan(&ids, model.initial_state(2).unwrap()).unwrap();
    assert_eq!(max_diff(&logits, &plain_logits), 0.0);
    model.gradient_checkpointing_disable();
}
