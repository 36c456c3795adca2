//! Loads the PyTorch reference fixtures (`shared/fixtures/pytorch/*.safetensors`) and compares
//! tensors with the tolerance the fixtures were generated for.
//!
//! Tolerance: `|actual - expected| <= 1e-5 + 1e-5 * |expected|` elementwise. The fixtures are within
//! 1.5e-6 of a float64 rerun (optimizer traces: 4e-7), so 1e-5 absolute plus relative leaves room for
//! float32 reassociation in candle without hiding real mistakes.

#![allow(dead_code)] // each test binary uses a different part of this helper

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use module_runtime::candle_core::{DType, Tensor};
use module_runtime::ModuleExt;

/// Absolute and relative tolerance of every comparison.
pub const TOL: f64 = 1e-5;

/// Where the fixtures are: `$FIXTURES_DIR`, else `../shared/fixtures/pytorch` next to the workspace.
fn fixtures_dir() -> PathBuf {
    match std::env::var_os("FIXTURES_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../shared/fixtures/pytorch"),
    }
}

/// One fixture file; remembers which keys were read so a test can check that it used all of them.
pub struct Fixture {
    name: String,
    tensors: HashMap<String, Tensor>,
    used: RefCell<BTreeSet<String>>,
}

impl Fixture {
    /// Loads `NAME.safetensors`. Returns `None` (after a loud message) when the fixtures are not
    /// there, unless `CI=true`, where a missing fixture fails the test.
    pub fn load(name: &str) -> Option<Fixture> {
        let path = fixtures_dir().join(format!("{name}.safetensors"));
        if !path.exists() {
            let msg = format!(
                "PyTorch fixture {} not found: set FIXTURES_DIR to shared/fixtures/pytorch",
                path.display()
            );
            if std::env::var("CI").as_deref() == Ok("true") {
                panic!("{msg}");
            }
            // Straight to stderr: the test harness captures `eprintln!` of passing tests.
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("\n!!!!!!!! SKIPPED: {msg} !!!!!!!!\n").as_bytes(),
            );
            return None;
        }
        // Onto the device under test, so inputs and expected values are where the model is.
        let device = candle_module::device_from_env().expect("MODULE_DEVICE names a usable device");
        let tensors = module_runtime::candle_core::safetensors::load(&path, &device)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        Some(Fixture {
            name: name.to_owned(),
            tensors,
            used: RefCell::new(BTreeSet::new()),
        })
    }

    /// The tensor stored under `key`, marked as used.
    pub fn get(&self, key: &str) -> Tensor {
        self.used.borrow_mut().insert(key.to_owned());
        self.tensors
            .get(key)
            .unwrap_or_else(|| panic!("fixture `{}` has no key `{key}`", self.name))
            .clone()
    }

    /// Every key with `prefix`, the prefix stripped, sorted.
    pub fn keys_with_prefix(&self, prefix: &str) -> Vec<String> {
        let mut keys: Vec<String> = self
            .tensors
            .keys()
            .filter_map(|k| k.strip_prefix(prefix).map(str::to_owned))
            .collect();
        keys.sort();
        keys
    }

    /// Copies every `param.<name>` into the model's parameter `<name>`, and checks that the model
    /// has no parameter the fixture lacks.
    pub fn load_params(&self, model: &dyn module_runtime::Module) {
        let keys = self.keys_with_prefix("param.");
        for key in &keys {
            let p = model
                .get_parameter(key)
                .unwrap_or_else(|e| panic!("fixture `{}`: {e}", self.name));
            p.set(&self.get(&format!("param.{key}"))).unwrap();
        }
        let mut model_keys: Vec<String> = model
            .named_parameters()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        model_keys.sort();
        assert_eq!(model_keys, keys, "model parameters vs fixture `param.*`");
    }

    /// Panics unless every key of the file was read.
    pub fn assert_all_used(&self) {
        let used = self.used.borrow();
        let unused: Vec<&String> = self.tensors.keys().filter(|k| !used.contains(*k)).collect();
        assert!(
            unused.is_empty(),
            "fixture `{}`: keys never compared: {unused:?}",
            self.name
        );
    }
}

/// Asserts `actual` matches `expected` in shape and within [`TOL`] elementwise.
pub fn assert_close(actual: &Tensor, expected: &Tensor, what: &str) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let a = actual
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let e = expected
        .to_dtype(DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f64>()
        .unwrap();
    let mut worst = (0.0f64, 0usize);
    for (i, (a, e)) in a.iter().zip(&e).enumerate() {
        let excess = (a - e).abs() - (TOL + TOL * e.abs());
        if excess > worst.0 || excess.is_nan() {
            worst = (
                if excess.is_nan() {
                    f64::INFINITY
                } else {
                    excess
                },
                i,
            );
        }
    }
    assert!(
        worst.0 <= 0.0,
        "{what}: element {} is {} but PyTorch has {} (tolerance {TOL} abs + rel)",
        worst.1,
        a[worst.1],
        e[worst.1]
    );
}
