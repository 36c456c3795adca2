//! PEFT adapters against `peft` itself (`fixtures/peft/make_fixtures.py`): a tiny model (an
//! embedding, a one-head attention, an MLP, a head) whose adapters PEFT made and saved, loaded
//! here: LoRA and DoRA logits within 1e-4 of PEFT's, merged weights within 1e-6, 4 AdamW steps on
//! the adapter alone within 1e-5 (losses and final adapter weights), `print(model)` as PEFT's,
//! PEFT's files written back (and checked by `peft` with `make_fixtures.py --check`), and the
//! errors: an unknown config field, targets matching nothing, an adapter for another model.

use std::path::{Path, PathBuf};

use module_runtime::nn::loss::cross_entropy;
use module_runtime::nn::peft::{
    get_peft_model, InitLoraWeights, LoraBias, LoraConfig, PeftExt, TargetModules,
};
use module_runtime::nn::Embedding;
use module_runtime::optim::{AdamW, Optimizer};
use module_runtime::prelude::*;
use module_runtime::{LoadOptions, PeftError, StateDict};

#[path = "peft_conv.rs"]
mod conv;
#[path = "peft_errors.rs"]
mod errors;
#[path = "peft_saved.rs"]
mod saved;

#[derive(Module, Clone)]
struct Attention {
    q_proj: Linear,
    v_proj: Linear,
}

#[derive(Module, Clone)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

/// The fixture script's `Tiny`, field for field.
#[derive(Module, Clone)]
struct Tiny {
    embed: Embedding,
    attn: Attention,
    mlp: Mlp,
    head: Linear,
}

impl Forward<&Tensor> for Tiny {
    type Output = Tensor;
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let h = self.embed.call(ids)?;
        let q = self.attn.q_proj.call(&h)?;
        let v = self.attn.v_proj.call(&h)?;
        let scores = (q.matmul(&h.transpose(1, 2)?.contiguous()?)? / 4.0)?;
        // candle-nn's `softmax_last_dim` records no gradient: the composed softmax.
        let w = candle_nn::ops::softmax(&scores, candle_core::D::Minus1)?;
        let h = (&h + w.matmul(&v)?)?;
        let m = self.mlp.fc2.call(&self.mlp.fc1.call(&h)?.tanh()?)?;
        self.head.call(&(h + m)?)
    }
}

fn dir(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/peft")
        .join(case)
}

fn read(path: PathBuf) -> StateDict {
    StateDict::read(path, &LoadOptions::default()).unwrap()
}

/// The base model with the fixture's weights (`d` the width, 16 in the fixtures).
fn base(d: usize) -> Tiny {
    let dev = Device::Cpu;
    let model = Tiny {
        embed: Embedding::new(12, d, &dev).unwrap(),
        attn: Attention {
            q_proj: Linear::new(d, d, &dev).unwrap(),
            v_proj: Linear::no_bias(d, d, &dev).unwrap(),
        },
        mlp: Mlp {
            fc1: Linear::new(d, 32, &dev).unwrap(),
            fc2: Linear::new(32, d, &dev).unwrap(),
        },
        head: Linear::new(d, 12, &dev).unwrap(),
    };
    if d == 16 {
        model
            .load_state_dict(
                &read(dir("").join("base.safetensors")),
                &LoadOptions::default(),
            )
            .unwrap();
    }
    model
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
        .to_scalar()
        .unwrap()
}

fn get(sd: &StateDict, key: &str) -> Tensor {
    sd.get(key)
        .unwrap_or_else(|| panic!("fixture has no `{key}`"))
        .clone()
}

/// PEFT's adapter loaded here gives PEFT's logits, with the adapter off the base's, and merged
/// PEFT's merged weights; `print(model)` is PEFT's.
fn check_inference(case: &str) {
    check_inference_of(case, base(16));
}

