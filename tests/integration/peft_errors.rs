//! PEFT adapters that do not fit: typed errors naming the field, path or key, and the model
//! left as it was.

use super::*;

/// The state dict and parameters of a model: what an error must leave as it was.
fn snapshot(model: &Tiny) -> Vec<(String, Vec<usize>, bool)> {
    model
        .named_parameters()
        .into_iter()
        .map(|(k, p)| (k, p.shape().dims().to_vec(), p.requires_grad()))
        .collect()
}

fn copy_adapter(case: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    static COUNT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let n = COUNT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let out = std::env::temp_dir().join(format!("peft-edit-{case}-{}-{n}", std::process::id()));
    std::fs::create_dir_all(&out).unwrap();
    let src = dir(case).join("adapter");
    std::fs::copy(
        src.join("adapter_model.safetensors"),
        out.join("adapter_model.safetensors"),
    )
    .unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("adapter_config.json")).unwrap())
            .unwrap();
    edit(&mut config);
    std::fs::write(out.join("adapter_config.json"), config.to_string()).unwrap();
    out
}

#[test]
fn bad_adapters_are_typed_errors_naming_what_and_leave_the_model_alone() {
    let mut model = base(16);
    let before = snapshot(&model);

    // A config field this runtime does not know.
    let unknown = copy_adapter("lora", |c| c["lora_magic"] = serde_json::json!(3));
    let err = model.load_adapter(&unknown, "default", false).unwrap_err();
    assert!(err.to_string().contains("lora_magic"), "{err}");
    assert!(
        matches!(&err, Error::Peft(PeftError::UnknownField { field, file: Some(_) }) if field == "lora_magic"),
        "{err}"
    );
    // A known field with a value not implemented.
    let fan = copy_adapter("lora", |c| c["fan_in_fan_out"] = serde_json::json!(true));
    let err = model.load_adapter(&fan, "default", false).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::Unsupported { field, .. }) if field == "fan_in_fan_out")
    );

    // Targets matching nothing, through the config and through a file.
    let config = LoraConfig::new(TargetModules::names(["k_proj"]));
    let err = get_peft_model(&mut model, &config).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::NoTarget { available, .. }) if available.contains(&"attn.q_proj".to_owned())),
        "{err}"
    );
    assert!(err.to_string().contains("k_proj"), "{err}");
    let none = copy_adapter("lora", |c| {
        c["target_modules"] = serde_json::json!(["k_proj"])
    });
    assert!(matches!(
        model.load_adapter(&none, "default", false).unwrap_err(),
        Error::Peft(PeftError::NoTarget { .. })
    ));
    // A target that takes no adapter (a module of the user's own type).
    let err =
        get_peft_model(&mut model, &LoraConfig::new(TargetModules::names(["attn"]))).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::UnsupportedLayer { path, found }) if path == "attn" && found == "Attention"),
        "{err}"
    );
    // Another rank than the file's: shapes.
    let rank = copy_adapter("lora", |c| c["r"] = serde_json::json!(8));
    let err = model.load_adapter(&rank, "default", false).unwrap_err();
    let Error::Peft(PeftError::Shape {
        key,
        path,
        expected,
        found,
    }) = &err
    else {
        panic!("{err}")
    };
    assert_eq!(
        (key.as_str(), path.as_str()),
        ("base_model.model.attn.q_proj.lora_A.weight", "attn.q_proj")
    );
    assert_eq!(
        (expected.as_slice(), found.as_slice()),
        (&[8, 16][..], &[4, 16][..])
    );
    // Targets the file has no tensors for: missing keys, named.
    let more = copy_adapter("lora", |c| {
        c["target_modules"] = serde_json::json!(["q_proj", "v_proj", "fc1", "fc2", "head"])
    });
    let err = model.load_adapter(&more, "default", false).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::Keys { missing, .. }) if missing.contains(&"base_model.model.head.lora_A.weight".to_owned())),
        "{err}"
    );
    assert_eq!(snapshot(&model), before, "the model is unchanged");

    // An adapter made for another model (a width of 24): shapes, and the model unchanged.
    let mut wide = base(24);
    let wide_before = snapshot(&wide);
    let err = wide
        .load_adapter(dir("lora").join("adapter"), "default", false)
        .unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::Shape { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("attn.q_proj"), "{err}");
    assert_eq!(snapshot(&wide), wide_before);

    // The same adapter name twice.
    let config = LoraConfig::new(TargetModules::names(["q_proj"]));
    get_peft_model(&mut model, &config).unwrap();
    let err = get_peft_model(&mut model, &config).unwrap_err();
    assert!(
        matches!(&err, Error::Peft(PeftError::AdapterExists { path, .. }) if path == "attn.q_proj")
    );
    for d in [unknown, fan, none, rank, more] {
        std::fs::remove_dir_all(d).unwrap();
    }
}
