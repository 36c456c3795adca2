//! The two containers `torch.save` writes around its pickle:
//!
//! - **zip** (PyTorch ≥ 1.6): `<archive>/data.pkl`, the pickle; `<archive>/data/<key>`, one
//!   uncompressed member per storage; `<archive>/byteorder` (`little` or `big`, absent in older
//!   files). The top folder's name is free (it is the file's stem when saved).
//! - **legacy** (before 1.6, or `_use_new_zipfile_serialization=False`): a pickle of the magic
//!   number `0x1950a86a20f9469cfc6c`, a pickle of the protocol version (1001), a pickle of system
//!   information (`little_endian`, type sizes), the main pickle, a pickle of the list of storage
//!   keys, then per key an 8-byte little-endian element count and the storage's raw bytes.
//!
//! Both give the main [`Pickle`] and where each storage's bytes lie in the file; nothing is copied.

use std::collections::HashMap;
use std::io::Cursor;
use std::ops::Range;

use zip::{CompressionMethod, ZipArchive};

use super::pickle::{self, Fail, Object, Pickle, StorageRef, Value};
use crate::error::PthErrorKind;

/// What a storage type holds: its candle dtype, if any, and its element size in bytes.
pub fn storage_info(storage_type: &str) -> (Option<candle_core::DType>, usize) {
    use candle_core::DType;
    match storage_type {
        "FloatStorage" => (Some(DType::F32), 4),
        "DoubleStorage" => (Some(DType::F64), 8),
        "HalfStorage" => (Some(DType::F16), 2),
        "BFloat16Storage" => (Some(DType::BF16), 2),
        "ByteStorage" => (Some(DType::U8), 1),
        "ShortStorage" => (Some(DType::I16), 2),
        "IntStorage" => (Some(DType::I32), 4),
        "LongStorage" => (Some(DType::I64), 8),
        "QInt32Storage" => (None, 4),
        "ComplexFloatStorage" => (None, 8),
        "ComplexDoubleStorage" => (None, 16),
        // CharStorage (int8), BoolStorage, the 1-byte quantized types, UntypedStorage.
        _ => (None, 1),
    }
}

/// A zip member: where its bytes lie, and how they are compressed.
struct Member {
    range: Range<usize>,
    method: CompressionMethod,
}

enum Storages {
    Zip {
        prefix: String,
        members: HashMap<String, Member>,
    },
    Legacy(HashMap<String, Range<usize>>),
}

/// A parsed checkpoint: the main pickle and where its storages lie.
pub struct Container {
    pub pickle: Pickle,
    storages: Storages,
}

const ZIP_MAGIC: &[u8] = b"PK\x03\x04";
/// `0x1950a86a20f9469cfc6c`, little-endian, as pickle's `LONG1` stores it.
const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

impl Container {
    /// Parses `bytes` as either container.
    pub fn parse(bytes: &[u8]) -> Result<Self, Fail> {
        if bytes.starts_with(ZIP_MAGIC) {
            Self::zip(bytes)
        } else if bytes.first() == Some(&0x80) {
            Self::legacy(bytes)
        } else if bytes.len() < 4 {
            Err(Fail::at(0, PthErrorKind::Truncated))
        } else {
            Err(Fail::malformed(
                "not a PyTorch checkpoint: neither a zip archive nor a pickle",
            ))
        }
    }

