//! PyTorch reference fixtures (`fixtures/pytorch/NAME.safetensors` in this repository, see its
//! README and the script that makes them) and comparisons with them, for the parity tests.
//!
//! Tolerance: `|actual - expected| <= TOL + TOL * |expected|` elementwise. The fixtures are float32
//! values within 1.5e-6 of a float64 rerun (optimizer traces: 4e-7), so 1e-5 absolute plus relative
//! leaves room for float32 reassociation in candle while still catching any real difference.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use module_runtime::prelude::*;

use crate::device_from_env;

/// Absolute and relative tolerance of [`assert_close`].
pub const TOL: f64 = 1e-5;

/// Where the fixtures are: `$FIXTURES_DIR` (to check a regenerated set), else the repository's
/// `fixtures/pytorch`.
pub fn fixtures_dir() -> PathBuf {
    match std::env::var_os("FIXTURES_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/pytorch"),
    }
}

/// The checkpoint fixtures: one model saved in every format PyTorch users meet
/// (`fixtures/pytorch/checkpoints/README.md`).
pub fn checkpoints_dir() -> PathBuf {
    fixtures_dir().join("checkpoints")
}

/// One fixture file, on the device under test ([`device_from_env`]); remembers which keys were
/// read, so a test can check that it compared all of them ([`assert_all_used`](Self::assert_all_used)).
pub struct Fixture {
    /// The fixture's name, `NAME` in `NAME.safetensors`.
    pub name: String,
    tensors: HashMap<String, Tensor>,
    used: RefCell<BTreeSet<String>>,
}

impl Fixture {
    /// Loads `NAME.safetensors`. The fixtures ship with the repository, so a missing one fails
    /// the test.
    pub fn load(name: &str) -> Fixture {
        let path = fixtures_dir().join(format!("{name}.safetensors"));
        // Onto the device under test, so inputs and expected values are where the model is.
        let device = device_from_env().expect("MODULE_DEVICE names a usable device");
        let tensors = candle_core::safetensors::load(&path, &device)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        Fixture {
            name: name.to_owned(),
            tensors,
            used: RefCell::new(BTreeSet::new()),
        }
    }

    /// The tensor stored under `key`, marked as used.
    pub fn get(&self, key: &str) -> Tensor {
        self.try_get(key)
            .unwrap_or_else(|| panic!("fixture `{}` has no key `{key}`", self.name))
    }

    /// The tensor stored under `key`, if any, marked as used.
    pub fn try_get(&self, key: &str) -> Option<Tensor> {
        let tensor = self.tensors.get(key)?.clone();
        self.used.borrow_mut().insert(key.to_owned());
        Some(tensor)
    }

    /// The keys under `prefix`, with the prefix removed.
    pub fn keys_under(&self, prefix: &str) -> BTreeSet<String> {
        self.tensors
            .keys()
            .filter_map(|k| k.strip_prefix(prefix).map(str::to_owned))
            .collect()
    }

    /// Sets every parameter and buffer `<name>` of `module` from `param.<name>`, and checks that
    /// every `param.*` key is used, so the module has exactly PyTorch's state-dict names.
    pub fn load_state(&self, module: &dyn Module) {
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
            "{}: the module's parameters and buffers differ from PyTorch's state dict",
            self.name
        );
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

/// Asserts that `actual` has `expected`'s shape and values within [`TOL`]; on failure, names the
/// element furthest out of tolerance (a NaN counts as infinitely far).
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let (a, e) = (flat_f64(actual), flat_f64(expected));
    let mut worst = (0.0f64, 0usize);
    for (i, (a, e)) in a.iter().zip(&e).enumerate() {
        let excess = (a - e).abs() - (TOL + TOL * e.abs());
        let excess = if excess.is_nan() {
            f64::INFINITY
        } else {
            excess
        };
        if excess > worst.0 {
            worst = (excess, i);
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

/// The largest absolute elementwise difference between `a` and `b`, any float dtype, as `f32`
/// (0 for equal tensors). Panics if the shapes differ: for tests.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims(), "shapes differ");
    let diff = (a - b).and_then(|d| d.abs()).and_then(|d| d.flatten_all());
    let max = diff
        .and_then(|d| d.max(0))
        .and_then(|m| m.to_dtype(DType::F32));
    max.and_then(|m| m.to_scalar::<f32>())
        .expect("a difference of two tensors")
}

/// Asserts that `actual` equals `expected` exactly, dtype included (integer buffers, state that
/// must not change).
pub fn assert_equal(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    assert_eq!(actual.dtype(), expected.dtype(), "{what}: dtype");
    assert_eq!(flat_f64(actual), flat_f64(expected), "{what}");
}

fn flat_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(DType::F64)
        .and_then(|t| t.flatten_all())
        .and_then(|t| t.to_vec1::<f64>())
        .expect("a tensor converts to f64")
}
