//! The plain Python values of a `.pth` file, what `torch.load` returns: a training checkpoint's
//! `epoch` and `step`, a scheduler's state dict, nested dicts and lists, tensors. [`PthValues`]
//! reads the file with the same bounded reader and allow-list as every checkpoint (nothing in it
//! is executed) and turns the pickle into a tree of [`PyValue`]s.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

use super::pickle::{Object, Pickle, Value};
use super::tree::PthTree;
use crate::error::{Error, PthErrorKind, Result};

/// The deepest nesting of containers read (a checkpoint nests a few levels; a pickle that
/// refers to itself would nest forever).
pub const MAX_DEPTH: usize = 128;

/// The most values one file may expand to. A container the pickle refers to twice (through its
/// memo) is copied into each place, so this bounds what a small file can make.
pub const MAX_VALUES: usize = 1 << 21;

/// The bytes of strings, `bytes` and big integers one file may expand to, beyond twice its own
/// size: a string the pickle refers to many times (through its memo) is copied into each place,
/// so this keeps what a file makes within a small multiple of the file.
pub const MAX_TEXT_SLACK: usize = 1 << 20;

/// A Python value read from a pickle, under Python's names: what `torch.load` gives back, minus
/// the objects the bounded reader does not build (any global outside its allow-list is refused
/// when the file is read). `collections.OrderedDict` is a [`Dict`](Self::Dict); `set`, `frozenset`
/// and `torch.Size` are [`Tuple`](Self::Tuple)s.
#[derive(Clone, Debug)]
pub enum PyValue {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int` that fits 64 bits.
    Int(i64),
    /// An `int` beyond 64 bits: little-endian two's complement bytes.
    BigInt(Vec<u8>),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `bytes`.
    Bytes(Vec<u8>),
    /// A `list`.
    List(Vec<PyValue>),
    /// A `tuple` (and a `set`, `frozenset` or `torch.Size`).
    Tuple(Vec<PyValue>),
    /// A `dict` or `OrderedDict`: its items in order (keys are strings, or integers as in an
    /// optimizer's `state`).
    Dict(Vec<(PyValue, PyValue)>),
    /// A `torch.Tensor` (or `nn.Parameter`), on the CPU, its layout checked against its storage.
    Tensor(Tensor),
}

impl PyValue {
    /// The value at string key `key` of a dict (the last one, as in Python), or at index `key`
    /// of a list, tuple or integer-keyed dict; `None` elsewhere. One level: see
    /// [`PthValues::get`] for dotted paths.
    pub fn get(&self, key: &str) -> Option<&PyValue> {
        match self {
            PyValue::Dict(items) => items.iter().rev().find_map(|(k, v)| match k {
                PyValue::Str(s) if s == key => Some(v),
                PyValue::Int(i) if key.parse::<i64>().ok() == Some(*i) => Some(v),
                _ => None,
            }),
            PyValue::List(items) | PyValue::Tuple(items) => items.get(key.parse::<usize>().ok()?),
            _ => None,
        }
    }

    /// The value as `T` (an `int` as [`i64`], a `float` or `int` as [`f64`], …), if it is one.
    pub fn extract<T: FromPyValue>(&self) -> Option<T> {
        T::from_py(self)
    }

    /// The items of a dict.
    pub fn as_dict(&self) -> Option<&[(PyValue, PyValue)]> {
        match self {
            PyValue::Dict(items) => Some(items),
            _ => None,
        }
    }

    /// The items of a list or a tuple.
    pub fn as_list(&self) -> Option<&[PyValue]> {
        match self {
            PyValue::List(items) | PyValue::Tuple(items) => Some(items),
            _ => None,
        }
    }

    /// The value in words, for messages (`the integer 3`, `a dict with keys epoch, model`).
    pub fn describe(&self) -> String {
        match self {
            PyValue::None => "None".into(),
            PyValue::Bool(b) => if *b { "True" } else { "False" }.into(),
            PyValue::Int(i) => format!("the integer {i}"),
            PyValue::BigInt(_) => "an integer beyond 64 bits".into(),
            PyValue::Float(f) => format!("the float {f}"),
            PyValue::Str(s) if s.chars().count() <= 40 => format!("the string {s:?}"),
            PyValue::Str(_) => "a string".into(),
            PyValue::Bytes(b) => format!("{} bytes", b.len()),
            PyValue::List(items) => format!("a list of {} items", items.len()),
            PyValue::Tuple(items) => format!("a tuple of {} items", items.len()),
            PyValue::Dict(items) => format!("a dict with keys {}", key_list(items)),
            PyValue::Tensor(t) => format!("a {:?} tensor of shape {:?}", t.dtype(), t.dims()),
        }
    }
}

/// A dict's keys for messages: the first 8.
fn key_list(items: &[(PyValue, PyValue)]) -> String {
    let mut keys: Vec<String> = items
        .iter()
        .take(8)
        .map(|(k, _)| match k {
            PyValue::Str(s) => s.clone(),
            PyValue::Int(i) => i.to_string(),
            other => format!("<{}>", other.describe()),
        })
        .collect();
    if items.len() > 8 {
        keys.push("…".into());
    }
    if keys.is_empty() {
        "(none)".into()
    } else {
        keys.join(", ")
    }
}

/// A Rust type a [`PyValue`] converts to, as [`PthValues::extract`] asks for one.
pub trait FromPyValue: Sized {
    /// What the type is, for messages (`an integer`).
    const EXPECTED: &'static str;
    /// The value as `Self`, if it is one.
    fn from_py(value: &PyValue) -> Option<Self>;
}

impl FromPyValue for i64 {
    const EXPECTED: &'static str = "an integer";
    fn from_py(value: &PyValue) -> Option<Self> {
        match value {
            PyValue::Int(i) => Some(*i),
            _ => None,
        }
    }
}

impl FromPyValue for usize {
    const EXPECTED: &'static str = "a non-negative integer";
    fn from_py(value: &PyValue) -> Option<Self> {
        match value {
            PyValue::Int(i) => usize::try_from(*i).ok(),
            _ => None,
        }
    }
}

impl FromPyValue for f64 {
    const EXPECTED: &'static str = "a number (float or int)";
    /// A `float`, or an `int` as Python's `float()` converts it.
    fn from_py(value: &PyValue) -> Option<Self> {
        match value {
            PyValue::Float(x) => Some(*x),
            PyValue::Int(i) => Some(*i as f64),
            _ => None,
        }
    }
}

impl FromPyValue for bool {
    const EXPECTED: &'static str = "a bool";
    fn from_py(value: &PyValue) -> Option<Self> {
        match value {
            PyValue::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

impl FromPyValue for String {
    const EXPECTED: &'static str = "a string";
    fn from_py(value: &PyValue) -> Option<Self> {
        match value {
            PyValue::Str(s) => Some(s.clone()),
            _ => None,
        }
    }
}

impl FromPyValue for Tensor {
    const EXPECTED: &'static str = "a tensor";
    fn from_py(value: &PyValue) -> Option<Self> {
        match value {
            PyValue::Tensor(t) => Some(t.clone()),
            _ => None,
        }
    }
}

impl FromPyValue for PyValue {
    const EXPECTED: &'static str = "a value";
    fn from_py(value: &PyValue) -> Option<Self> {
        Some(value.clone())
    }
}

impl<T: FromPyValue> FromPyValue for Vec<T> {
    const EXPECTED: &'static str = "a list or tuple (of the type asked for)";
    fn from_py(value: &PyValue) -> Option<Self> {
        value.as_list()?.iter().map(T::from_py).collect()
    }
}

/// A PyTorch pickle file's Python values: `ckpt = torch.load(path)`, read safely. Tensors are
/// built on the CPU when the file is read (as `torch.load(path, map_location="cpu")`).
///
/// ```
/// use module_runtime::{PthValues, PyValue};
/// # let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/pytorch/scheduler/step_lr.pt");
/// // torch.save({"model": ..., "optimizer": ..., "scheduler": ..., "epoch": 3, "step": 12,
/// //             "extra": {"best": 0.5, "tags": ["a", "b"], ...}}, path)
/// let ckpt = PthValues::load(path)?; // ckpt = torch.load(path)
/// let epoch: i64 = ckpt.extract("epoch")?; // ckpt["epoch"]
/// assert_eq!(epoch, 3);
/// let best: f64 = ckpt.extract("extra.best")?; // ckpt["extra"]["best"]
/// assert_eq!(best, 0.5);
/// let tags: Vec<String> = ckpt.extract("extra.tags")?;
/// assert_eq!(tags, ["a", "b"]);
/// let scheduler = ckpt.get("scheduler")?; // ckpt["scheduler"], a dict
/// assert!(matches!(scheduler.get("last_epoch"), Some(PyValue::Int(4))));
/// // A path that is not there names how far it got.
/// let err = ckpt.get("extra.worst").unwrap_err();
/// assert!(err.to_string().contains("extra has no key `worst`"));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub struct PthValues {
    path: PathBuf,
    root: PyValue,
}

