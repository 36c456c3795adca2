//! The bounded GGUF reader: the header (metadata, tensor table) parsed and checked before any
//! tensor is read, and the tensors read from the checked layout.
//!
//! This replaces candle's `gguf_file::Content::read` for every file the runtime opens. Candle
//! 0.11.1's reader bounds its counts and string lengths, but it divides by `general.alignment`
//! unchecked (a file whose alignment is 0 panics inside candle), keeps the last of two tensors
//! (or metadata entries) of one name, accepts tensors whose data overlap, are misaligned, or leave
//! bytes no tensor accounts for (a quantized tensor relabelled as another type), lets one array of
//! one-byte values become 32-byte values in memory without a limit, and slices a tensor's bytes as
//! blocks without checking the buffer's alignment. Here each of these is a
//! [`GgufErrorKind`], raised before any allocation larger than the file.

use std::collections::{HashMap, HashSet};
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::{GgmlDType, QStorage, QTensor};
use candle_core::Device;

use super::GgufValue;
use crate::error::{Error, Result};
use module_core::{GgufErrorKind, QuantizeError};

/// GGML's most dimensions a tensor has.
const MAX_DIMS: u64 = 4;
/// How deep arrays may nest (GGUF files nest none in practice).
const MAX_DEPTH: usize = 8;
/// Memory the header (metadata and tensor table) may take beyond [`MEMORY_PER_BYTE`] times the
/// file's length: each value is a 32-byte `GgufValue` in memory, so an array of one-byte values
/// is 32 times its size.
const MEMORY_FLOOR: u64 = 64 << 20;
/// Bytes of header memory allowed per byte of file.
const MEMORY_PER_BYTE: u64 = 8;
/// Alignment when the file has no `general.alignment` (the GGUF specification's).
const DEFAULT_ALIGNMENT: u64 = 32;

/// A file's metadata by key.
pub(super) type Metadata = HashMap<String, GgufValue>;

/// One entry of the tensor table, checked.
pub(super) struct TensorInfo {
    pub name: String,
    pub kind: GgmlDType,
    /// Candle's order: outermost first.
    pub dims: Vec<usize>,
    /// In the data section.
    pub offset: u64,
    pub bytes: u64,
}

/// A parsed and checked header.
pub(super) struct Header {
    pub metadata: Metadata,
    /// In the file's order (which is the data's order).
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts in the file.
    pub data_offset: u64,
}

/// The header's reader: a position, the file's length, the header's memory budget.
struct Input<'a, R> {
    reader: R,
    pos: u64,
    len: u64,
    budget: u64,
    /// Version 1 writes lengths, counts and dimensions as `u32`.
    narrow: bool,
    path: &'a Path,
}

