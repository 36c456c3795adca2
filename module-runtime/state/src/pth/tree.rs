//! A PyTorch pickle file as a tree of values, for what is not a model's state dict: an
//! optimizer's `state_dict()` (numbered parameters, hyperparameters, per-parameter tensors), or
//! the scalars of a training checkpoint (`epoch`). Tensors are validated against their storage
//! and built one at a time, as [`PthFile`](super::PthFile) does.

use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::container::Container;
use super::pickle::{Object, Pickle, TensorRef, Value};
use super::{check, dict, failure, find, lookup, materialize, read};
use crate::error::{Error, PthErrorKind, Result};

/// A `.pth`/`.pt` file read into memory, its pickle decoded (with the same allow-list and bounds
/// as every checkpoint) and kept as a tree of [`Value`]s.
pub struct PthTree {
    path: PathBuf,
    bytes: Vec<u8>,
    container: Container,
}

impl PthTree {
    /// Reads and decodes `path`.
    pub fn open(path: &Path) -> Result<Self> {
        let (bytes, container) = read(path)?;
        Ok(Self {
            path: path.to_owned(),
            bytes,
            container,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The decoded pickle.
    pub fn pickle(&self) -> &Pickle {
        &self.container.pickle
    }

    /// The pickle's top-level value.
    pub fn root(&self) -> &Value {
        &self.container.pickle.root
    }

    /// The items of `v` if it is a dict.
    pub fn dict(&self, v: &Value) -> Option<&[(Value, Value)]> {
        dict(self.pickle(), v)
    }

    /// The items of `v` if it is a list or a tuple.
    pub fn sequence(&self, v: &Value) -> Option<&[Value]> {
        match self.pickle().object(v) {
            Some(Object::List(items) | Object::Tuple(items)) => Some(items),
            _ => None,
        }
    }

    /// The value at string key `key` of the dict `v` (the last one, as in a Python dict).
    pub fn get<'a>(&'a self, v: &Value, key: &str) -> Option<&'a Value> {
        lookup(self.dict(v)?, key)
    }

    /// The value at `key` below the root, dotted keys descending through nested dicts
    /// (`"optimizer"`, `"state.optimizer"`): a key that contains dots itself is tried whole first.
    pub fn at(&self, key: &str) -> Result<&Value> {
        find(self.pickle(), key).map_err(|f| failure(&self.path, f))
    }

    /// `v` as a tensor reference, if it is one.
    pub fn tensor_ref<'a>(&'a self, v: &Value) -> Option<&'a TensorRef> {
        super::tensor(self.pickle(), v)
    }

    /// Builds the tensor `t` on `device`, after checking its layout against its storage's real
    /// length; `key` names it in errors.
    pub fn tensor(&self, key: &str, t: &TensorRef, device: &Device) -> Result<Tensor> {
        let entry =
            check(&self.container, key.to_owned(), t).map_err(|f| failure(&self.path, f))?;
        materialize(&self.bytes, &entry, device)
    }

    /// `v` in words, for messages (`a dict with keys state, param_groups`).
    pub fn describe(&self, v: &Value) -> String {
        self.pickle().describe(v)
    }

    /// The error for a value that is not what the reader expected: [`PthErrorKind::Malformed`]
    /// with `reason`, naming the file.
    pub fn malformed(&self, reason: impl Into<String>) -> Error {
        Error::Pth {
            path: self.path.clone(),
            offset: None,
            kind: Box::new(PthErrorKind::Malformed {
                reason: reason.into(),
            }),
        }
    }
}