impl PthValues {
    /// Reads `path` (a zip or legacy `torch.save` file) and builds its values, bounded: at most
    /// [`MAX_DEPTH`] levels of nesting, [`MAX_VALUES`] values, and strings, `bytes` and big
    /// integers of at most twice the file's size plus [`MAX_TEXT_SLACK`] bytes in all; each
    /// tensor is checked against its storage before it is built.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        let tree = PthTree::open(path.as_ref())?;
        let file_len = std::fs::metadata(path.as_ref()).map_or(0, |m| m.len() as usize);
        let root = Builder {
            tree: &tree,
            count: 0,
            text_left: file_len.saturating_mul(2).saturating_add(MAX_TEXT_SLACK),
            tensors: HashMap::new(),
        }
        .build(tree.root(), "", 0)?;
        Ok(Self {
            path: path.as_ref().to_owned(),
            root,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The top-level value (`ckpt` itself).
    pub fn root(&self) -> &PyValue {
        &self.root
    }

    /// Takes the top-level value.
    pub fn into_root(self) -> PyValue {
        self.root
    }

    /// The value at `key`, a dotted path from the top level: `"epoch"` is `ckpt["epoch"]`,
    /// `"extra.tags.1"` is `ckpt["extra"]["tags"][1]`. A segment is a dict's string key (tried
    /// whole first, so state dict keys with dots work: `"model.fc1.weight"`), an integer key, or
    /// a list index. An error ([`PthErrorKind::Value`]) names the part of the path that was
    /// found and what is there.
    pub fn get(&self, key: &str) -> Result<&PyValue> {
        let mut current = &self.root;
        let mut rest = key;
        let mut done = String::new();
        loop {
            if let Some(v) = current.get(rest) {
                return Ok(v);
            }
            let next = rest
                .match_indices('.')
                .find_map(|(i, _)| Some((current.get(&rest[..i])?, i)));
            let Some((v, i)) = next else {
                let at = if done.is_empty() {
                    "the top level"
                } else {
                    &done
                };
                let reason = match current {
                    PyValue::Dict(_) => format!("{at} has no key `{rest}`"),
                    PyValue::List(items) | PyValue::Tuple(items) => {
                        format!("{at} has no index `{rest}` (it has {} items)", items.len())
                    }
                    _ => format!("{at} is not a dict or list"),
                };
                let reason = format!("{reason}: it is {}", current.describe());
                return Err(self.error(key, reason));
            };
            if !done.is_empty() {
                done.push('.');
            }
            done.push_str(&rest[..i]);
            current = v;
            rest = &rest[i + 1..];
        }
    }

    /// The value at `key` (as [`get`](Self::get) finds it) as `T`: `ckpt.extract::<i64>("epoch")`.
    /// A value of another type is an error naming `key`, what was asked and what is there.
    pub fn extract<T: FromPyValue>(&self, key: &str) -> Result<T> {
        let v = self.get(key)?;
        T::from_py(v)
            .ok_or_else(|| self.error(key, format!("is {}, not {}", v.describe(), T::EXPECTED)))
    }

    fn error(&self, key: &str, reason: String) -> Error {
        Error::Pth {
            path: self.path.clone(),
            offset: None,
            kind: Box::new(PthErrorKind::Value {
                key: key.to_owned(),
                reason,
            }),
        }
    }
}

/// Turns the pickle's arena into [`PyValue`]s, counting them.
struct Builder<'a> {
    tree: &'a PthTree,
    count: usize,
    /// How many more bytes of strings, `bytes` and big integers may be copied out.
    text_left: usize,
    /// Tensors already built, by arena index: a tensor referenced twice is built once.
    tensors: HashMap<usize, Tensor>,
}

impl<'a> Builder<'a> {
    fn pickle(&self) -> &'a Pickle {
        self.tree.pickle()
    }

