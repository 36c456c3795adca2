//! PyTorch pickle checkpoints (`torch.save`: `.pth`, `.pt`, Hugging Face `pytorch_model.bin`),
//! read by our own bounded reader: no file can crash the process or make it execute anything.
//!
//! Both containers `torch.load` reads are accepted ([`container`]): the zip format (PyTorch ≥ 1.6)
//! and the legacy format (before 1.6). The pickle is decoded by a small virtual machine
//! ([`pickle`]) that only knows the values a state dict is made of and an allow-list of Python
//! globals (tensor rebuild functions, storage types, `OrderedDict`); any other global is an error
//! that names it. Every tensor's shape, strides and storage offset are checked against the real
//! length of its storage when the file is opened, before anything is allocated; values are read
//! one tensor at a time, when loaded. The file is read into memory (not memory-mapped), so a file
//! truncated while it is read is an error, not a crash.

pub mod container;
pub mod pickle;
pub mod tree;
pub mod values;

use std::collections::HashMap;
use std::ops::Range;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Shape, Tensor};

use self::container::{storage_info, Container};
use self::pickle::{Fail, Object, Pickle, TensorRef, Value};
use crate::error::{Error, PthErrorKind, Result};
use crate::state::Source;

/// One tensor of the state dict: its validated layout and where its storage lies in the file.
struct Entry {
    key: String,
    dtype: DType,
    shape: Vec<usize>,
    stride: Vec<usize>,
    /// Storage offset, in elements.
    offset: usize,
    /// The storage's bytes in the file.
    storage: Range<usize>,
}

/// A PyTorch checkpoint read into memory, its state dict selected and validated: a [`Source`]
/// that lists entries without building tensors and builds one tensor per `load`.
pub struct PthFile {
    path: PathBuf,
    bytes: Vec<u8>,
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
}

impl PthFile {
    /// Reads and validates `path`. `key` selects a nested state dict (`"model"`, or dotted,
    /// `"model.ema"`); without one, the top level must be a state dict.
    pub fn open(path: &Path, key: Option<&str>) -> Result<Self> {
        let (bytes, container) = read(path)?;
        let fail = |f: Fail| failure(path, f);
        let tensors = select(&container.pickle, key).map_err(fail)?;
        let entries = tensors
            .into_iter()
            .map(|(key, tensor)| check(&container, key, tensor))
            .collect::<Result<Vec<_>, Fail>>()
            .map_err(fail)?;
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.key.clone(), i))
            .collect();
        Ok(Self {
            path: path.to_owned(),
            bytes,
            entries,
            index,
        })
    }

    fn build(&self, e: &Entry, device: &Device) -> Result<Tensor> {
        materialize(&self.bytes, e, device)
    }
}

/// Reads `path` into memory and parses its container and pickle.
fn read(path: &Path) -> Result<(Vec<u8>, Container)> {
    let bytes = std::fs::read(path).map_err(|source| Error::Io {
        path: path.to_owned(),
        source,
    })?;
    let container = Container::parse(&bytes).map_err(|f| failure(path, f))?;
    Ok((bytes, container))
}

/// A reader's failure as the error that names the file.
fn failure(path: &Path, f: Fail) -> Error {
    Error::Pth {
        path: path.to_owned(),
        offset: f.offset,
        kind: Box::new(f.kind),
    }
}

/// Builds the tensor `e` describes from the file's `bytes` (its layout is validated).
fn materialize(bytes: &[u8], e: &Entry, device: &Device) -> Result<Tensor> {
    let elem = e.dtype.size_in_bytes();
    let storage = &bytes[e.storage.clone()];
    let numel: usize = e.shape.iter().product();
    let n = numel * elem;
    let data = if n == 0 {
        std::borrow::Cow::Borrowed(&[][..])
    } else if is_contiguous(&e.shape, &e.stride) {
        let start = e.offset * elem;
        std::borrow::Cow::Borrowed(&storage[start..start + n])
    } else {
        std::borrow::Cow::Owned(gather(storage, e, elem))
    };
    Ok(Tensor::from_raw_buffer(&data, e.dtype, &e.shape, device)?)
}

impl Source for PthFile {
    fn entries(&self) -> Result<Vec<(String, Shape, DType)>> {
        Ok(self
            .entries
            .iter()
            .map(|e| (e.key.clone(), Shape::from(e.shape.clone()), e.dtype))
            .collect())
    }

    fn load(&self, key: &str, device: &Device) -> Result<Tensor> {
        let Some(&i) = self.index.get(key) else {
            return Err(Error::Pth {
                path: self.path.clone(),
                offset: None,
                kind: Box::new(PthErrorKind::NoSuchKey {
                    key: key.to_owned(),
                    available: Vec::new(),
                }),
            });
        };
        self.build(&self.entries[i], device)
    }
}