impl<R: Read> Input<'_, R> {
    fn error(&self, kind: GgufErrorKind) -> Error {
        error(self.path, Some(self.pos), kind)
    }

    fn left(&self) -> u64 {
        self.len.saturating_sub(self.pos)
    }

    fn fill(&mut self, buf: &mut [u8], what: &dyn Fn() -> String) -> Result<()> {
        if (buf.len() as u64) > self.left() {
            return Err(self.error(GgufErrorKind::Truncated { what: what() }));
        }
        self.reader.read_exact(buf).map_err(|source| Error::Io {
            path: self.path.to_owned(),
            source,
        })?;
        self.pos += buf.len() as u64;
        Ok(())
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N]> {
        let mut b = [0; N];
        self.fill(&mut b, what)?;
        Ok(b)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length or count: `u32` in version 1, `u64` after.
    fn length(&mut self, what: &dyn Fn() -> String) -> Result<u64> {
        if self.narrow {
            Ok(self.u32(what)? as u64)
        } else {
            self.u64(what)
        }
    }

    /// A count of items of at least `min_size` bytes each, checked against the rest of the file.
    fn count(&mut self, min_size: u64, what: &dyn Fn() -> String) -> Result<u64> {
        let n = self.length(what)?;
        let limit = self.left() / min_size;
        if n > limit {
            return Err(self.error(GgufErrorKind::TooLarge {
                what: what(),
                declared: n,
                limit,
            }));
        }
        Ok(n)
    }

    /// Takes `bytes` of memory from the metadata's budget.
    fn charge(&mut self, bytes: u64, what: &dyn Fn() -> String) -> Result<()> {
        match self.budget.checked_sub(bytes) {
            Some(left) => {
                self.budget = left;
                Ok(())
            }
            None => Err(self.error(GgufErrorKind::TooLarge {
                what: format!("the memory {} takes", what()),
                declared: bytes,
                limit: self.budget,
            })),
        }
    }

    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String> {
        let n = self.count(1, &|| format!("the length of {}", what()))?;
        self.charge(n, what)?;
        let mut bytes = vec![0; n as usize];
        self.fill(&mut bytes, what)?;
        // Writers are known to add a terminating NUL, and not always valid UTF-8 (as candle).
        while bytes.last() == Some(&0) {
            bytes.pop();
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// The smallest size of a value of `ty` in the file.
    fn min_size(&self, ty: u32) -> u64 {
        let length = if self.narrow { 4 } else { 8 };
        match ty {
            0 | 1 | 7 => 1,
            2 | 3 => 2,
            4..=6 => 4,
            8 => length,
            9 => 4 + length,
            _ => 8,
        }
    }

    fn value(&mut self, ty: u32, depth: usize, what: &dyn Fn() -> String) -> Result<GgufValue> {
        self.charge(std::mem::size_of::<GgufValue>() as u64, what)?;
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>(what)?[0]),
            1 => GgufValue::I8(self.array::<1>(what)?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => GgufValue::U32(self.u32(what)?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => {
                    return Err(self.error(GgufErrorKind::Malformed {
                        reason: format!("{} is a boolean of value {b}, not 0 or 1", what()),
                    }));
                }
            },
            8 => GgufValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_DEPTH {
                    return Err(self.error(GgufErrorKind::Malformed {
                        reason: format!("{} nests arrays deeper than {MAX_DEPTH}", what()),
                    }));
                }
                let item = self.u32(what)?;
                self.check_type(item, what)?;
                let n = self.count(self.min_size(item), &|| format!("the length of {}", what()))?;
                let mut items = Vec::new();
                for _ in 0..n {
                    items.push(self.value(item, depth + 1, what)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64(what)?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array(what)?)),
            _ => unreachable!("types are checked before their values are read"),
        })
    }

    fn check_type(&self, ty: u32, what: &dyn Fn() -> String) -> Result<()> {
        if ty > 12 {
            return Err(self.error(GgufErrorKind::Malformed {
                reason: format!("{} has value type {ty}, which GGUF does not define", what()),
            }));
        }
        Ok(())
    }
}

/// A [`QuantizeError::GgufFile`] about `path`.
pub(super) fn error(path: &Path, offset: Option<u64>, kind: GgufErrorKind) -> Error {
    QuantizeError::GgufFile {
        file: path.to_owned(),
        offset,
        kind: Box::new(kind),
    }
    .into()
}

/// GGML's type numbers (candle's `GgmlDType::from_u32` is not public).
fn ggml_kind(n: u32) -> Option<GgmlDType> {
    use GgmlDType::*;
    Some(match n {
        0 => F32,
        1 => F16,
        2 => Q4_0,
        3 => Q4_1,
        6 => Q5_0,
        7 => Q5_1,
        8 => Q8_0,
        9 => Q8_1,
        10 => Q2K,
        11 => Q3K,
        12 => Q4K,
        13 => Q5K,
        14 => Q6K,
        15 => Q8K,
        30 => BF16,
        _ => return None,
    })
}