    /// `v` as a [`PyValue`]; `at` is its dotted path, for errors.
    fn build(&mut self, v: &Value, at: &str, depth: usize) -> Result<PyValue> {
        self.count += 1;
        if self.count > MAX_VALUES {
            return Err(self.tree.malformed(format!(
                "the pickle expands to more than {MAX_VALUES} values"
            )));
        }
        Ok(match v {
            Value::None => PyValue::None,
            Value::Bool(b) => PyValue::Bool(*b),
            Value::Int(i) => PyValue::Int(*i),
            Value::BigInt(b) => PyValue::BigInt(self.text(b)?.to_vec()),
            Value::Float(x) => PyValue::Float(*x),
            Value::Str(s) => PyValue::Str(self.text(s.as_bytes()).map(|_| s.to_string())?),
            Value::Bytes(b) => PyValue::Bytes(self.text(b)?.to_vec()),
            Value::Obj(id) => {
                if depth >= MAX_DEPTH {
                    return Err(self.tree.malformed(format!(
                        "`{at}` nests deeper than {MAX_DEPTH} levels (or contains itself)"
                    )));
                }
                let child = |i: &dyn std::fmt::Display| {
                    if at.is_empty() {
                        i.to_string()
                    } else {
                        format!("{at}.{i}")
                    }
                };
                match self.pickle().object(v) {
                    Some(Object::List(items)) => PyValue::List(self.items(items, &child, depth)?),
                    Some(Object::Tuple(items)) => PyValue::Tuple(self.items(items, &child, depth)?),
                    Some(Object::Dict(items)) => {
                        let mut out = Vec::with_capacity(items.len());
                        for (k, v) in items {
                            let name = match k {
                                Value::Str(s) => s.to_string(),
                                Value::Int(i) => i.to_string(),
                                _ => "<key>".into(),
                            };
                            let key = self.build(k, at, depth + 1)?;
                            out.push((key, self.build(v, &child(&name), depth + 1)?));
                        }
                        PyValue::Dict(out)
                    }
                    Some(Object::Tensor(t)) => {
                        if let Some(t) = self.tensors.get(id) {
                            return Ok(PyValue::Tensor(t.clone()));
                        }
                        let t = self.tree.tensor(at, t, &Device::Cpu)?;
                        self.tensors.insert(*id, t.clone());
                        PyValue::Tensor(t)
                    }
                    _ => {
                        return Err(self.tree.malformed(format!(
                            "`{at}` is {}, which is not a value",
                            self.pickle().describe(v)
                        )))
                    }
                }
            }
        })
    }

    /// `bytes`, once its copy is counted against the file's budget.
    fn text<'b>(&mut self, bytes: &'b [u8]) -> Result<&'b [u8]> {
        match self.text_left.checked_sub(bytes.len()) {
            Some(left) => {
                self.text_left = left;
                Ok(bytes)
            }
            None => Err(self.tree.malformed(
                "the pickle's strings expand to more than twice the file's size (one string \
                 referred to many times?)",
            )),
        }
    }

    fn items(
        &mut self,
        items: &[Value],
        child: &dyn Fn(&dyn std::fmt::Display) -> String,
        depth: usize,
    ) -> Result<Vec<PyValue>> {
        items
            .iter()
            .enumerate()
            .map(|(i, v)| self.build(v, &child(&i), depth + 1))
            .collect()
    }
}