/// [`check_inference`] for any model with the fixture's base weights; returns it with the
/// adapter merged and unloaded.
fn check_inference_of<M>(case: &str, mut model: M) -> M
where
    M: Module + std::fmt::Display + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let io = read(dir(case).join("io.safetensors"));
    let paths = model
        .load_adapter(dir(case).join("adapter"), "default", false)
        .unwrap();
    assert!(!paths.is_empty());
    let ids = get(&io, "ids");
    let logits = model.call(&ids).unwrap();
    let diff = max_diff(&logits, &get(&io, "logits"));
    assert!(diff < 1e-4, "{case}: logits differ from peft's by {diff}");
    let base_logits = model.disable_adapter(|| model.call(&ids)).unwrap().unwrap();
    assert!(max_diff(&base_logits, &get(&io, "base_logits")) < 1e-4);
    assert!(
        max_diff(&logits, &base_logits) > 1e-3,
        "the adapter changes the output"
    );
    let repr = std::fs::read_to_string(dir(case).join("repr.txt")).unwrap();
    assert_eq!(model.to_string(), repr, "{case}: print(model)");
    // PEFT's is_trainable=False: nothing to train.
    assert_eq!(model.get_nb_trainable_parameters().0, 0);

    // merge, unmerge, merge again: the weights PEFT's merge_and_unload gives.
    model.merge_adapter().unwrap();
    let merged_logits = model.call(&ids).unwrap();
    assert!(max_diff(&merged_logits, &logits) < 1e-4);
    model.unmerge_adapter().unwrap();
    let after = model.call(&ids).unwrap();
    assert!(max_diff(&after, &logits) < 1e-5);
    let unloaded = model.merge_and_unload().unwrap();
    assert_eq!(unloaded, paths);
    for path in &paths {
        let weight = model
            .get_parameter(&format!("{path}.weight"))
            .unwrap()
            .tensor()
            .unwrap();
        let diff = max_diff(&weight, &get(&io, &format!("merged.{path}.weight")));
        assert!(
            diff < 1e-6,
            "{case}: merged {path} differs from peft's by {diff}"
        );
    }
    // The plain model again: no adapter parameter, PEFT's logits from the merged weights.
    assert!(model
        .named_parameters()
        .iter()
        .all(|(p, _)| !p.contains("lora_")));
    assert!(max_diff(&model.call(&ids).unwrap(), &logits) < 1e-4);
    model
}

#[test]
fn lora_adapter_from_peft_gives_peft_logits_and_merged_weights() {
    check_inference("lora");
}

#[test]
fn dora_adapter_from_peft_gives_peft_logits_and_merged_weights() {
    check_inference("dora");
}

#[test]
fn embedding_adapter_from_peft_gives_peft_logits_and_merged_weights() {
    check_inference("embedding");
}

#[test]
fn embedding_dora_adapter_from_peft_gives_peft_logits_and_merged_weights() {
    check_inference("embedding_dora");
}

/// 4 AdamW steps on the adapter alone (PEFT's initial adapter, the script's hyper-parameters):
/// PEFT's losses and final adapter tensors within 1e-5.
fn check_training(case: &str) {
    check_training_of(case, base(16));
}

/// [`check_training`] for any model with the fixture's base weights.
fn check_training_of<M>(case: &str, mut model: M)
where
    M: Module + std::fmt::Display + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let train = read(dir(case).join("train.safetensors"));
    let io = read(dir(case).join("io.safetensors"));
    model
        .load_adapter(dir(case).join("adapter"), "default", true)
        .unwrap();
    // PEFT's trained tensors by our paths (`q_proj.base_layer.bias` is `q_proj.bias` here).
    let trained: Vec<(String, Tensor)> = train
        .iter()
        .filter(|(k, _)| *k != "targets" && *k != "losses")
        .map(|(k, t)| (k.replace(".base_layer.", "."), t.clone()))
        .collect();
    let (trainable, _) = model.get_nb_trainable_parameters();
    let expected: usize = trained.iter().map(|(_, t)| t.elem_count()).sum();
    assert_eq!(
        trainable, expected,
        "only the adapter (and biases PEFT's `bias` names) is trained"
    );
    let options = AdamW::options()
        .lr(1e-2)
        .betas(0.9, 0.999)
        .eps(1e-8)
        .weight_decay(0.01);
    let mut opt = AdamW::new(&model, options).unwrap();
    let ids = get(&io, "ids");
    let targets = get(&train, "targets").flatten_all().unwrap();
    let want: Vec<f64> = get(&train, "losses").to_vec1().unwrap();
    for (step, want) in want.iter().enumerate() {
        let logits = model.call(&ids).unwrap();
        let classes = logits.dim(candle_core::D::Minus1).unwrap();
        let logits = logits.reshape(((), classes)).unwrap();
        let loss = cross_entropy(&logits, &targets).unwrap();
        let got = loss.to_scalar::<f32>().unwrap() as f64;
        assert!(
            (got - want).abs() < 1e-5,
            "{case} step {step}: loss {got} vs peft's {want}"
        );
        opt.backward_step(&loss).unwrap();
    }
    for (key, value) in &trained {
        let got = model.get_parameter(key).unwrap().tensor().unwrap();
        let diff = max_diff(&got, value);
        assert!(
            diff < 1e-5,
            "{case}: {key} after training differs from peft's by {diff}"
        );
    }
}