    fn zip(bytes: &[u8]) -> Result<Self, Fail> {
        let zip_error =
            |e: zip::result::ZipError| Fail::malformed(format!("not a valid zip archive: {e}"));
        let mut archive = ZipArchive::new(Cursor::new(bytes)).map_err(zip_error)?;
        if archive.has_duplicate_names() {
            return Err(Fail::new(PthErrorKind::DuplicateMember));
        }
        let mut members = HashMap::new();
        for i in 0..archive.len() {
            let file = archive.by_index_raw(i).map_err(zip_error)?;
            let name = std::str::from_utf8(file.name_raw())
                .map_err(|_| Fail::malformed("a zip member's name is not UTF-8"))?
                .to_owned();
            if file.encrypted() {
                return Err(Fail::malformed(format!("zip member `{name}` is encrypted")));
            }
            let start = file
                .data_start()
                .and_then(|s| usize::try_from(s).ok())
                .ok_or_else(|| Fail::malformed(format!("zip member `{name}` has no data")))?;
            let len = usize::try_from(file.compressed_size()).ok();
            let range = len
                .and_then(|len| start.checked_add(len))
                .filter(|&end| end <= bytes.len())
                .map(|end| start..end)
                .ok_or_else(|| Fail::at(start as u64, PthErrorKind::Truncated))?;
            if file.compression() == CompressionMethod::Stored && file.size() != range.len() as u64
            {
                return Err(Fail::malformed(format!(
                    "zip member `{name}` is stored but its sizes disagree"
                )));
            }
            members.insert(
                name,
                Member {
                    range,
                    method: file.compression(),
                },
            );
        }

        let mut pickles = members.keys().filter_map(|name| {
            let prefix = name.strip_suffix("/data.pkl")?;
            (!prefix.is_empty() && !prefix.contains('/')).then(|| prefix.to_owned())
        });
        let prefix = pickles.next().ok_or_else(|| {
            Fail::new(PthErrorKind::MissingMember {
                member: "<archive>/data.pkl".into(),
            })
        })?;
        if pickles.next().is_some() {
            return Err(Fail::new(PthErrorKind::DuplicateMember));
        }

        let stored = |name: &str| -> Result<Option<Range<usize>>, Fail> {
            match members.get(name) {
                None => Ok(None),
                Some(m) if m.method == CompressionMethod::Stored => Ok(Some(m.range.clone())),
                Some(m) => Err(Fail::new(PthErrorKind::Compressed {
                    member: name.to_owned(),
                    method: m.method.to_string(),
                })),
            }
        };
        if let Some(range) = stored(&format!("{prefix}/byteorder"))? {
            match &bytes[range.clone()] {
                b"little" => {}
                b"big" => {
                    return Err(Fail::at(
                        range.start as u64,
                        PthErrorKind::ByteOrder {
                            found: "big".into(),
                        },
                    ))
                }
                other => {
                    return Err(Fail::at(
                        range.start as u64,
                        PthErrorKind::ByteOrder {
                            found: String::from_utf8_lossy(&other[..other.len().min(16)])
                                .into_owned(),
                        },
                    ))
                }
            }
        }
        let range = stored(&format!("{prefix}/data.pkl"))?.expect("found above");
        let pickle = pickle::read(&bytes[range.clone()], 0, range.start as u64)?;
        Ok(Self {
            pickle,
            storages: Storages::Zip { prefix, members },
        })
    }

