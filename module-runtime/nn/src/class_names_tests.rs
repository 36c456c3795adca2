//! Every alias of a generic layer has PyTorch's class name, and every alias is checked.

use std::path::Path;

use crate::*;

/// Each alias (as written in the source), its class name, and PyTorch's name for it.
macro_rules! classes {
    ($($alias:ident => $pytorch:literal),* $(,)?) => {
        [$((stringify!($alias), <$alias as Module>::type_class_name(), $pytorch)),*]
    };
}

fn alias_classes() -> Vec<(&'static str, String, &'static str)> {
    let layers = classes![
        BatchNorm1d => "BatchNorm1d",
        BatchNorm2d => "BatchNorm2d",
        LazyBatchNorm1d => "LazyBatchNorm1d",
        LazyBatchNorm2d => "LazyBatchNorm2d",
        Conv1d => "Conv1d",
        Conv2d => "Conv2d",
        Conv3d => "Conv3d",
        LazyConv1d => "LazyConv1d",
        LazyConv2d => "LazyConv2d",
        ConvTranspose1d => "ConvTranspose1d",
        ConvTranspose2d => "ConvTranspose2d",
        MaxPool2d => "MaxPool2d",
        AvgPool2d => "AvgPool2d",
        MaxPool1d => "MaxPool1d",
        AvgPool1d => "AvgPool1d",
        LPPool1d => "LPPool1d",
        LPPool2d => "LPPool2d",
        AdaptiveAvgPool1d => "AdaptiveAvgPool1d",
        AdaptiveAvgPool2d => "AdaptiveAvgPool2d",
        AdaptiveMaxPool1d => "AdaptiveMaxPool1d",
        AdaptiveMaxPool2d => "AdaptiveMaxPool2d",
        InstanceNorm1d => "InstanceNorm1d",
        InstanceNorm2d => "InstanceNorm2d",
        Dropout1d => "Dropout1d",
        Dropout2d => "Dropout2d",
        Dropout3d => "Dropout3d",
        Lstm => "LSTM",
        Gru => "GRU",
        LstmCell => "LSTMCell",
        GruCell => "GRUCell",
        TransformerEncoder => "TransformerEncoder",
        TransformerDecoder => "TransformerDecoder",
    ];
    let padding = classes![
        ZeroPad1d => "ZeroPad1d",
        ZeroPad2d => "ZeroPad2d",
        ZeroPad3d => "ZeroPad3d",
        ConstantPad1d => "ConstantPad1d",
        ConstantPad2d => "ConstantPad2d",
        ConstantPad3d => "ConstantPad3d",
        ReflectionPad1d => "ReflectionPad1d",
        ReflectionPad2d => "ReflectionPad2d",
        ReflectionPad3d => "ReflectionPad3d",
        ReplicationPad1d => "ReplicationPad1d",
        ReplicationPad2d => "ReplicationPad2d",
        ReplicationPad3d => "ReplicationPad3d",
        CircularPad1d => "CircularPad1d",
        CircularPad2d => "CircularPad2d",
        CircularPad3d => "CircularPad3d",
    ];
    layers.into_iter().chain(padding).collect()
}

#[test]
fn every_generic_layer_alias_has_its_pytorch_class_name() {
    for (alias, class, pytorch) in alias_classes() {
        assert_eq!(class, pytorch, "the class name of `{alias}`");
    }
    // One that PyTorch spells differently from the Rust type, not generic.
    assert_eq!(<RmsNorm as Module>::type_class_name(), "RMSNorm");
}

/// A value answers as its type does (the derive's `class_name` is its `type_class_name`).
#[test]
fn a_layer_value_has_its_type_class_name() {
    let dev = candle_core::Device::Cpu;
    let conv = Conv2d::new(1, 2, 3, &dev).unwrap();
    assert_eq!(conv.class_name(), "Conv2d");
    assert_eq!((&conv as &dyn Module).class_name(), "Conv2d");
    assert_eq!(format!("{:?}", &conv as &dyn Module), "Conv2d");
    let lstm = Lstm::new(2, 3, &dev).unwrap();
    assert_eq!(lstm.class_name(), "LSTM");
}

/// Every `pub type Alias = Generic<..>;` of a layer in this crate's sources is in the list above,
/// so a new alias cannot go unchecked.
#[test]
fn every_alias_in_the_sources_is_checked() {
    let checked: Vec<&str> = alias_classes().iter().map(|(alias, ..)| *alias).collect();
    let mut missing = Vec::new();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    for file in rust_files(&src) {
        let text = std::fs::read_to_string(&file).unwrap();
        for line in text.lines() {
            let Some(rest) = line.strip_prefix("pub type ") else {
                continue;
            };
            let Some((alias, target)) = rest.split_once(" = ") else {
                continue;
            };
            let alias = alias.split('<').next().unwrap_or(alias);
            // Typed paths' aliases and function types are not layers.
            let is_layer = target.contains('<') && !target.starts_with("Arc<");
            if is_layer && !alias.ends_with("Path") && !checked.contains(&alias) {
                missing.push(format!("{alias} ({})", file.display()));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "aliases without a checked class name: {missing:?}"
    );
}

fn rust_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}