#[test]
fn lora_training_follows_peft_for_4_adamw_steps() {
    check_training("train");
}

#[test]
fn dora_training_follows_peft_for_4_adamw_steps() {
    check_training("train_dora");
}

#[test]
fn embedding_training_follows_peft_for_4_adamw_steps() {
    check_training("train_embedding");
}

#[test]
fn embedding_dora_training_follows_peft_for_4_adamw_steps() {
    check_training("train_embedding_dora");
}

/// `bias="all"`: every bias trained with the adapter, saved in its file under PEFT's names.
#[test]
fn bias_all_training_follows_peft_for_4_adamw_steps() {
    check_training("train_bias");
}

/// `bias="lora_only"`: the adapted layers' biases are trained and saved
/// (`base_model.model.attn.q_proj.base_layer.bias`), and read back.
#[test]
fn bias_lora_only_trains_and_saves_the_adapted_layers_biases() {
    let mut model = base(16);
    let config = LoraConfig {
        bias: LoraBias::LoraOnly,
        ..LoraConfig::new(TargetModules::names(["q_proj", "v_proj"]))
    };
    get_peft_model(&mut model, &config).unwrap();
    let q_bias = model.get_parameter("attn.q_proj.bias").unwrap();
    assert!(q_bias.requires_grad());
    assert!(!model.get_parameter("head.bias").unwrap().requires_grad());
    q_bias
        .set(&q_bias.tensor().unwrap().ones_like().unwrap())
        .unwrap();
    let tmp = std::env::temp_dir().join(format!("peft-bias-{}", std::process::id()));
    model.save_pretrained(&tmp).unwrap();
    let weights = read(tmp.join("adapter_model.safetensors"));
    let mut keys: Vec<&str> = weights.iter().map(|(k, _)| k).collect();
    keys.sort();
    assert_eq!(
        keys,
        [
            "base_model.model.attn.q_proj.base_layer.bias",
            "base_model.model.attn.q_proj.lora_A.weight",
            "base_model.model.attn.q_proj.lora_B.weight",
            "base_model.model.attn.v_proj.lora_A.weight",
            "base_model.model.attn.v_proj.lora_B.weight",
        ]
    );
    let mut again = base(16);
    again.load_adapter(&tmp, "default", true).unwrap();
    let bias = again.get_parameter("attn.q_proj.bias").unwrap();
    assert_eq!(
        bias.tensor()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        16.0
    );
    assert!(bias.requires_grad());
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// `get_peft_model` from a config, as PEFT's: the same parameters, shapes and `print(model)`;
/// PEFT's default init leaves the output unchanged; the base is frozen, the adapter trained.
#[test]
fn get_peft_model_matches_peft_names_shapes_and_repr() {
    let mut model = base(16);
    let ids = get(&read(dir("dora").join("io.safetensors")), "ids");
    let before = model.call(&ids).unwrap();
    let config = LoraConfig {
        r: 4,
        lora_alpha: 6.0,
        use_dora: true,
        use_rslora: true,
        ..LoraConfig::new(TargetModules::Regex(r".*\.(q_proj|fc1)|head".into()))
    };
    let paths = get_peft_model(&mut model, &config).unwrap();
    assert_eq!(paths, ["attn.q_proj", "mlp.fc1", "head"]);
    let repr = std::fs::read_to_string(dir("dora").join("repr.txt")).unwrap();
    assert_eq!(model.to_string(), repr);
    assert!(max_diff(&model.call(&ids).unwrap(), &before) < 1e-6);
    let trainable: Vec<String> = model
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| p.requires_grad())
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        trainable,
        [
            "attn.q_proj.lora_A.default.weight",
            "attn.q_proj.lora_B.default.weight",
            "attn.q_proj.lora_magnitude_vector.default.weight",
            "mlp.fc1.lora_A.default.weight",
            "mlp.fc1.lora_B.default.weight",
            "mlp.fc1.lora_magnitude_vector.default.weight",
            "head.lora_A.default.weight",
            "head.lora_B.default.weight",
            "head.lora_magnitude_vector.default.weight",
        ]
    );
    // A state dict of the base model still loads (strictly: the adapter's keys are extra, so
    // non-strict), and hooks still reach the adapted layer by its path.
    let base_sd = read(dir("").join("base.safetensors"));
    model
        .load_state_dict(&base_sd, &LoadOptions::default().non_strict())
        .unwrap();
    let (_, captured) = model.capture(&["attn.q_proj"], |m| m.call(&ids)).unwrap();
    assert_eq!(captured.get("attn.q_proj").unwrap().dims(), [2, 5, 16]);
}

