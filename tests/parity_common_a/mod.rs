//! Loading PyTorch reference fixtures (`shared/fixtures/pytorch/NAME.safetensors`) and comparing
//! tensors with them, for the layer parity tests.

use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use module_runtime::prelude::*;

/// Absolute and relative tolerance: `|actual - expected| <= TOL + TOL * |expected|`. The fixtures are
/// float32 values within 1.5e-6 of a float64 rerun; 1e-5 leaves room for candle's own float32
/// rounding while still catching any real difference.
pub const TOL: f32 = 1e-5;

fn fixtures_dir() -> PathBuf {
    match std::env::var_os("FIXTURES_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch"),
    }
}

/// One fixture: the tensors of `NAME.safetensors`, by key.
pub struct Fixture {
    pub name: String,
    tensors: HashMap<String, Tensor>,
}

impl Fixture {
    /// Loads `name`; when the fixtures are not there, says so loudly and returns `None`, except
    /// under `CI=true`, where a missing fixture fails the test.
    pub fn load(name: &str) -> Option<Self> {
        let path = fixtures_dir().join(format!("{name}.safetensors"));
        if !path.exists() {
            let msg = format!(
                "PyTorch fixture {} not found (set FIXTURES_DIR); SKIPPING the `{name}` parity test",
                path.display()
            );
            if std::env::var("CI").is_ok_and(|v| v == "true") {
                panic!("{msg}");
            }
            eprintln!("\n!!!!! {msg} !!!!!\n");
            return None;
        }
        // Onto the device under test, so inputs and expected values are where the model is.
        let device = candle_module::device_from_env().expect("MODULE_DEVICE names a usable device");
        let tensors = candle_core::safetensors::load(&path, &device)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        Some(Self {
            name: name.to_string(),
            tensors,
        })
    }

    /// The tensor stored under `key`.
    pub fn get(&self, key: &str) -> Tensor {
        self.try_get(key)
            .unwrap_or_else(|| panic!("{}: no `{key}` in the fixture", self.name))
    }

    /// The tensor stored under `key`, if any.
    pub fn try_get(&self, key: &str) -> Option<Tensor> {
        self.tensors.get(key).cloned()
    }

    /// The keys under `prefix`, with the prefix removed.
    pub fn keys_under(&self, prefix: &str) -> BTreeSet<String> {
        self.tensors
            .keys()
            .filter_map(|k| k.strip_prefix(prefix).map(str::to_string))
            .collect()
    }

    /// Sets every parameter and buffer of `module` from `param.<name>`, and checks that every
    /// `param.*` key is used, so the layer has exactly PyTorch's state-dict names.
    pub fn load_state<M: ModuleExt>(&self, module: &M) {
        let mut used = BTreeSet::new();
        for (name, p) in module.named_parameters() {
            p.set(&self.get(&format!("param.{name}")))
                .unwrap_or_else(|e| panic!("{}: setting parameter `{name}`: {e}", self.name));
            used.insert(name);
        }
        for (name, b) in module.named_buffers() {
            b.set(&self.get(&format!("param.{name}")))
                .unwrap_or_else(|e| panic!("{}: setting buffer `{name}`: {e}", self.name));
            used.insert(name);
        }
        assert_eq!(
            used,
            self.keys_under("param."),
            "{}: the layer's parameters and buffers differ from PyTorch's state dict",
            self.name
        );
    }
}

/// Asserts `actual` has `expected`'s shape and values, within [`TOL`].
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let a = flat_f32(actual);
    let e = flat_f32(expected);
    for (i, (a, e)) in a.iter().zip(&e).enumerate() {
        assert!(
            (a - e).abs() <= TOL + TOL * e.abs(),
            "{what}: element {i} is {a}, PyTorch has {e} (difference {})",
            (a - e).abs()
        );
    }
}

/// Asserts `actual` equals `expected` exactly (integer buffers, unchanged state).
pub fn assert_equal(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    let a = actual.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
    let e = expected
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap();
    assert_eq!(
        a.to_vec1::<f64>().unwrap(),
        e.to_vec1::<f64>().unwrap(),
        "{what}"
    );
}

fn flat_f32(t: &Tensor) -> Vec<f32> {
    t.to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}
