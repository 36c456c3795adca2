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

mod call;
mod run;
mod value;

pub use value::{Global, Object, Pickle, StorageRef, TensorRef, Value};

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
    /// The offset in the file of the opcode being run.
    fn offset(&self) -> u64 {
        self.base.saturating_add(self.op_pos as u64)
    }

    fn err(&self, kind: PthErrorKind) -> Fail {
        Fail::at(self.offset(), kind)
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

    /// The arena object the stack value at `at` refers to, mutably.
    fn object_mut(&mut self, at: usize) -> Option<&mut Object> {
        match self.stack.get(at) {
            Some(Value::Obj(i)) => self.objects.get_mut(*i),
            _ => None,
        }
    }

    /// [`PthErrorKind::Malformed`] at `offset`, for where the machine is borrowed.
    fn malformed_at(offset: u64, reason: &str) -> Fail {
        let reason = reason.into();
        Fail::at(offset, PthErrorKind::Malformed { reason })
    }

    fn list_mut(&mut self, at: usize) -> Result<&mut Vec<Value>, Fail> {
        let offset = self.offset();
        match self.object_mut(at) {
            Some(Object::List(items)) => Ok(items),
            _ => Err(Self::malformed_at(
                offset,
                "APPEND(S) or ADDITEMS on a value that is not a list",
            )),
        }
    }

    fn dict_mut(&mut self, at: usize) -> Result<&mut Vec<(Value, Value)>, Fail> {
        let offset = self.offset();
        match self.object_mut(at) {
            Some(Object::Dict(items)) => Ok(items),
            _ => Err(Self::malformed_at(
                offset,
                "SETITEM(S) on a value that is not a dict",
            )),
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
}