/// Saved here, loaded here (and, through `make_fixtures.py --check`, by peft): the same logits.
/// `PEFT_WRITE_RUST_SAVED=1` also writes the folders into `fixtures/peft/rust_saved/` for that
/// check.
#[test]
fn saved_adapter_reloads_with_the_same_logits() {
    for case in ["lora", "dora", "embedding", "embedding_dora", "train_bias"] {
        let mut model = base(16);
        model
            .load_adapter(dir(case).join("adapter"), "default", false)
            .unwrap();
        if case == "train_bias" {
            // A trained bias (`bias="all"`) that peft must read from the file for its logits.
            let bias = model.get_parameter("head.bias").unwrap();
            bias.set(&(bias.tensor().unwrap() + 1.0).unwrap()).unwrap();
        }
        let ids = get(&read(dir(case).join("io.safetensors")), "ids");
        let weights = check_saved(case, &model, &ids, base(16));
        // PEFT's keys.
        assert!(weights
            .get("base_model.model.attn.q_proj.lora_A.weight")
            .is_some());
        assert_eq!(
            weights
                .get("base_model.model.attn.q_proj.lora_magnitude_vector")
                .is_some(),
            case.contains("dora")
        );
    }
}

/// Saves `model`'s adapter, reads it into `again` (the base model), checks the logits for `ids`
/// are the same, and returns the saved weights. `PEFT_WRITE_RUST_SAVED=1` also writes the folder
/// and the logits into `fixtures/peft/rust_saved/<case>` for `make_fixtures.py --check`.
fn check_saved<M>(case: &str, model: &M, ids: &Tensor, mut again: M) -> StateDict
where
    M: Module + std::fmt::Display + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    let logits = model.call(ids).unwrap();
    let tmp = std::env::temp_dir().join(format!("peft-{case}-{}", std::process::id()));
    let written = model.save_pretrained(&tmp).unwrap();
    assert_eq!(written, std::slice::from_ref(&tmp));
    let weights = read(tmp.join("adapter_model.safetensors"));
    again.load_adapter(&tmp, "default", false).unwrap();
    assert_eq!(max_diff(&again.call(ids).unwrap(), &logits), 0.0);
    if std::env::var_os("PEFT_WRITE_RUST_SAVED").is_some() {
        let out = dir("rust_saved").join(case);
        model.save_pretrained(&out).unwrap();
        let mut sd = StateDict::new();
        sd.insert("ids", ids.clone());
        sd.insert("logits", logits.clone());
        sd.save_safetensors(out.join("rust_logits.safetensors"))
            .unwrap();
    }
    std::fs::remove_dir_all(&tmp).unwrap();
    weights
}

/// Several named adapters, one active: `set_adapter` switches the forward and what is trained.
#[test]
fn named_adapters_switch_with_set_adapter() {
    let mut model = base(16);
    model
        .load_adapter(dir("lora").join("adapter"), "default", false)
        .unwrap();
    let ids = get(&read(dir("lora").join("io.safetensors")), "ids");
    let lora_logits = model.call(&ids).unwrap();
    let config = LoraConfig {
        r: 2,
        init_lora_weights: InitLoraWeights::Random,
        ..LoraConfig::new(TargetModules::Patterns(vec!["mlp.*".into()]))
    };
    model.add_adapter("other", &config).unwrap();
    assert_eq!(model.adapter_names(), ["default", "other"]);
    // "default" stays active.
    assert_eq!(max_diff(&model.call(&ids).unwrap(), &lora_logits), 0.0);
    model.set_adapter("other").unwrap();
    assert!(max_diff(&model.call(&ids).unwrap(), &lora_logits) > 1e-3);
    assert!(model
        .get_parameter("mlp.fc1.lora_A.other.weight")
        .unwrap()
        .requires_grad());
    assert!(!model
        .get_parameter("mlp.fc1.lora_A.default.weight")
        .unwrap()
        .requires_grad());
    assert!(matches!(
        model.set_adapter("nope").unwrap_err(),
        Error::Peft(PeftError::NoAdapter { .. })
    ));
    model.delete_adapter("other").unwrap();
    model.set_adapter("default").unwrap();
    assert_eq!(max_diff(&model.call(&ids).unwrap(), &lora_logits), 0.0);
}

