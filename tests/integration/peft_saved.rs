//! PEFT's `modules_to_save` against `peft` (`fixtures/peft/make_fixtures.py`): trainable copies
//! of the head and the embedding, used while the adapter is active (PEFT's logits within 1e-4),
//! the originals when it is disabled, trained with the adapter (4 AdamW steps within 1e-5), saved
//! under PEFT's keys and read back (and by peft: `--check`), `print(model)` as PEFT's
//! `ModulesToSaveWrapper`; a module of another type is a typed error.

use module_runtime::nn::peft::{get_peft_model, LoraConfig, PeftExt, TargetModules};
use module_runtime::nn::LayerNorm;
use module_runtime::prelude::*;
use module_runtime::{Error, PeftError};

use super::{
    base, check_inference_of, check_saved, check_training_of, dir, get, max_diff, read, Tiny,
};

#[test]
fn modules_to_save_from_peft_gives_peft_logits() {
    let model = check_inference_of("modules_to_save", base(16));
    // Unloaded, the head and the embedding keep the copies' values, as PEFT's unwrapping does.
    let adapter = read(dir("modules_to_save").join("adapter/adapter_model.safetensors"));
    let head = model
        .get_parameter("head.weight")
        .unwrap()
        .tensor()
        .unwrap();
    assert_eq!(
        max_diff(&head, &get(&adapter, "base_model.model.head.weight")),
        0.0
    );
}

#[test]
fn modules_to_save_training_follows_peft_for_4_adamw_steps() {
    check_training_of("train_modules_to_save", base(16));
}

/// `get_peft_model` with `modules_to_save`: PEFT's names, the copies trained and the originals
/// frozen, the copy used only while the adapter is on, `print(model)` as PEFT's.
#[test]
fn get_peft_model_with_modules_to_save_matches_peft() {
    let mut model = base(16);
    let ids = get(&read(dir("modules_to_save").join("io.safetensors")), "ids");
    let config = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        modules_to_save: Some(vec!["head".into(), "embed".into()]),
        ..LoraConfig::new(TargetModules::names(["q_proj"]))
    };
    get_peft_model(&mut model, &config).unwrap();
    let repr = std::fs::read_to_string(dir("modules_to_save").join("repr.txt")).unwrap();
    assert_eq!(model.to_string(), repr);
    let trainable: Vec<String> = model
        .named_parameters()
        .into_iter()
        .filter(|(_, p)| p.requires_grad())
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        trainable,
        [
            "embed.modules_to_save.default.weight",
            "attn.q_proj.lora_A.default.weight",
            "attn.q_proj.lora_B.default.weight",
            "head.modules_to_save.default.weight",
            "head.modules_to_save.default.bias",
        ]
    );
    // The copy, not the original, makes the output while the adapter is on.
    let before = model.call(&ids).unwrap();
    let copy = model
        .get_parameter("head.modules_to_save.default.bias")
        .unwrap();
    copy.set(&(copy.tensor().unwrap() + 1.0).unwrap()).unwrap();
    let after = model.call(&ids).unwrap();
    assert!((max_diff(&after, &before) - 1.0).abs() < 1e-5);
    let off = model.disable_adapter(|| model.call(&ids)).unwrap().unwrap();
    assert!(
        max_diff(&off, &before) < 1e-5,
        "disabled: the original head"
    );
    // Saved under PEFT's keys (the copy's own, `modules_to_save.default.` dropped).
    let weights = check_saved("modules_to_save", &model, &ids, base(16));
    let bias = weights.get("base_model.model.head.bias").unwrap();
    assert_eq!(
        max_diff(bias, &copy.tensor().unwrap()),
        0.0,
        "the copy's bias is saved"
    );
    // `delete_adapter` removes the copies with the adapter.
    model.delete_adapter("default").unwrap();
    assert!(model
        .named_parameters()
        .iter()
        .all(|(k, _)| !k.contains("modules_to_save")));
}

#[derive(Module)]
struct Normed {
    proj: Linear,
    norm: LayerNorm,
}

impl Forward<&Tensor> for Normed {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.norm.call(&self.proj.call(x)?)
    }
}

