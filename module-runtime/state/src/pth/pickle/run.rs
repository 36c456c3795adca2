//! The machine's loop: one arm per opcode of protocols 2–5.

use super::{Fail, Object, Value, Vm, MAX_MARKS};
use crate::error::PthErrorKind;

impl Vm<'_> {
    pub(super) fn run(&mut self) -> Result<Value, Fail> {
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
    if !items.len().is_multiple_of(2) {
        return None;
    }
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    Some(out)
}