/// An adapter over a `quantize`d base: the forward takes the quantized product and adds the
/// adapter's, gradients reach the adapter; merging into the quantized weight is refused.
#[test]
fn adapters_over_a_quantized_base_train_and_refuse_merging() {
    let mut model = base(16);
    model
        .load_adapter(dir("train").join("adapter"), "default", true)
        .unwrap();
    // fc2 is the one layer whose rows (32) fit q8_0's blocks.
    let report =
        module_runtime::nn::quantize(&model, "mlp.fc2", module_runtime::nn::GgmlDType::Q8_0)
            .unwrap();
    assert_eq!(report.quantized, ["mlp.fc2"]);
    let ids = get(&read(dir("train").join("io.safetensors")), "ids");
    let loss = model.call(&ids).unwrap().sqr().unwrap().mean_all().unwrap();
    let grads = loss.backward().unwrap();
    let b = model
        .get_parameter("mlp.fc2.lora_B.default.weight")
        .unwrap();
    assert!(grads.get(&b.tensor().unwrap()).is_some());
    // `call_each`'s one-pass quantized product steps aside for a layer with an adapter.
    b.set(&Tensor::randn(0f32, 1., (16, 4), &Device::Cpu).unwrap())
        .unwrap();
    let h = Tensor::randn(0f32, 1., (3, 32), &Device::Cpu).unwrap();
    let [each] = Linear::call_each([&model.mlp.fc2], &h).unwrap();
    assert_eq!(max_diff(&each, &model.mlp.fc2.call(&h).unwrap()), 0.0);
    let plain = model
        .disable_adapter(|| model.mlp.fc2.call(&h))
        .unwrap()
        .unwrap();
    assert!(
        max_diff(&each, &plain) > 1e-3,
        "the adapter's output is in `each`"
    );
    let err = model.merge_adapter().unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::State { path, .. }) if path == "mlp.fc2"),
        "{err}"
    );
    // Nothing was merged.
    assert!(model
        .attn
        .q_proj
        .lora()
        .unwrap()
        .merged_adapters()
        .is_empty());
}

/// An adapted model goes through the runtime's other tools as any model: hooks reach the
/// adapter's own layers by path, a deep clone is independent, a dtype change converts the
/// adapter with the base, `Clone` of a layer keeps its adapter.
#[test]
fn adapted_models_hook_clone_and_convert_like_any_model() {
    let mut model = base(16);
    model
        .load_adapter(dir("lora").join("adapter"), "default", true)
        .unwrap();
    let ids = get(&read(dir("lora").join("io.safetensors")), "ids");
    let logits = model.call(&ids).unwrap();
    // Hooks on the adapter's factors, by PEFT's module paths.
    let (_, captured) = model
        .capture(
            &["attn.q_proj.lora_A.default", "mlp.fc1.lora_B.default"],
            |m| m.call(&ids),
        )
        .unwrap();
    assert_eq!(
        captured.get("attn.q_proj.lora_A.default").unwrap().dims(),
        [2, 5, 4]
    );
    assert_eq!(
        captured.get("mlp.fc1.lora_B.default").unwrap().dims(),
        [2, 5, 32]
    );
    // A deep clone: the same logits, its own parameters.
    let copy = model.deep_clone().unwrap();
    assert_eq!(max_diff(&copy.call(&ids).unwrap(), &logits), 0.0);
    let b = copy
        .get_parameter("attn.q_proj.lora_B.default.weight")
        .unwrap();
    b.set(&b.tensor().unwrap().zeros_like().unwrap()).unwrap();
    assert_eq!(max_diff(&model.call(&ids).unwrap(), &logits), 0.0);
    // float64: the adapter converts with the base.
    model.to_dtype(DType::F64).unwrap();
    let a = model
        .get_parameter("mlp.fc2.lora_A.default.weight")
        .unwrap();
    assert_eq!(a.dtype(), DType::F64);
    let logits64 = model.call(&ids).unwrap().to_dtype(DType::F32).unwrap();
    assert!(max_diff(&logits64, &logits) < 1e-4);
    // A cloned layer keeps its adapter (sharing its parameters, as `Linear`'s clone does).
    let q = model.attn.q_proj.clone();
    assert_eq!(q.lora().unwrap().adapter_names(), ["default"]);
    assert!(q.get_parameter("lora_A.default.weight").is_ok());
}