/// A `LayerNorm` in `modules_to_save`; a module of a type without the slot is a typed error
/// naming the path and the type, and so is a module that is also a LoRA target; the model is
/// left as it was.
#[test]
fn modules_to_save_on_a_layer_norm_and_errors() {
    let dev = Device::Cpu;
    let mut model = Normed {
        proj: Linear::new(4, 4, &dev).unwrap(),
        norm: LayerNorm::new(4, &dev).unwrap(),
    };
    // Fixed values, not the shared generator's: a row of `proj`'s output with a small variance
    // would amplify the paths' rounding (which differ: the copy trains, so its norm is not the
    // fused inference kernel) past any fixed bound.
    model
        .proj
        .weight
        .set(&Tensor::eye(4, DType::F32, &dev).unwrap())
        .unwrap();
    let x = Tensor::new(&[[0.5f32, -1.25, 2.0, 0.75], [-1.5, 0.25, 1.0, -0.5]], &dev).unwrap();
    // "score" matches nothing and is skipped, as PEFT skips it.
    let config = LoraConfig {
        modules_to_save: Some(vec!["norm".into(), "score".into()]),
        ..LoraConfig::new(TargetModules::names(["proj"]))
    };
    let plain = model.call(&x).unwrap();
    get_peft_model(&mut model, &config).unwrap();
    assert!(model.to_string().contains(
        "(norm): ModulesToSaveWrapper(\n    (original_module): LayerNorm((4,), eps=1e-05, \
         elementwise_affine=True, bias=True)\n    (modules_to_save): ModuleDict(\n      \
         (default): LayerNorm((4,), eps=1e-05, elementwise_affine=True, bias=True)\n    )\n  )"
    ));
    let w = model
        .get_parameter("norm.modules_to_save.default.weight")
        .unwrap();
    assert!(w.requires_grad());
    w.set(&(w.tensor().unwrap() * 2.0).unwrap()).unwrap();
    let adapted = model.call(&x).unwrap();
    assert!(max_diff(&adapted, &(plain.clone() * 2.0).unwrap()) < 1e-5);
    // The fused add & norm takes the copy too (the original would give half the output).
    let h = model.proj.call(&x).unwrap().detach();
    let zeros = h.zeros_like().unwrap();
    let fused = module_runtime::without_grad(|| model.norm.call_residual(&h, &zeros)).unwrap();
    assert!(max_diff(&fused, &adapted) < 1e-5);
    model.merge_and_unload().unwrap();
    assert!(max_diff(&model.call(&x).unwrap(), &adapted) < 1e-6);

    // Errors.
    let mut model = base(16);
    let before: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    let attn = LoraConfig {
        modules_to_save: Some(vec!["attn".into()]),
        ..LoraConfig::new(TargetModules::names(["fc1"]))
    };
    let err = get_peft_model(&mut model, &attn).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::UnsupportedModuleToSave { path, found }) if path == "attn" && found == "Attention"),
        "{err}"
    );
    let both = LoraConfig {
        modules_to_save: Some(vec!["fc1".into()]),
        ..LoraConfig::new(TargetModules::names(["fc1"]))
    };
    let err = get_peft_model(&mut model, &both).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::State { path, .. }) if path == "mlp.fc1"),
        "{err}"
    );
    let missing = LoraConfig {
        modules_to_save: Some(vec!["classifier".into()]),
        ..LoraConfig::new(TargetModules::names(["fc1"]))
    };
    let err = get_peft_model(&mut model, &missing).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::NoTarget { targets, .. }) if targets.contains("classifier")),
        "{err}"
    );
    let after: Vec<String> = model
        .named_parameters()
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(after, before, "the model is unchanged");
}

/// Two adapters, each with its copy of the head: `set_adapter` switches the copy in use and the
/// one trained; an adapter without a copy of a layer leaves it the original, as in PEFT.
#[test]
fn named_adapters_switch_their_modules_to_save_copies() {
    let mut model = base(16);
    let ids = get(&read(dir("modules_to_save").join("io.safetensors")), "ids");
    let plain = model.call(&ids).unwrap();
    let with_head = |r| LoraConfig {
        r,
        modules_to_save: Some(vec!["head".into()]),
        ..LoraConfig::new(TargetModules::names(["fc1"]))
    };
    get_peft_model(&mut model, &with_head(2)).unwrap();
    model.add_adapter("other", &with_head(4)).unwrap();
    model
        .add_adapter("plain", &LoraConfig::new(TargetModules::names(["fc2"])))
        .unwrap();
    assert_eq!(model.adapter_names(), ["default", "other", "plain"]);
    let shift = |name: &str, by: f64| {
        let p = model
            .get_parameter(&format!("head.modules_to_save.{name}.bias"))
            .unwrap();
        p.set(&(p.tensor().unwrap() + by).unwrap()).unwrap();
    };
    shift("default", 1.0);
    shift("other", 2.0);
    let offset = |m: &Tiny| {
        let y = m.call(&ids).unwrap();
        (y - &plain)
            .unwrap()
            .mean_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    };
    assert!((offset(&model) - 1.0).abs() < 1e-5, "default's copy");
    model.set_adapter("other").unwrap();
    assert!((offset(&model) - 2.0).abs() < 1e-5, "other's copy");
    let trained: Vec<String> = model
        .named_parameters()
        .into_iter()
        .filter(|(k, p)| p.requires_grad() && k.starts_with("head"))
        .map(|(k, _)| k)
        .collect();
    assert_eq!(
        trained,
        [
            "head.modules_to_save.other.weight",
            "head.modules_to_save.other.bias"
        ]
    );
    model.set_adapter("plain").unwrap();
    assert!(offset(&model).abs() < 1e-5, "no copy: the original head");
    model.delete_adapter("other").unwrap();
    model.set_adapter("default").unwrap();
    assert!((offset(&model) - 1.0).abs() < 1e-5);
}

/// `bias="all"` beside `modules_to_save`: the copy's bias is saved once, as the copy's, and the
/// folder reads back.
#[test]
fn modules_to_save_with_bias_all_reads_back() {
    let mut model = base(16);
    let ids = get(&read(dir("modules_to_save").join("io.safetensors")), "ids");
    let config = LoraConfig {
        bias: module_runtime::nn::peft::LoraBias::All,
        modules_to_save: Some(vec!["head".into()]),
        ..LoraConfig::new(TargetModules::names(["fc1"]))
    };
    get_peft_model(&mut model, &config).unwrap();
    let copy = model
        .get_parameter("head.modules_to_save.default.bias")
        .unwrap();
    copy.set(&(copy.tensor().unwrap() + 1.0).unwrap()).unwrap();
    let weights = check_saved("bias_all_and_copies", &model, &ids, base(16));
    let saved = weights.get("base_model.model.head.bias").unwrap();
    assert_eq!(max_diff(saved, &copy.tensor().unwrap()), 0.0);
    assert!(weights.iter().all(|(k, _)| !k.contains("modules_to_save")));
}
