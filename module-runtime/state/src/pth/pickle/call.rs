//! What the machine calls: allowed globals, `REDUCE`/`NEWOBJ` on them (tensors, parameters,
//! ordered dicts, sets, `torch.Size`, `_codecs.encode`), and torch's storage references
//! (`BINPERSID`).

use std::rc::Rc;

use super::{Fail, Global, Object, StorageRef, TensorRef, Value, Vm};
use crate::error::PthErrorKind;

impl Vm<'_> {
    pub(super) fn global(&mut self, module: &str, name: &str) -> Result<Value, Fail> {
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
    pub(super) fn call(&mut self, callable: Value, args: Value) -> Result<Value, Fail> {
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

    pub(super) fn object(&self, value: &Value) -> Option<&Object> {
        match value {
            Value::Obj(i) => self.objects.get(*i),
            _ => None,
        }
    }

    /// `BINPERSID`: torch's storage references.
    pub(super) fn persistent_load(&mut self, pid: Value) -> Result<Value, Fail> {
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
}
