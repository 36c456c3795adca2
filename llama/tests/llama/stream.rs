//! Streaming loads: a Hugging Face sharded checkpoint (`model.safetensors.index.json` over three
//! shards) read tensor by tensor into a model built empty (`build_empty`), quantized on the way
//! when `quantize` marked the empty model first — equal, byte for byte, to loading the float
//! model and quantizing it after; and `LlamaForCausalLM::from_pretrained_quantized`, which loads a
//! folder that way, for `q8_0`, `q4_0` and `q4_K`.

use std::path::{Path, PathBuf};

use llama::LlamaForCausalLM;
use module_runtime::nn::{quantize, GgmlDType, Linear};
use module_runtime::prelude::*;
use module_runtime::{build_empty, Error, QuantizeError};

use super::{device, ids, max_diff, model, temp_dir};

/// Saves `model` into `dir` as Hugging Face shards of at most `max_shard_size` bytes, with its
/// config.
fn save_sharded(model: &LlamaForCausalLM, dir: &Path, max_shard_size: usize) -> Vec<PathBuf> {
    let files = (model.state_dict().unwrap())
        .save_sharded(dir, max_shard_size)
        .unwrap();
    let config = super::fixture().join("config.json");
    std::fs::copy(config, dir.join("config.json")).unwrap();
    files
}

fn empty_model() -> LlamaForCausalLM {
    let cfg = model().config;
    build_empty(|| LlamaForCausalLM::new(&cfg, &device())).unwrap()
}

fn linears(model: &LlamaForCausalLM) -> Vec<(String, Linear)> {
    model
        .named_modules()
        .into_iter()
        .filter_map(|(path, m)| Some((path, m.downcast_ref::<Linear>()?.clone())))
        .collect()
}

