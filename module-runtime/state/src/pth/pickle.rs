//! A bounded pickle reader: a small, iterative virtual machine over the opcodes of protocols 2–5
//! that `torch.save` emits, which builds plain values and never executes anything.
//!
//! Containers live in an arena ([`Pickle::objects`]) and values refer to them by index, so memo
//! lookups copy a handle, never a tree; cycles and deep nesting cost nothing, and no code walks a
//! value recursively. Strings and bytes are shared (`Rc`). The limits: the value stack and the mark
//! stack ([`MAX_STACK`], [`MAX_MARKS`]), memo indices ([`MAX_MEMO`]); every length is checked
//! against the bytes that remain before anything is allocated, and all arithmetic is checked.
//!
//! Python globals resolve only through an allow-list ([`Global`]): anything else is
//! [`PthErrorKind::ForbiddenGlobal`], and calling (`REDUCE`, `NEWOBJ`) is only defined for the
//! allowed callables.

use std::collections::HashMap;
use std::rc::Rc;

use crate::error::PthErrorKind;

/// The most values the pickle stack holds at once (all marks included). `torch.save` batches
/// dict items by 1000, so a state dict needs about 2000.
pub const MAX_STACK: usize = 10_000;
/// The most marks open at once: the nesting depth of tuples, lists and dicts being built.
pub const MAX_MARKS: usize = 1000;
/// The largest memo index accepted.
pub const MAX_MEMO: u64 = 1 << 20;

/// A reader error: what is wrong and where (an absolute offset in the file, when known).
#[derive(Debug)]
pub struct Fail {
    pub offset: Option<u64>,
    pub kind: PthErrorKind,
}

impl Fail {
    /// An error with no position.
    pub fn new(kind: PthErrorKind) -> Self {
        Self { offset: None, kind }
    }

    /// An error at `offset`.
    pub fn at(offset: u64, kind: PthErrorKind) -> Self {
        Self {
            offset: Some(offset),
            kind,
        }
    }

    /// [`PthErrorKind::Malformed`] with no position.
    pub fn malformed(reason: impl Into<String>) -> Self {
        Self::new(PthErrorKind::Malformed {
            reason: reason.into(),
        })
    }
}

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
    fn resolve(module: &str, name: &str) -> Option<Global> {
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

/// Decodes one pickle starting at `data[start..]`. Offsets in errors are `base + position`.
pub fn read(data: &[u8], start: usize, base: u64) -> Result<Pickle, Fail> {
    let mut vm = Vm {
        data,
        pos: start,
        op_pos: start,
        base,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        objects: Vec::new(),
    };
    let root = vm.run()?;
    Ok(Pickle {
        objects: vm.objects,
        root,
        end: vm.pos,
    })
}

struct Vm<'a> {
    data: &'a [u8],
    pos: usize,
    op_pos: usize,
    base: u64,
    stack: Vec<Value>,
    marks: Vec<usize>,
    memo: HashMap<u32, Value>,
    objects: Vec<Object>,
}

impl<'a> Vm<'a> {
    fn err(&self, kind: PthErrorKind) -> Fail {
        Fail::at(self.base.saturating_add(self.op_pos as u64), kind)
    }