/// Reads and checks the header of the file at `path` (`len` bytes): metadata, tensor table,
/// alignment, and the tensors' data laid out back to back, each on the alignment, with nothing
/// between or after them but padding.
pub(super) fn read_header(reader: impl Read, len: u64, path: &Path) -> Result<Header> {
    let mut input = Input {
        reader,
        pos: 0,
        len,
        budget: MEMORY_FLOOR.saturating_add(len.saturating_mul(MEMORY_PER_BYTE)),
        narrow: false,
        path,
    };
    let magic = input.array::<4>(&|| "the magic".into())?;
    if &magic != b"GGUF" {
        return Err(input.error(GgufErrorKind::Malformed {
            reason: format!("the file starts with {magic:02x?}, not `GGUF`"),
        }));
    }
    let version = input.u32(&|| "the version".into())?;
    match version {
        1 => input.narrow = true,
        2 | 3 => {}
        v => {
            return Err(input.error(GgufErrorKind::Malformed {
                reason: format!("GGUF version {v} (1, 2 and 3 are read)"),
            }));
        }
    }
    let length = if input.narrow { 4 } else { 8 };
    // A tensor's table entry is at least a name's length, one dimension, a type and an offset.
    let tensor_count = input.count(length + 4 + 4 + 8, &|| "the tensor count".into())?;
    // A metadata entry is at least a key's length, a type and a one-byte value.
    let kv_count = input.count(length + 4 + 1, &|| "the metadata count".into())?;

    let mut metadata = HashMap::new();
    for i in 0..kv_count {
        let key = input.string(&|| format!("metadata key {i}"))?;
        let what = || format!("the metadata value of `{key}`");
        let ty = input.u32(&what)?;
        input.check_type(ty, &what)?;
        let value = input.value(ty, 0, &what)?;
        if metadata.contains_key(&key) {
            return Err(input.error(GgufErrorKind::DuplicateKey { key }));
        }
        metadata.insert(key, value);
    }

    let mut tensors: Vec<TensorInfo> = Vec::new();
    let mut names = HashSet::new();
    for i in 0..tensor_count {
        let name = input.string(&|| format!("the name of tensor {i}"))?;
        let what = || format!("the table entry of tensor `{name}`");
        let n_dims = input.u32(&what)? as u64;
        if n_dims > MAX_DIMS {
            return Err(input.error(GgufErrorKind::TooLarge {
                what: format!("the dimension count of tensor `{name}`"),
                declared: n_dims,
                limit: MAX_DIMS,
            }));
        }
        // The entry, its name kept twice (the table and the set of names) and its dimensions.
        let entry = std::mem::size_of::<TensorInfo>() as u64 + 2 * name.len() as u64 + 16 * n_dims;
        input.charge(entry, &what)?;
        let mut shape = Vec::new();
        for _ in 0..n_dims {
            shape.push(input.length(&what)?);
        }
        let ty = input.u32(&what)?;
        let offset = input.u64(&what)?;
        let Some(kind) = ggml_kind(ty) else {
            return Err(input.error(GgufErrorKind::Malformed {
                reason: format!("tensor `{name}` has type {ty}, which the reader does not know"),
            }));
        };
        if !names.insert(name.clone()) {
            return Err(input.error(GgufErrorKind::DuplicateTensor { name }));
        }
        let bytes = tensor_bytes(kind, &shape).map_err(|reason| {
            input.error(GgufErrorKind::TensorShape {
                name: name.clone(),
                kind,
                shape: shape.clone(),
                reason,
            })
        })?;
        let dims = shape.iter().rev().map(|&d| d as usize).collect();
        tensors.push(TensorInfo {
            name,
            kind,
            dims,
            offset,
            bytes,
        });
    }

    let alignment = alignment(&metadata)
        .map_err(|found| error(path, None, GgufErrorKind::Alignment { found }))?;
    let data_offset = input.pos.next_multiple_of(alignment);
    check_layout(&tensors, alignment, len.saturating_sub(data_offset), path)?;
    Ok(Header {
        metadata,
        tensors,
        data_offset,
    })
}

/// The bytes a tensor of `kind` and `shape` (innermost first) takes, or why it has none.
fn tensor_bytes(kind: GgmlDType, shape: &[u64]) -> std::result::Result<u64, String> {
    let Some(&rows) = shape.first() else {
        return Err("has no dimensions".into());
    };
    let block = kind.block_size() as u64;
    if rows % block != 0 {
        return Err(format!(
            "has rows of {rows} values, not a multiple of its blocks of {block}"
        ));
    }
    shape
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d))
        .and_then(|n| (n / block).checked_mul(kind.type_size() as u64))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| "has more elements than memory can address".into())
}