#[test]
fn a_sharded_checkpoint_streams_into_an_empty_quantized_model() {
    let dir = temp_dir("stream-shards");
    let float = model();
    // The tiny model's 2 × 64 KiB embedding and 16 KiB projections: three shards of ≤ 200 KB.
    let files = save_sharded(&float, &dir, 200_000);
    let names: Vec<_> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_owned())
        .collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"
        ]
    );
    for kind in [GgmlDType::Q8_0, GgmlDType::Q4_0] {
        let streamed = empty_model();
        let marked = quantize(&streamed, "**", kind).unwrap();
        let after = model();
        let quantized = quantize(&after, "**", kind).unwrap();
        // The same layers marked as a built model quantizes (`down_proj`, 176 wide, stays float).
        assert_eq!(marked.quantized, quantized.quantized);
        assert_eq!(marked.kept_float, quantized.kept_float);
        let q_proj = &streamed.model.layers[0].self_attn.q_proj.weight;
        assert!(!q_proj.is_built() && !q_proj.is_quantized());
        assert_eq!(q_proj.quantized_dtype(), Some(kind));

        let options = LlamaForCausalLM::load_options(&streamed.config);
        streamed.load_state_dict(&dir, &options).unwrap();
        for ((path, got), (_, want)) in linears(&streamed).iter().zip(linears(&after)) {
            let (got, want) = (&got.weight, &want.weight);
            assert_eq!(got.quantized_dtype(), want.quantized_dtype(), "{path}");
            match (got.quantized().unwrap(), want.quantized().unwrap()) {
                (Some(g), Some(w)) => assert_eq!(g.data().unwrap(), w.data().unwrap(), "{path}"),
                (None, None) => assert_eq!(
                    max_diff(&got.tensor().unwrap(), &want.tensor().unwrap()),
                    0.0
                ),
                _ => panic!("{path}: one quantized, one not"),
            }
        }
        let input = ids(&[vec![1, 5, 9, 2]]);
        let logits = |m: &LlamaForCausalLM| m.scan(&input, m.initial_state(1).unwrap()).unwrap().0;
        assert_eq!(max_diff(&logits(&streamed), &logits(&after)), 0.0);
    }
    // Saved again in one shard: `model.safetensors`, the earlier shards and index removed.
    let files = save_sharded(&float, &dir, 1 << 30);
    assert_eq!(files, [dir.join("model.safetensors")]);
    let mut left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    left.sort();
    assert_eq!(left, ["config.json", "model.safetensors"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_failed_streaming_load_leaves_the_marked_model_empty() {
    let dir = temp_dir("stream-broken");
    save_sharded(&model(), &dir, 200_000);
    // The last shard goes missing: the load fails before any weight is taken.
    std::fs::remove_file(dir.join("model-00003-of-00003.safetensors")).unwrap();
    let streamed = empty_model();
    let _ = quantize(&streamed, "**", GgmlDType::Q8_0).unwrap();
    let options = LlamaForCausalLM::load_options(&streamed.config);
    let err = streamed.load_state_dict(&dir, &options).unwrap_err();
    assert!(err.to_string().contains("model-00003-of-00003"), "{err}");
    for p in streamed.parameters() {
        assert!(!p.is_built());
    }
    let q_proj = &streamed.model.layers[1].self_attn.q_proj.weight;
    assert_eq!(q_proj.quantized_dtype(), Some(GgmlDType::Q8_0));
    // An empty weight whose shape is not known yet cannot be marked: its own error.
    let lazy = build_empty(|| module_runtime::nn::LazyLinear::new(64, &device())).unwrap();
    assert!(matches!(
        quantize(&lazy, "**", GgmlDType::Q8_0),
        Err(Error::NotLoaded { .. })
    ));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The quantized weights of `a` and `b`, layer by layer: the same kinds and the same bytes (the
/// float ones the same values).
fn assert_same_linears(a: &LlamaForCausalLM, b: &LlamaForCausalLM) {
    let (a, b) = (linears(a), linears(b));
    assert_eq!(a.len(), b.len());
    for ((path, got), (_, want)) in a.iter().zip(&b) {
        let (got, want) = (&got.weight, &want.weight);
        assert_eq!(got.quantized_dtype(), want.quantized_dtype(), "{path}");
        match (got.quantized().unwrap(), want.quantized().unwrap()) {
            (Some(g), Some(w)) => assert_eq!(g.data().unwrap(), w.data().unwrap(), "{path}"),
            (None, None) => assert_eq!(
                max_diff(&got.tensor().unwrap(), &want.tensor().unwrap()),
                0.0,
                "{path}"
            ),
            _ => panic!("{path}: one quantized, one not"),
        }
    }
}

#[test]
fn from_pretrained_quantized_equals_load_then_quantize_for_every_kind() {
    // The tiny fixture (hidden 64) for the 32-wide blocks; a random folder 256 wide for q4_K's
    // 256-wide ones (its intermediate 320 is no multiple of 256: down_proj stays float).
    let wide = temp_dir("quantized-wide");
    let json = serde_json::json!({
        "hidden_size": 256, "intermediate_size": 320, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 48,
        "rms_norm_eps": 1e-5, "tie_word_embeddings": false,
    });
    LlamaForCausalLM::save_random_pretrained(&wide, &json).unwrap();
    let cases = [
        (super::fixture(), GgmlDType::Q8_0),
        (super::fixture(), GgmlDType::Q4_0),
        (wide.clone(), GgmlDType::Q4K),
    ];
    for (dir, kind) in cases {
        let (streamed, report) =
            LlamaForCausalLM::from_pretrained_quantized(&dir, &device(), "**", kind).unwrap();
        let after = LlamaForCausalLM::from_pretrained(&dir, &device()).unwrap();
        let want = quantize(&after, "**", kind).unwrap();
        assert_eq!(report, want, "{kind:?}");
        // Some layers quantized, down_proj kept float in both folders.
        assert!(!report.quantized.is_empty(), "{kind:?}");
        assert_eq!(
            report.kept_float.len(),
            streamed.model.layers.len(),
            "{kind:?}"
        );
        assert_same_linears(&streamed, &after);
        // Every parameter loaded, the norms and the embedding (float) equal too; eval mode.
        for ((path, got), (_, want)) in streamed
            .named_parameters()
            .iter()
            .zip(after.named_parameters())
        {
            assert_eq!(
                max_diff(&got.tensor().unwrap(), &want.tensor().unwrap()),
                0.0,
                "{path}"
            );
        }
        assert!(!streamed.is_training());
        let input = ids(&[vec![1, 5, 9, 2]]);
        let logits = |m: &LlamaForCausalLM| m.scan(&input, m.initial_state(1).unwrap()).unwrap().0;
        assert_eq!(
            max_diff(&logits(&streamed), &logits(&after)),
            0.0,
            "{kind:?}"
        );
    }
    std::fs::remove_dir_all(&wide).unwrap();
}

/// The error of [`LlamaForCausalLM::from_pretrained_quantized`], which must fail.
fn quantized_err(dir: &Path, device: &Device, pattern: &str, kind: GgmlDType) -> Error {
    match LlamaForCausalLM::from_pretrained_quantized(dir, device, pattern, kind) {
        Ok(_) => panic!("{} loaded with {pattern} {kind:?}", dir.display()),
        Err(e) => e,
    }
}

#[test]
fn from_pretrained_quantized_refuses_a_bad_pattern_kind_or_folder() {
    let dir = super::fixture();
    // No layer of the 64-wide model fits q4_K's 256-wide blocks.
    let err = quantized_err(&dir, &device(), "**", GgmlDType::Q4K);
    assert!(
        matches!(
            &err,
            Error::Quantize(QuantizeError::BlockSize {
                block_size: 256,
                ..
            })
        ),
        "{err}"
    );
    let err = quantized_err(&dir, &device(), "model.nope", GgmlDType::Q8_0);
    assert!(
        matches!(&err, Error::Quantize(QuantizeError::NoLinear { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("model.nope"), "{err}");
    // A folder without a checkpoint: the load's error, naming the file.
    let empty = temp_dir("quantized-missing");
    std::fs::create_dir_all(&empty).unwrap();
    std::fs::copy(dir.join("config.json"), empty.join("config.json")).unwrap();
    let err = quantized_err(&empty, &device(), "**", GgmlDType::Q8_0);
    assert!(err.to_string().contains("model.safetensors"), "{err}");
    std::fs::remove_dir_all(&empty).unwrap();
}
