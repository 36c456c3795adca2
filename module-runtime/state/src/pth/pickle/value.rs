//! What a pickle decodes to: plain values, containers in an arena, allowed globals, and torch's
//! storage and tensor references.

use std::rc::Rc;

/// A pickled value. Containers are [`Value::Obj`] handles into [`Pickle::objects`].
#[derive(Clone, Debug)]
pub enum Value {
    None,
    Bool(bool),
    Int(i64),
    /// An integer that does not fit `i64`: little-endian two's complement bytes.
    BigInt(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Obj(usize),
}

/// An allowed Python global.
#[derive(Clone, Debug, PartialEq)]
pub enum Global {
    OrderedDict,
    /// `builtins.set` / `builtins.frozenset`: read as a list.
    Set,
    /// `torch._utils._rebuild_tensor_v2` and `_rebuild_tensor`.
    RebuildTensor,
    /// `torch._utils._rebuild_parameter` and `_rebuild_parameter_with_state`.
    RebuildParameter,
    /// `torch.FloatStorage` and the other typed storages, by name (`FloatStorage`).
    Storage(&'static str),
    /// `_codecs.encode`, which protocol 2 uses for `bytes`.
    CodecsEncode,
    /// `torch.Size`, a tuple.
    TorchSize,
}

/// The torch storage types a checkpoint can name. Whether candle has a dtype for one is decided
/// by the caller; an unknown name is a forbidden global.
const STORAGE_TYPES: &[&str] = &[
    "FloatStorage",
    "DoubleStorage",
    "HalfStorage",
    "BFloat16Storage",
    "ByteStorage",
    "CharStorage",
    "ShortStorage",
    "IntStorage",
    "LongStorage",
    "BoolStorage",
    "ComplexFloatStorage",
    "ComplexDoubleStorage",
    "QUInt8Storage",
    "QInt8Storage",
    "QInt32Storage",
    "QUInt4x2Storage",
    "QUInt2x4Storage",
    "UntypedStorage",
];

impl Global {
    pub(super) fn resolve(module: &str, name: &str) -> Option<Global> {
        Some(match (module, name) {
            ("collections", "OrderedDict") => Global::OrderedDict,
            ("builtins" | "__builtin__", "set" | "frozenset") => Global::Set,
            ("torch._utils", "_rebuild_tensor_v2" | "_rebuild_tensor") => Global::RebuildTensor,
            ("torch._utils", "_rebuild_parameter" | "_rebuild_parameter_with_state") => {
                Global::RebuildParameter
            }
            ("_codecs", "encode") => Global::CodecsEncode,
            ("torch", "Size") => Global::TorchSize,
            ("torch" | "torch.storage", name) => {
                Global::Storage(STORAGE_TYPES.iter().copied().find(|s| *s == name)?)
            }
            _ => return None,
        })
    }
}

/// A storage named by a persistent id: `('storage', storage_type, key, location, numel[, view])`.
#[derive(Clone, Debug)]
pub struct StorageRef {
    /// The storage type's name (`FloatStorage`).
    pub storage_type: &'static str,
    /// The storage's key (zip member `data/<key>`, or legacy root key).
    pub key: Rc<str>,
    /// The declared number of elements.
    pub numel: i64,
    /// Legacy views of a root storage: `(offset, size)` in elements.
    pub view: Option<(i64, i64)>,
}

/// A tensor rebuilt by `_rebuild_tensor_v2`: raw declared values, checked by the caller against
/// the storage's real length.
#[derive(Clone, Debug)]
pub struct TensorRef {
    pub storage: StorageRef,
    pub offset: i64,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
}

/// A container or torch object in the arena.
#[derive(Debug)]
pub enum Object {
    List(Vec<Value>),
    Tuple(Vec<Value>),
    /// Items in insertion order; a repeated key is kept (the reader resolves it: last value wins).
    Dict(Vec<(Value, Value)>),
    Global(Global),
    Storage(StorageRef),
    Tensor(TensorRef),
}

/// One decoded pickle.
pub struct Pickle {
    pub objects: Vec<Object>,
    pub root: Value,
    /// The offset just after `STOP`, within the input slice.
    pub end: usize,
}

impl Pickle {
    /// The object `value` refers to, if it is a container.
    pub fn object(&self, value: &Value) -> Option<&Object> {
        match value {
            Value::Obj(i) => self.objects.get(*i),
            _ => None,
        }
    }

    /// A short description of `value` for messages (`a dict with keys epoch, model`).
    pub fn describe(&self, value: &Value) -> String {
        match value {
            Value::None => "None".into(),
            Value::Bool(_) => "a bool".into(),
            Value::Int(i) => format!("the integer {i}"),
            Value::BigInt(_) => "a big integer".into(),
            Value::Float(f) => format!("the float {f}"),
            Value::Str(_) => "a string".into(),
            Value::Bytes(b) => format!("{} bytes", b.len()),
            Value::Obj(_) => match self.object(value) {
                Some(Object::List(items)) => format!("a list of {} items", items.len()),
                Some(Object::Tuple(items)) => format!("a tuple of {} items", items.len()),
                Some(Object::Dict(items)) => {
                    let keys: Vec<String> = items
                        .iter()
                        .take(8)
                        .map(|(k, _)| match k {
                            Value::Str(s) => s.to_string(),
                            other => self.describe_key(other),
                        })
                        .collect();
                    let more = if items.len() > 8 { ", …" } else { "" };
                    format!("a dict with keys {}{more}", keys.join(", "))
                }
                Some(Object::Global(g)) => format!("the global {g:?}"),
                Some(Object::Storage(_)) => "a storage".into(),
                Some(Object::Tensor(_)) => "a tensor".into(),
                None => "an invalid reference".into(),
            },
        }
    }

    fn describe_key(&self, key: &Value) -> String {
        match key {
            Value::Int(i) => i.to_string(),
            _ => format!("<{}>", self.describe(key)),
        }
    }
}