    fn malformed(&self, reason: impl Into<String>) -> Fail {
        self.err(PthErrorKind::Malformed {
            reason: reason.into(),
        })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], Fail> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.data.len())
            .ok_or_else(|| self.err(PthErrorKind::Truncated))?;
        let bytes = &self.data[self.pos..end];
        self.pos = end;
        Ok(bytes)
    }

    fn u8(&mut self) -> Result<u8, Fail> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], Fail> {
        let bytes = self.take(N)?;
        let mut out = [0; N];
        out.copy_from_slice(bytes);
        Ok(out)
    }

    fn len_u32(&mut self) -> Result<usize, Fail> {
        let n = u32::from_le_bytes(self.array()?);
        usize::try_from(n).map_err(|_| self.err(PthErrorKind::Truncated))
    }

    fn len_u64(&mut self) -> Result<usize, Fail> {
        let n = u64::from_le_bytes(self.array()?);
        usize::try_from(n).map_err(|_| self.err(PthErrorKind::Truncated))
    }

    /// A newline-terminated line (for `GLOBAL`), without the newline; bounded by the input.
    fn line(&mut self) -> Result<&'a str, Fail> {
        let rest = &self.data[self.pos..];
        let n = rest
            .iter()
            .take(1024)
            .position(|&b| b == b'\n')
            .ok_or_else(|| self.malformed("a GLOBAL line is missing its newline or too long"))?;
        let line = self.take(n)?;
        self.pos += 1;
        std::str::from_utf8(line).map_err(|_| self.malformed("a GLOBAL line is not UTF-8"))
    }

    fn push(&mut self, value: Value) -> Result<(), Fail> {
        if self.stack.len() >= MAX_STACK {
            return Err(self.err(PthErrorKind::TooDeep { limit: MAX_STACK }));
        }
        self.stack.push(value);
        Ok(())
    }

    fn pop(&mut self) -> Result<Value, Fail> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.malformed("the pickle stack is empty where a value is needed"));
        }
        Ok(self.stack.pop().expect("checked above"))
    }

    fn top(&self) -> Result<&Value, Fail> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.malformed("the pickle stack is empty where a value is needed"));
        }
        Ok(self.stack.last().expect("checked above"))
    }

    /// The stack index of the top value, which must be above the last mark.
    fn top_index(&self) -> Result<usize, Fail> {
        self.top()?;
        Ok(self.stack.len() - 1)
    }

    /// Pops everything above the last mark, and the mark.
    fn pop_mark(&mut self) -> Result<Vec<Value>, Fail> {
        let mark = self
            .marks
            .pop()
            .ok_or_else(|| self.malformed("no MARK for an opcode that needs one"))?;
        Ok(self.stack.split_off(mark))
    }

    fn new_object(&mut self, object: Object) -> Value {
        self.objects.push(object);
        Value::Obj(self.objects.len() - 1)
    }

    fn memo_put(&mut self, index: u64) -> Result<(), Fail> {
        if index > MAX_MEMO {
            return Err(self.err(PthErrorKind::MemoTooLarge {
                index,
                limit: MAX_MEMO,
            }));
        }
        let value = self.top()?.clone();
        // `index <= MAX_MEMO < u32::MAX`.
        self.memo.insert(index as u32, value);
        Ok(())
    }

    fn memo_get(&mut self, index: u64) -> Result<(), Fail> {
        let value = u32::try_from(index)
            .ok()
            .and_then(|i| self.memo.get(&i))
            .cloned()
            .ok_or_else(|| {
                self.malformed(format!("memo index {index} is read before it is set"))
            })?;
        self.push(value)
    }

    fn string(&mut self, n: usize) -> Result<Value, Fail> {
        let bytes = self.take(n)?;
        let s = std::str::from_utf8(bytes).map_err(|_| self.malformed("a string is not UTF-8"))?;
        Ok(Value::Str(Rc::from(s)))
    }

    fn bytes(&mut self, n: usize) -> Result<Value, Fail> {
        Ok(Value::Bytes(Rc::from(self.take(n)?)))
    }

    fn long(&mut self, n: usize) -> Result<Value, Fail> {
        let bytes = self.take(n)?;
        if bytes.is_empty() {
            return Ok(Value::Int(0));
        }
        if bytes.len() <= 8 {
            let fill = if bytes[bytes.len() - 1] & 0x80 != 0 {
                0xff
            } else {
                0
            };
            let mut buf = [fill; 8];
            buf[..bytes.len()].copy_from_slice(bytes);
            Ok(Value::Int(i64::from_le_bytes(buf)))
        } else {
            Ok(Value::BigInt(Rc::from(bytes)))
        }
    }

    fn list_mut(&mut self, at: usize) -> Result<&mut Vec<Value>, Fail> {
        let target = match self.stack.get(at) {
            Some(Value::Obj(i)) => Some(*i),
            _ => None,
        };
        match target.and_then(|i| self.objects.get(i)) {
            Some(Object::List(_)) => {}
            _ => return Err(self.malformed("APPEND(S) or ADDITEMS on a value that is not a list")),
        }
        match &mut self.objects[target.expect("checked above")] {
            Object::List(items) => Ok(items),
            _ => unreachable!("checked above"),
        }
    }

    fn dict_mut(&mut self, at: usize) -> Result<&mut Vec<(Value, Value)>, Fail> {
        let target = match self.stack.get(at) {
            Some(Value::Obj(i)) => Some(*i),
            _ => None,
        };
        match target.and_then(|i| self.objects.get(i)) {
            Some(Object::Dict(_)) => {}
            _ => return Err(self.malformed("SETITEM(S) on a value that is not a dict")),
        }
        match &mut self.objects[target.expect("checked above")] {
            Object::Dict(items) => Ok(items),
            _ => unreachable!("checked above"),
        }
    }

    /// The stack index of the value just below the last mark (the container being filled).
    fn below_mark(&self) -> Result<usize, Fail> {
        let mark = *self
            .marks
            .last()
            .ok_or_else(|| self.malformed("no MARK for an opcode that needs one"))?;
        let floor = self.marks.len().checked_sub(2).map_or(0, |i| self.marks[i]);
        if mark <= floor {
            return Err(self.malformed("no container below the MARK"));
        }
        Ok(mark - 1)
    }

    fn global(&mut self, module: &str, name: &str) -> Result<Value, Fail> {
        match Global::resolve(module, name) {
            Some(g) => Ok(self.new_object(Object::Global(g))),
            None => Err(self.err(PthErrorKind::ForbiddenGlobal {
                module: module.to_owned(),
                name: name.to_owned(),
            })),
        }
    }

    fn tuple_items(&self, value: &Value) -> Option<&[Value]> {
        match value {
            Value::Obj(i) => match self.objects.get(*i) {
                Some(Object::Tuple(items)) | Some(Object::List(items)) => Some(items),
                _ => None,
            },
            _ => None,
        }
    }

    fn ints(&self, value: &Value, what: &str) -> Result<Vec<i64>, Fail> {
        let items = self
            .tuple_items(value)
            .ok_or_else(|| self.malformed(format!("a tensor's {what} is not a tuple")))?;
        items
            .iter()
            .map(|v| match v {
                Value::Int(i) => Ok(*i),
                _ => Err(self.malformed(format!("a tensor's {what} holds a non-integer"))),
            })
            .collect()
    }

    /// `REDUCE` / `NEWOBJ`: calls an allowed callable on `args`.
    fn call(&mut self, callable: Value, args: Value) -> Result<Value, Fail> {
        let global = match self.object(&callable) {
            Some(Object::Global(g)) => g.clone(),
            _ => return Err(self.malformed("REDUCE on a value that is not an allowed global")),
        };
        let args: Vec<Value> = self
            .tuple_items(&args)
            .ok_or_else(|| self.malformed("REDUCE arguments are not a tuple"))?
            .to_vec();
        match global {
            Global::OrderedDict if args.is_empty() => Ok(self.new_object(Object::Dict(Vec::new()))),
            Global::Set | Global::TorchSize if args.len() <= 1 => {
                let items = match args.first() {
                    None => Vec::new(),
                    Some(v) => self
                        .tuple_items(v)
                        .ok_or_else(|| self.malformed("set() or torch.Size() of a non-sequence"))?
                        .to_vec(),
                };
                Ok(self.new_object(Object::Tuple(items)))
            }
            Global::RebuildTensor if args.len() >= 4 => {
                let storage = match self.object(&args[0]) {
                    Some(Object::Storage(s)) => s.clone(),
                    _ => return Err(self.malformed("a tensor is rebuilt from a non-storage")),
                };
                let offset = match args[1] {
                    Value::Int(i) => i,
                    _ => return Err(self.malformed("a tensor's storage offset is not an integer")),
                };
                let size = self.ints(&args[2], "shape")?;
                let stride = self.ints(&args[3], "stride")?;
                if size.len() != stride.len() {
                    return Err(self.malformed(format!(
                        "a tensor has {} dimensions but {} strides",
                        size.len(),
                        stride.len()
                    )));
                }
                Ok(self.new_object(Object::Tensor(TensorRef {
                    storage,
                    offset,
                    size,
                    stride,
                })))
            }
            Global::RebuildParameter if !args.is_empty() => match self.object(&args[0]) {
                Some(Object::Tensor(_)) => Ok(args[0].clone()),
                _ => Err(self.malformed("a parameter is rebuilt from a non-tensor")),
            },
            Global::CodecsEncode if (1..=2).contains(&args.len()) => {
                let Value::Str(s) = &args[0] else {
                    return Err(self.malformed("_codecs.encode of a non-string"));
                };
                let encoding = match args.get(1) {
                    Some(Value::Str(e)) => e.to_ascii_lowercase(),
                    None => "utf-8".into(),
                    _ => return Err(self.malformed("_codecs.encode with a non-string encoding")),
                };
                let bytes: Vec<u8> = match encoding.as_str() {
                    "latin1" | "latin-1" | "iso-8859-1" => s
                        .chars()
                        .map(|c| u8::try_from(u32::from(c)))
                        .collect::<Result<_, _>>()
                        .map_err(|_| self.malformed("_codecs.encode: not latin-1"))?,
                    "utf-8" | "utf8" => s.as_bytes().to_vec(),
                    other => {
                        return Err(self.malformed(format!("_codecs.encode to `{other}`")));
                    }
                };
                Ok(Value::Bytes(Rc::from(bytes)))
            }
            other => Err(self.malformed(format!(
                "{other:?} called with {} arguments it does not take",
                args.len()
            ))),
        }
    }

    fn object(&self, value: &Value) -> Option<&Object> {
        match value {
            Value::Obj(i) => self.objects.get(*i),
            _ => None,
        }
    }

    /// `BINPERSID`: torch's storage references.
    fn persistent_load(&mut self, pid: Value) -> Result<Value, Fail> {
        let items = self
            .tuple_items(&pid)
            .ok_or_else(|| self.malformed("a persistent id is not a tuple"))?;
        match items.first() {
            Some(Value::Str(s)) if &**s == "storage" => {}
            Some(Value::Str(s)) => {
                return Err(self.malformed(format!(
                    "persistent id of type `{s}`: only storages are supported"
                )))
            }
            _ => return Err(self.malformed("a persistent id without a type name")),
        }
        if !(5..=6).contains(&items.len()) {
            return Err(self.malformed("a storage persistent id does not have 5 or 6 fields"));
        }
        let storage_type = match self.object(&items[1]) {
            Some(Object::Global(Global::Storage(name))) => *name,
            _ => return Err(self.malformed("a storage's type is not a torch storage type")),
        };
        let key = match &items[2] {
            Value::Str(s) => s.clone(),
            Value::Int(i) => Rc::from(i.to_string()),
            _ => return Err(self.malformed("a storage's key is not a string")),
        };
        let numel = match items[4] {
            Value::Int(i) => i,
            _ => return Err(self.malformed("a storage's element count is not an integer")),
        };
        let view = match items.get(5) {
            None | Some(Value::None) => None,
            Some(v) => {
                let view = self
                    .tuple_items(v)
                    .filter(|items| items.len() == 3)
                    .ok_or_else(|| self.malformed("a storage view is not a 3-tuple"))?;
                match (&view[1], &view[2]) {
                    (Value::Int(offset), Value::Int(size)) => Some((*offset, *size)),
                    _ => return Err(self.malformed("a storage view's offset or size")),
                }
            }
        };
        Ok(self.new_object(Object::Storage(StorageRef {
            storage_type,
            key,
            numel,
            view,
        })))
    }

    fn run(&mut self) -> Result<Value, Fail> {
        loop {
            self.op_pos = self.pos;
            let op = self.u8()?;
            match op {
                // PROTO
                0x80 => {
                    let version = self.u8()?;
                    if version > 5 {
                        return Err(self.malformed(format!("pickle protocol {version}")));
                    }
                }
                // FRAME: an 8-byte length; the data follows inline.
                0x95 => {
                    let n = self.len_u64()?;
                    if n > self.data.len() - self.pos {
                        return Err(self.err(PthErrorKind::Truncated));
                    }
                }
                // STOP
                b'.' => {
                    let value = self.pop()?;
                    return Ok(value);
                }
                // MARK
                b'(' => {
                    if self.marks.len() >= MAX_MARKS {
                        return Err(self.err(PthErrorKind::TooDeep { limit: MAX_MARKS }));
                    }
                    self.marks.push(self.stack.len());
                }
                // POP
                b'0' => {
                    // POP with an empty frame above a mark pops the mark, as CPython does.
                    let floor = self.marks.last().copied().unwrap_or(0);
                    if self.stack.len() <= floor && !self.marks.is_empty() {
                        self.pop_mark()?;
                    } else {
                        self.pop()?;
                    }
                }
                // POP_MARK
                b'1' => {
                    self.pop_mark()?;
                }
                // DUP
                b'2' => {
                    let v = self.top()?.clone();
                    self.push(v)?;
                }
                b'N' => self.push(Value::None)?,
                0x88 => self.push(Value::Bool(true))?,
                0x89 => self.push(Value::Bool(false))?,
                // BININT, BININT1, BININT2
                b'J' => {
                    let v = i32::from_le_bytes(self.array()?);
                    self.push(Value::Int(v.into()))?
                }
                b'K' => {
                    let v = self.u8()?;
                    self.push(Value::Int(v.into()))?
                }
                b'M' => {
                    let v = u16::from_le_bytes(self.array()?);
                    self.push(Value::Int(v.into()))?
                }
                // LONG1, LONG4
                0x8a => {
                    let n = self.u8()?;
                    let v = self.long(n.into())?;
                    self.push(v)?
                }
                0x8b => {
                    let n = u32::from_le_bytes(self.array()?);
                    if n > 1024 {
                        return Err(self.malformed(format!("an integer of {n} bytes")));
                    }
                    let v = self.long(n as usize)?;
                    self.push(v)?
                }
                // BINFLOAT: big-endian.
                b'G' => {
                    let v = f64::from_be_bytes(self.array()?);
                    self.push(Value::Float(v))?
                }
                // BINUNICODE, SHORT_BINUNICODE, BINUNICODE8; BINSTRING, SHORT_BINSTRING (Python 2
                // strings, read as UTF-8 as `torch.load` does by default).
                b'X' | b'T' => {
                    let n = self.len_u32()?;
                    let v = self.string(n)?;
                    self.push(v)?
                }
                0x8c | b'U' => {
                    let n = self.u8()?;
                    let v = self.string(n.into())?;
                    self.push(v)?
                }
                0x8d => {
                    let n = self.len_u64()?;
                    let v = self.string(n)?;
                    self.push(v)?
                }
                // BINBYTES, SHORT_BINBYTES, BINBYTES8, BYTEARRAY8
                b'B' => {
                    let n = self.len_u32()?;
                    let v = self.bytes(n)?;
                    self.push(v)?
                }
                b'C' => {
                    let n = self.u8()?;
                    let v = self.bytes(n.into())?;
                    self.push(v)?
                }
                0x8e | 0x96 => {
                    let n = self.len_u64()?;
                    let v = self.bytes(n)?;
                    self.push(v)?
                }
                // EMPTY_TUPLE, TUPLE, TUPLE1..3
                b')' => {
                    let v = self.new_object(Object::Tuple(Vec::new()));
                    self.push(v)?
                }
                b't' => {
                    let items = self.pop_mark()?;
                    let v = self.new_object(Object::Tuple(items));
                    self.push(v)?
                }
                0x85..=0x87 => {
                    let n = usize::from(op - 0x84);
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    let v = self.new_object(Object::Tuple(items));
                    self.push(v)?
                }
                // EMPTY_LIST, LIST, APPEND, APPENDS; EMPTY_SET, FROZENSET, ADDITEMS (as lists)
                b']' | 0x8f => {
                    let v = self.new_object(Object::List(Vec::new()));
                    self.push(v)?
                }
                b'l' | 0x91 => {
                    let items = self.pop_mark()?;
                    let v = self.new_object(Object::List(items));
                    self.push(v)?
                }
                b'a' => {
                    let item = self.pop()?;
                    let at = self.top_index()?;
                    self.list_mut(at)?.push(item);
                }
                b'e' | 0x90 => {
                    let at = self.below_mark()?;
                    self.list_mut(at)?;
                    let items = self.pop_mark()?;
                    self.list_mut(at)?.extend(items);
                }
                // EMPTY_DICT, DICT, SETITEM, SETITEMS
                b'}' => {
                    let v = self.new_object(Object::Dict(Vec::new()));
                    self.push(v)?
                }
                b'd' => {
                    let items = self.pop_mark()?;
                    let pairs = pairs(items).ok_or_else(|| self.malformed("odd DICT items"))?;
                    let v = self.new_object(Object::Dict(pairs));
                    self.push(v)?
                }
                b's' => {
                    let value = self.pop()?;
                    let key = self.pop()?;
                    let at = self.top_index()?;
                    self.dict_mut(at)?.push((key, value));
                }
                b'u' => {
                    let at = self.below_mark()?;
                    self.dict_mut(at)?;
                    let items = self.pop_mark()?;
                    let pairs = pairs(items).ok_or_else(|| self.malformed("odd SETITEMS items"))?;
                    self.dict_mut(at)?.extend(pairs);
                }
                // BINPUT, LONG_BINPUT, MEMOIZE
                b'q' => {
                    let i = self.u8()?;
                    self.memo_put(i.into())?
                }
                b'r' => {
                    let i = u32::from_le_bytes(self.array()?);
                    self.memo_put(i.into())?
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i)?
                }
                // BINGET, LONG_BINGET
                b'h' => {
                    let i = self.u8()?;
                    self.memo_get(i.into())?
                }
                b'j' => {
                    let i = u32::from_le_bytes(self.array()?);
                    self.memo_get(i.into())?
                }
                // GLOBAL, STACK_GLOBAL
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let v = self.global(module, name)?;
                    self.push(v)?
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Value::Str(module), Value::Str(name)) = (module, name) else {
                        return Err(self.malformed("STACK_GLOBAL of non-strings"));
                    };
                    let v = self.global(&module, &name)?;
                    self.push(v)?
                }
                // REDUCE, NEWOBJ
                b'R' | 0x81 => {
                    let args = self.pop()?;
                    let callable = self.pop()?;
                    let v = self.call(callable, args)?;
                    self.push(v)?
                }
                // BUILD: sets an object's state. Only the `_metadata` of an `OrderedDict` state dict
                // and the (ignored) state of a tensor are accepted.
                b'b' => {
                    let _state = self.pop()?;
                    match self.object(self.top()?) {
                        Some(Object::Dict(_)) | Some(Object::Tensor(_)) => {}
                        _ => return Err(self.malformed("BUILD on a value that has no state")),
                    }
                }
                // BINPERSID
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent_load(pid)?;
                    self.push(v)?
                }
                opcode => return Err(self.err(PthErrorKind::UnknownOpcode { opcode })),
            }
        }
    }
}

fn pairs(items: Vec<Value>) -> Option<Vec<(Value, Value)>> {
    if items.len() % 2 != 0 {
        return None;
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Some(out)
}
