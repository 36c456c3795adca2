//! Every PyTorch pickle checkpoint in the repository's fixtures (`fixtures/pytorch/checkpoints`,
//! made by `torch.save` in every way users save a model) reads into the state dict of
//! `gapnet_zip.pth`: same keys in the same order, shapes and dtypes.
//!
//! Values: every file holds the same state dict (`fixtures/make_checkpoint_fixtures.py` saves one
//! model every way), so each is compared with `gapnet_zip.pth`, directly or through the sharded
//! safetensors read with candle's own safetensors loader (which equal it, tested below).

use std::path::{Path, PathBuf};

use module_runtime::candle_core::{DType, Device, Tensor};
use module_runtime::{Error, LoadOptions, PthErrorKind, StateDict};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fixtures/pytorch/checkpoints")
}

fn read(name: &str, key: Option<&str>) -> StateDict {
    let path = fixtures().join(name);
    let options = match key {
        Some(key) => LoadOptions::default().nested_in(key),
        None => LoadOptions::default(),
    };
    StateDict::read(&path, &options).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn values(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap()
}

/// `actual` holds the keys of `expected` (after `map`), in order, with the same shapes and values;
/// float64 values are compared after casting to float32.
fn assert_same(expected: &StateDict, actual: &StateDict, map: impl Fn(&str) -> String) {
    let keys: Vec<String> = actual.keys().map(&map).collect();
    let expected_keys: Vec<&str> = expected.keys().collect();
    assert_eq!(keys, expected_keys);
    for (key, value) in actual.iter() {
        let want = expected.get(&map(key)).unwrap();
        assert_eq!(value.dims(), want.dims(), "{key}");
        let value = if value.dtype() == DType::F64 {
            value.to_dtype(DType::F32).unwrap()
        } else {
            value.clone()
        };
        assert_eq!(value.dtype(), want.dtype(), "{key}");
        assert_eq!(values(&value), values(want), "{key}");
    }
}

#[test]
fn zip_format_reads_the_whole_state_dict() {
    let sd = read("gapnet_zip.pth", None);
    assert_eq!(sd.len(), 18);
    let w = sd.get("slice1.0.weight").unwrap();
    assert_eq!(w.dims(), [8, 3, 3, 3]);
    assert_eq!(w.dtype(), DType::F32);
    let n = sd.get("slice1.1.num_batches_tracked").unwrap();
    assert_eq!((n.dtype(), n.rank()), (DType::I64, 0));
    assert_eq!(sd.keys().next(), Some("slice1.0.weight"));
}

#[test]
fn legacy_format_matches_zip() {
    assert_same(
        &read("gapnet_zip.pth", None),
        &read("gapnet_legacy.pth", None),
        str::to_owned,
    );
}

#[test]
fn dataparallel_keys_are_prefixed() {
    let sd = read("gapnet_dataparallel.pth", None);
    assert!(sd.keys().all(|k| k.starts_with("module.")));
    assert_same(&read("gapnet_zip.pth", None), &sd, |k| {
        k.strip_prefix("module.").unwrap().to_owned()
    });
}

/// The sharded safetensors read with candle's own loader, in `gapnet_zip.pth`'s key order.
fn sharded_safetensors() -> StateDict {
    let mut all = std::collections::HashMap::new();
    for i in 1..=2 {
        let path = fixtures().join(format!(
            "gapnet_sharded_safetensors/model-0000{i}-of-00002.safetensors"
        ));
        all.extend(module_runtime::candle_core::safetensors::load(&path, &Device::Cpu).unwrap());
    }
    let zip = read("gapnet_zip.pth", None);
    assert_eq!(all.len(), zip.len());
    zip.keys()
        .map(|k| (k, all.get(k).unwrap().clone()))
        .collect()
}

/// Same keys, order, shapes and dtypes (float64 as float32) as `gapnet_zip.pth`.
fn assert_same_layout(actual: &StateDict) {
    let zip = read("gapnet_zip.pth", None);
    assert_eq!(
        actual.keys().collect::<Vec<_>>(),
        zip.keys().collect::<Vec<_>>()
    );
    for (key, value) in actual.iter() {
        let want = zip.get(key).unwrap();
        assert_eq!(value.dims(), want.dims(), "{key}");
        let dtype = match value.dtype() {
            DType::F64 => DType::F32,
            other => other,
        };
        assert_eq!(dtype, want.dtype(), "{key}");
    }
}

#[test]
fn sharded_safetensors_equal_zip() {
    assert_same(
        &read("gapnet_zip.pth", None),
        &sharded_safetensors(),
        str::to_owned,
    );
}

#[test]
fn nested_checkpoint_by_key() {
    let sd = read("gapnet_nested.pt", Some("model"));
    assert_same_layout(&sd);
    assert_same(&sharded_safetensors(), &sd, str::to_owned);
}

#[test]
fn nested_checkpoint_without_key_lists_candidates() {
    let path = fixtures().join("gapnet_nested.pt");
    let err = StateDict::read(&path, &LoadOptions::default()).unwrap_err();
    let message = err.to_string();
    match err {
        Error::Pth { kind, .. } => match *kind {
            PthErrorKind::NotAStateDict { candidates, .. } => assert_eq!(candidates, ["model"]),
            other => panic!("{other}"),
        },
        other => panic!("{other}"),
    }
    assert!(message.contains("model"), "{message}");
    assert!(message.contains("gapnet_nested.pt"), "{message}");

    let err = StateDict::read(&path, &LoadOptions::default().nested_in("modle")).unwrap_err();
    assert!(
        matches!(&err, Error::Pth { kind, .. }
            if matches!(&**kind, PthErrorKind::NoSuchKey { available, .. } if available.iter().any(|k| k == "model") && available.iter().any(|k| k == "epoch"))),
        "{err}"
    );
}

#[test]
fn f64_checkpoint_matches_after_cast() {
    let sd = read("gapnet_f64.pth", None);
    assert_eq!(sd.get("head.weight").unwrap().dtype(), DType::F64);
    assert_eq!(
        sd.get("slice1.1.num_batches_tracked").unwrap().dtype(),
        DType::I64
    );
    assert_same_layout(&sd);
    assert_same(&sharded_safetensors(), &sd, str::to_owned);
}

#[test]
fn sharded_bin_matches_sharded_safetensors() {
    let mut from_bin = std::collections::HashMap::new();
    for i in 1..=2 {
        let shard = read(
            &format!("gapnet_sharded_bin/pytorch_model-0000{i}-of-00002.bin"),
            None,
        );
        assert!(!shard.is_empty());
        for (k, t) in shard.iter() {
            assert!(
                from_bin.insert(k.to_owned(), t.clone()).is_none(),
                "{k} twice"
            );
        }
    }
    let zip = read("gapnet_zip.pth", None);
    assert_eq!(from_bin.len(), zip.len());
    let ordered: StateDict = zip
        .keys()
        .map(|k| (k, from_bin.get(k).unwrap().clone()))
        .collect();
    assert_same_layout(&ordered);
    assert_same(&sharded_safetensors(), &ordered, str::to_owned);
}