    fn legacy(bytes: &[u8]) -> Result<Self, Fail> {
        let magic = pickle::read(bytes, 0, 0)?;
        match &magic.root {
            Value::BigInt(b) if **b == LEGACY_MAGIC => {}
            _ => {
                return Err(Fail::malformed(
                    "a pickle without PyTorch's magic number: not a checkpoint \
                     (a plain pickle file, or a file that is not a `torch.save` output)",
                ))
            }
        }
        let version = pickle::read(bytes, magic.end, 0)?;
        match version.root {
            Value::Int(1001) => {}
            _ => {
                return Err(Fail::at(
                    magic.end as u64,
                    PthErrorKind::Malformed {
                        reason: format!(
                            "legacy protocol version {} (only 1001 is known)",
                            version.describe(&version.root)
                        ),
                    },
                ))
            }
        }
        let info = pickle::read(bytes, version.end, 0)?;
        if let Some(Object::Dict(items)) = info.object(&info.root) {
            for (k, v) in items {
                if matches!(k, Value::Str(k) if &**k == "little_endian")
                    && matches!(v, Value::Bool(false))
                {
                    return Err(Fail::at(
                        version.end as u64,
                        PthErrorKind::ByteOrder {
                            found: "big".into(),
                        },
                    ));
                }
            }
        } else {
            return Err(Fail::at(
                version.end as u64,
                PthErrorKind::Malformed {
                    reason: "the legacy system information is not a dict".into(),
                },
            ));
        }
        let main = pickle::read(bytes, info.end, 0)?;
        let keys_pickle = pickle::read(bytes, main.end, 0)?;
        let key_list = match keys_pickle.object(&keys_pickle.root) {
            Some(Object::List(items)) | Some(Object::Tuple(items)) => items,
            _ => {
                return Err(Fail::at(
                    main.end as u64,
                    PthErrorKind::Malformed {
                        reason: "the legacy storage key list is not a list".into(),
                    },
                ))
            }
        };

        // The declared type and element count of each root storage.
        let mut declared: HashMap<&str, &StorageRef> = HashMap::new();
        for object in &main.objects {
            if let Object::Storage(s) = object {
                declared.entry(&s.key).or_insert(s);
            }
        }
        let mut ranges = HashMap::new();
        let mut pos = keys_pickle.end;
        for key in key_list {
            let key: &str = match key {
                Value::Str(s) => s,
                _ => return Err(Fail::malformed("a legacy storage key is not a string")),
            };
            let storage = declared.get(key).ok_or_else(|| {
                Fail::malformed(format!("legacy storage `{key}` is not used by the pickle"))
            })?;
            let (_, elem) = storage_info(storage.storage_type);
            let count = bytes
                .get(pos..pos.saturating_add(8))
                .ok_or_else(|| Fail::at(pos as u64, PthErrorKind::Truncated))?;
            let count = u64::from_le_bytes(count.try_into().expect("8 bytes"));
            if i64::try_from(count).ok() != Some(storage.numel) {
                return Err(Fail::at(
                    pos as u64,
                    PthErrorKind::Malformed {
                        reason: format!(
                            "legacy storage `{key}` holds {count} elements, but the pickle \
                             declares {}",
                            storage.numel
                        ),
                    },
                ));
            }
            let start = pos + 8;
            let end = usize::try_from(count)
                .ok()
                .and_then(|c| c.checked_mul(elem))
                .and_then(|n| start.checked_add(n))
                .filter(|&end| end <= bytes.len())
                .ok_or_else(|| Fail::at(start as u64, PthErrorKind::Truncated))?;
            if ranges.insert(key.to_owned(), start..end).is_some() {
                return Err(Fail::malformed(format!(
                    "legacy storage `{key}` is listed twice"
                )));
            }
            pos = end;
        }
        Ok(Self {
            pickle: main,
            storages: Storages::Legacy(ranges),
        })
    }

    /// The bytes of `storage` in the file (a legacy view's slice of its root), bounds-checked.
    pub fn storage_range(&self, storage: &StorageRef) -> Result<Range<usize>, Fail> {
        let root = match &self.storages {
            Storages::Zip { prefix, members } => {
                let name = format!("{prefix}/data/{}", storage.key);
                match members.get(&name) {
                    None => return Err(Fail::new(PthErrorKind::MissingMember { member: name })),
                    Some(m) if m.method != CompressionMethod::Stored => {
                        return Err(Fail::new(PthErrorKind::Compressed {
                            member: name,
                            method: m.method.to_string(),
                        }))
                    }
                    Some(m) => m.range.clone(),
                }
            }
            Storages::Legacy(ranges) => ranges.get(&*storage.key).cloned().ok_or_else(|| {
                Fail::new(PthErrorKind::MissingMember {
                    member: format!("storage {}", storage.key),
                })
            })?,
        };
        let Some((offset, size)) = storage.view else {
            return Ok(root);
        };
        let (_, elem) = storage_info(storage.storage_type);
        let bytes = |n: i64| usize::try_from(n).ok().and_then(|n| n.checked_mul(elem));
        match (bytes(offset), bytes(size)) {
            (Some(offset), Some(size))
                if offset
                    .checked_add(size)
                    .is_some_and(|end| end <= root.len()) =>
            {
                Ok(root.start + offset..root.start + offset + size)
            }
            _ => Err(Fail::malformed(format!(
                "a view of storage `{}` (offset {offset}, size {size}) reaches past its end",
                storage.key
            ))),
        }
    }
}