/// Whether `stride` is the row-major stride of `shape` (dimensions of size 1 aside).
fn is_contiguous(shape: &[usize], stride: &[usize]) -> bool {
    let mut expected = 1usize;
    for (&size, &st) in shape.iter().zip(stride).rev() {
        if size != 1 && st != expected {
            return false;
        }
        expected = expected.saturating_mul(size);
    }
    true
}

/// Copies a strided tensor's elements into row-major order. The layout is validated, so every
/// index lies inside `storage`.
fn gather(storage: &[u8], e: &Entry, elem: usize) -> Vec<u8> {
    let numel: usize = e.shape.iter().product();
    let mut out = Vec::with_capacity(numel * elem);
    if numel == 0 {
        return out;
    }
    let rank = e.shape.len();
    let (inner_size, inner_stride) = (e.shape[rank - 1], e.stride[rank - 1]);
    let mut index = vec![0usize; rank - 1];
    loop {
        let base = e.offset
            + index
                .iter()
                .zip(&e.stride)
                .map(|(i, s)| i * s)
                .sum::<usize>();
        if inner_stride == 1 {
            out.extend_from_slice(&storage[base * elem..(base + inner_size) * elem]);
        } else {
            for j in 0..inner_size {
                let at = (base + j * inner_stride) * elem;
                out.extend_from_slice(&storage[at..at + elem]);
            }
        }
        // The next index over the outer dimensions, last fastest.
        let mut d = rank - 1;
        loop {
            if d == 0 {
                return out;
            }
            d -= 1;
            index[d] += 1;
            if index[d] < e.shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
}

/// Checks a tensor's layout against its storage's real length, before anything is allocated.
fn check(container: &Container, key: String, t: &TensorRef) -> Result<Entry, Fail> {
    let (dtype, elem) = storage_info(t.storage.storage_type);
    let Some(dtype) = dtype else {
        return Err(Fail::new(PthErrorKind::UnsupportedDType {
            key,
            storage_type: format!("torch.{}", t.storage.storage_type),
        }));
    };
    let storage = container.storage_range(&t.storage)?;
    let out_of_bounds = |key: String| {
        Fail::new(PthErrorKind::StorageOutOfBounds {
            key,
            shape: t.size.clone(),
            stride: t.stride.clone(),
            offset: t.offset,
            storage_bytes: storage.len() as u64,
        })
    };
    let to_usize =
        |v: &[i64]| -> Option<Vec<usize>> { v.iter().map(|&x| usize::try_from(x).ok()).collect() };
    let (Some(shape), Some(stride), Ok(offset)) = (
        to_usize(&t.size),
        to_usize(&t.stride),
        usize::try_from(t.offset),
    ) else {
        return Err(out_of_bounds(key));
    };
    let numel = shape.iter().try_fold(1usize, |n, &s| n.checked_mul(s));
    let fits = numel.and_then(|numel| {
        // The materialized tensor is never larger than its storage (overlapping strides that
        // would expand it are refused), so a small file never allocates much.
        let bytes = numel.checked_mul(elem)?;
        if bytes > storage.len() {
            return None;
        }
        if numel == 0 {
            // Nothing is read, but the offset must still lie within the storage.
            return (offset.checked_mul(elem)? <= storage.len()).then_some(());
        }
        let last = shape
            .iter()
            .zip(&stride)
            .try_fold(offset, |acc, (&size, &st)| {
                acc.checked_add((size - 1).checked_mul(st)?)
            })?;
        let end = last.checked_add(1)?.checked_mul(elem)?;
        (end <= storage.len()).then_some(())
    });
    if fits.is_none() {
        return Err(out_of_bounds(key));
    }
    Ok(Entry {
        key,
        dtype,
        shape,
        stride,
        offset,
        storage,
    })
}

pub(crate) fn dict<'p>(p: &'p Pickle, v: &Value) -> Option<&'p [(Value, Value)]> {
    match p.object(v) {
        Some(Object::Dict(items)) => Some(items),
        _ => None,
    }
}

pub(crate) fn tensor<'p>(p: &'p Pickle, v: &Value) -> Option<&'p TensorRef> {
    match p.object(v) {
        Some(Object::Tensor(t)) => Some(t),
        _ => None,
    }
}

/// The value at string key `key` (the last one, as in a Python dict).
pub(crate) fn lookup<'p>(items: &'p [(Value, Value)], key: &str) -> Option<&'p Value> {
    items.iter().rev().find_map(|(k, v)| match k {
        Value::Str(s) if &**s == key => Some(v),
        _ => None,
    })
}

/// The keys of a dict, for messages.
fn key_names(p: &Pickle, items: &[(Value, Value)]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    items
        .iter()
        .map(|(k, _)| match k {
            Value::Str(s) => s.to_string(),
            Value::Int(i) => i.to_string(),
            other => format!("<{}>", p.describe(other)),
        })
        .filter(|k| seen.insert(k.clone()))
        .take(50)
        .collect()
}