/// A metadata value of any integer type as a `u64` (`None` for a negative or non-integer one).
pub(super) fn as_u64(v: &GgufValue) -> Option<u64> {
    match v {
        GgufValue::U8(n) => Some(*n as u64),
        GgufValue::U16(n) => Some(*n as u64),
        GgufValue::U32(n) => Some(*n as u64),
        GgufValue::U64(n) => Some(*n),
        GgufValue::I8(n) => u64::try_from(*n).ok(),
        GgufValue::I16(n) => u64::try_from(*n).ok(),
        GgufValue::I32(n) => u64::try_from(*n).ok(),
        GgufValue::I64(n) => u64::try_from(*n).ok(),
        _ => None,
    }
}

/// `general.alignment`: a power of two (32 when absent).
fn alignment(metadata: &Metadata) -> std::result::Result<u64, String> {
    let Some(v) = metadata.get("general.alignment") else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let n = as_u64(v);
    // Capped so that rounding a position up to it cannot overflow.
    n.filter(|n| n.is_power_of_two() && *n <= 1 << 32)
        .ok_or_else(|| format!("{v:?}"))
}

/// The tensors' data back to back in table order, each at the alignment after the one before
/// (as llama.cpp's reader demands), inside the `available` bytes of data, with no more than
/// padding after the last one.
fn check_layout(tensors: &[TensorInfo], alignment: u64, available: u64, path: &Path) -> Result<()> {
    let fail = |kind| Err(error(path, None, kind));
    let mut expected = 0u64;
    let mut previous: Option<(&str, u64)> = None;
    for t in tensors {
        if t.offset % alignment != 0 {
            return fail(GgufErrorKind::Misaligned {
                name: t.name.clone(),
                offset: t.offset,
                alignment,
            });
        }
        if let Some((prev, prev_end)) = previous {
            if t.offset < expected {
                return fail(GgufErrorKind::Overlap {
                    name: t.name.clone(),
                    offset: t.offset,
                    previous: prev.into(),
                    previous_end: prev_end,
                });
            }
            if t.offset > expected {
                return fail(GgufErrorKind::Unaccounted {
                    previous: prev.into(),
                    previous_end: prev_end,
                    unaccounted: t.offset - expected,
                });
            }
        } else if t.offset != 0 {
            return fail(GgufErrorKind::Malformed {
                reason: format!(
                    "the first tensor `{}` starts at data offset {}, not 0",
                    t.name, t.offset
                ),
            });
        }
        let end = t.offset.saturating_add(t.bytes);
        if end > available {
            return fail(GgufErrorKind::PastEnd {
                name: t.name.clone(),
                offset: t.offset,
                bytes: t.bytes,
                available,
            });
        }
        previous = Some((&t.name, end));
        expected = end.next_multiple_of(alignment);
    }
    let padded = expected;
    if available > padded {
        return match previous {
            Some((prev, prev_end)) => fail(GgufErrorKind::Unaccounted {
                previous: prev.into(),
                previous_end: prev_end,
                unaccounted: available - padded,
            }),
            None => Ok(()),
        };
    }
    Ok(())
}

/// Reads the file at `path`: its checked header, then each tensor's bytes (in file order, one
/// read each, into a buffer aligned for any block type) onto `device`.
pub(super) fn read_file(
    path: &Path,
    device: &Device,
) -> Result<(Metadata, Vec<(String, QTensor)>)> {
    let io = |source| Error::Io {
        path: PathBuf::from(path),
        source,
    };
    let mut file = std::fs::File::open(path).map_err(io)?;
    let len = file.metadata().map_err(io)?.len();
    let header = read_header(BufReader::new(&mut file), len, path)?;
    let mut tensors = Vec::with_capacity(header.tensors.len());
    for t in header.tensors {
        // Bounded by the layout check: the data is inside the file.
        let n = t.bytes as usize;
        let mut words = vec![0u64; n.div_ceil(8)];
        let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..n];
        file.seek(SeekFrom::Start(header.data_offset + t.offset))
            .map_err(io)?;
        file.read_exact(bytes).map_err(io)?;
        let storage = QStorage::from_data(std::borrow::Cow::Borrowed(bytes), device, t.kind)?;
        let tensor = QTensor::new(storage, t.dims.as_slice()).map_err(|e| {
            error(
                path,
                None,
                GgufErrorKind::Malformed {
                    reason: format!("tensor `{}`: {e}", t.name),
                },
            )
        })?;
        tensors.push((t.name, tensor));
    }
    Ok((header.metadata, tensors))
}