/// Whether `v` is a non-empty dict of string keys and tensor values. Answers are cached by object,
/// so a dict referenced many times (through the memo) is scanned once.
fn is_state_dict(p: &Pickle, v: &Value, cache: &mut HashMap<usize, bool>) -> bool {
    let Value::Obj(id) = v else {
        return false;
    };
    *cache.entry(*id).or_insert_with(|| {
        dict(p, v).is_some_and(|items| {
            !items.is_empty()
                && items
                    .iter()
                    .all(|(k, v)| matches!(k, Value::Str(_)) && tensor(p, v).is_some())
        })
    })
}

/// The keys of `items` that hold a state dict, and `key.inner` for those one dict further down
/// (each dict is looked into once; at most 50 names).
fn candidates(p: &Pickle, items: &[(Value, Value)]) -> Vec<String> {
    let mut cache = HashMap::new();
    let mut expanded = std::collections::HashSet::new();
    let mut out = Vec::new();
    for (k, v) in items {
        let Value::Str(name) = k else { continue };
        if is_state_dict(p, v, &mut cache) {
            out.push(name.to_string());
        } else if let (Some(inner), Value::Obj(id)) = (dict(p, v), v) {
            if !expanded.insert(*id) {
                continue;
            }
            for (k2, v2) in inner {
                if let Value::Str(name2) = k2
                    && is_state_dict(p, v2, &mut cache)
                {
                    out.push(format!("{name}.{name2}"));
                }
            }
        }
        if out.len() >= 50 {
            break;
        }
    }
    out.dedup();
    out.truncate(50);
    out
}

/// Finds the state dict: at `key` if given, else the top level.
fn select<'p>(p: &'p Pickle, key: Option<&str>) -> Result<Vec<(String, &'p TensorRef)>, Fail> {
    match key {
        Some(key) => state_dict(p, find(p, key)?),
        None => state_dict(p, &p.root),
    }
}

/// The value at `key` below the root, a dotted key descending through nested dicts (a key that
/// contains dots itself is tried whole first).
pub(crate) fn find<'p>(p: &'p Pickle, key: &str) -> Result<&'p Value, Fail> {
    let mut current = &p.root;
    let mut rest = key;
    loop {
        let Some(items) = dict(p, current) else {
            return Err(Fail::new(PthErrorKind::NoSuchKey {
                key: key.to_owned(),
                available: Vec::new(),
            }));
        };
        if let Some(v) = lookup(items, rest) {
            return Ok(v);
        }
        // A dotted key: descend through the first prefix that names a dict.
        let next = rest.match_indices('.').find_map(|(i, _)| {
            let v = lookup(items, &rest[..i])?;
            dict(p, v).map(|_| (v, &rest[i + 1..]))
        });
        match next {
            Some((v, r)) => (current, rest) = (v, r),
            None => {
                return Err(Fail::new(PthErrorKind::NoSuchKey {
                    key: key.to_owned(),
                    available: key_names(p, items),
                }))
            }
        }
    }
}

/// The entries of the state dict `v`, in order. A key repeated in the pickle (which `torch.save`
/// never writes: a Python dict pickles each key once) is an error, not the last value as
/// unpickling into a dict would make it.
fn state_dict<'p>(p: &'p Pickle, v: &Value) -> Result<Vec<(String, &'p TensorRef)>, Fail> {
    let not_a_state_dict = |candidates: Vec<String>| {
        Fail::new(PthErrorKind::NotAStateDict {
            candidates,
            found: p.describe(v),
        })
    };
    let Some(items) = dict(p, v) else {
        return Err(not_a_state_dict(Vec::new()));
    };
    let mut out: Vec<(String, &TensorRef)> = Vec::with_capacity(items.len());
    let mut positions: HashMap<&str, usize> = HashMap::new();
    let mut offending = None;
    for (k, value) in items {
        match (k, tensor(p, value)) {
            (Value::Str(name), Some(t)) => match positions.get(&**name) {
                Some(_) => {
                    return Err(Fail::new(PthErrorKind::DuplicateKey {
                        key: name.to_string(),
                    }));
                }
                None => {
                    positions.insert(name, out.len());
                    out.push((name.to_string(), t));
                }
            },
            _ => {
                offending.get_or_insert((k, value));
            }
        }
    }
    let Some((k, value)) = offending else {
        return Ok(out);
    };
    // Not a state dict: a training checkpoint, or a state dict with a stray value.
    let candidates = candidates(p, items);
    if !candidates.is_empty() || out.is_empty() {
        return Err(not_a_state_dict(candidates));
    }
    let key = match k {
        Value::Str(s) => s.to_string(),
        other => format!("<{}>", p.describe(other)),
    };
    Err(Fail::new(PthErrorKind::NotATensor {
        key,
        found: p.describe(value),
    }))
}
