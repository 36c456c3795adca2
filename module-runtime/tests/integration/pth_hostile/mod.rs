//! Hostile `.pth` files, generated here (no binary blobs): truncations, memo and nesting bombs,
//! tensors that do not fit their storage, unknown opcodes, compressed or duplicate zip members,
//! forbidden globals, a wrong byte order, and a seeded random mutation loop. Every one must be an
//! `Err` (of the expected kind where it is specific), never a panic, and a model that tries to
//! load it must stay bit-identical.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

use module_runtime::candle_core::{DType, Device};
use module_runtime::nn::Linear;
use module_runtime::{Error, LoadOptions, ModuleExt, PthErrorKind, StateDict};

mod files;
mod pickle;
mod values;

// ---------------------------------------------------------------------------------------------
// A tiny pickle writer, enough to write what `torch.save` writes.

const PROTO: u8 = 0x80;
const MARK: u8 = b'(';
const STOP: u8 = b'.';
const TUPLE: u8 = b't';
const EMPTY_TUPLE: u8 = b')';
const EMPTY_DICT: u8 = b'}';
const EMPTY_LIST: u8 = b']';
const SETITEMS: u8 = b'u';
const APPENDS: u8 = b'e';
const REDUCE: u8 = b'R';
const BINPERSID: u8 = b'Q';
const NEWFALSE: u8 = 0x89;
const NEWTRUE: u8 = 0x88;
const NONE: u8 = b'N';
const TUPLE1: u8 = 0x85;
const LONG_BINPUT: u8 = b'r';
const BINGET: u8 = b'h';
const STACK_GLOBAL: u8 = 0x93;

#[derive(Default, Clone)]
struct P(Vec<u8>);

impl P {
    fn op(mut self, op: u8) -> Self {
        self.0.push(op);
        self
    }
    fn raw(mut self, bytes: &[u8]) -> Self {
        self.0.extend_from_slice(bytes);
        self
    }
    fn proto(self) -> Self {
        self.op(PROTO).op(2)
    }
    fn global(self, module: &str, name: &str) -> Self {
        self.op(b'c').raw(format!("{module}\n{name}\n").as_bytes())
    }
    fn str(self, s: &str) -> Self {
        self.op(b'X')
            .raw(&(s.len() as u32).to_le_bytes())
            .raw(s.as_bytes())
    }
    /// Any `i64`, as an 8-byte `LONG1`.
    fn int(self, i: i64) -> Self {
        self.op(0x8a).op(8).raw(&i.to_le_bytes())
    }
    fn ints(self, values: &[i64]) -> Self {
        values
            .iter()
            .fold(self.op(MARK), |p, &v| p.int(v))
            .op(TUPLE)
    }
}

/// One state dict entry: a tensor as `torch.save` writes it, or raw pickle bytes for the value.
#[derive(Clone)]
enum Val {
    Tensor {
        storage_type: &'static str,
        key: String,
        numel: i64,
        offset: i64,
        size: Vec<i64>,
        stride: Vec<i64>,
    },
    Raw(Vec<u8>),
}

fn tensor(key: &str, numel: i64, size: &[i64], stride: &[i64]) -> Val {
    Val::Tensor {
        storage_type: "FloatStorage",
        key: key.into(),
        numel,
        offset: 0,
        size: size.into(),
        stride: stride.into(),
    }
}

/// The main pickle: an `OrderedDict` of `entries`, as `torch.save(model.state_dict())` writes it.
fn state_dict_pickle(entries: &[(&str, Val)], legacy: bool) -> Vec<u8> {
    P::default()
        .proto()
        .raw(&state_dict_body(entries, legacy))
        .op(STOP)
        .0
}

/// The pickle ops that push the state dict (no `PROTO`, no `STOP`).
fn state_dict_body(entries: &[(&str, Val)], legacy: bool) -> Vec<u8> {
    let mut p = P::default()
        .global("collections", "OrderedDict")
        .op(EMPTY_TUPLE)
        .op(REDUCE)
        .op(MARK);
    for (name, value) in entries {
        p = p.str(name);
        match value {
            Val::Raw(bytes) => p = p.raw(bytes),
            Val::Tensor {
                storage_type,
                key,
                numel,
                offset,
                size,
                stride,
            } => {
                p = p
                    .global("torch._utils", "_rebuild_tensor_v2")
                    .op(MARK)
                    .op(MARK)
                    .str("storage")
                    .global("torch", storage_type)
                    .str(key)
                    .str("cpu")
                    .int(*numel);
                if legacy {
                    p = p.op(NONE);
                }
                p = p
                    .op(TUPLE)
                    .op(BINPERSID)
                    .int(*offset)
                    .ints(size)
                    .ints(stride)
                    .op(NEWFALSE)
                    .global("collections", "OrderedDict")
                    .op(EMPTY_TUPLE)
                    .op(REDUCE)
                    .op(TUPLE)
                    .op(REDUCE);
            }
        }
    }
    p.op(SETITEMS).0
}

/// The model the files are made for, and its state dict as file entries plus storages.
fn model() -> Linear {
    Linear::new(3, 2, &Device::Cpu).unwrap()
}

fn f32_bytes(t: &module_runtime::candle_core::Tensor) -> Vec<u8> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// Storage keys and their bytes.
type Storages = Vec<(String, Vec<u8>)>;

/// `weight` [2, 3] in storage `0`, `bias` [2] in storage `1`, from a fresh model's values.
fn linear_entries() -> (Vec<(&'static str, Val)>, Storages) {
    let source = model();
    let sd = source.state_dict().unwrap();
    let entries = vec![
        ("weight", tensor("0", 6, &[2, 3], &[3, 1])),
        ("bias", tensor("1", 2, &[2], &[1])),
    ];
    let storages = vec![
        ("0".to_owned(), f32_bytes(sd.get("weight").unwrap())),
        ("1".to_owned(), f32_bytes(sd.get("bias").unwrap())),
    ];
    (entries, storages)
}

// ---------------------------------------------------------------------------------------------
// A tiny zip writer (stored members; the method field can lie, names can repeat).

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= u32::from(b);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0xedb8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

struct ZipMember {
    name: String,
    data: Vec<u8>,
    method: u16,
}

fn member(name: &str, data: Vec<u8>) -> ZipMember {
    ZipMember {
        name: name.into(),
        data,
        method: 0,
    }
}

fn write_zip(members: &[ZipMember]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut central = Vec::new();
    for m in members {
        let offset = out.len() as u32;
        let crc = crc32(&m.data);
        let len = m.data.len() as u32;
        let header = |sig: u32, central: bool| {
            let mut h = Vec::new();
            h.extend_from_slice(&sig.to_le_bytes());
            if central {
                h.extend_from_slice(&20u16.to_le_bytes());
            }
            h.extend_from_slice(&20u16.to_le_bytes()); // version needed
            h.extend_from_slice(&0u16.to_le_bytes()); // flags
            h.extend_from_slice(&m.method.to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // time
            h.extend_from_slice(&0x21u16.to_le_bytes()); // date: 1980-01-01
            h.extend_from_slice(&crc.to_le_bytes());
            h.extend_from_slice(&len.to_le_bytes());
            h.extend_from_slice(&len.to_le_bytes());
            h.extend_from_slice(&(m.name.len() as u16).to_le_bytes());
            h.extend_from_slice(&0u16.to_le_bytes()); // extra
            if central {
                h.extend_from_slice(&[0; 6]); // comment, disk, internal attributes
                h.extend_from_slice(&0u32.to_le_bytes()); // external attributes
                h.extend_from_slice(&offset.to_le_bytes());
            }
            h.extend_from_slice(m.name.as_bytes());
            h
        };
        out.extend(header(0x0403_4b50, false));
        out.extend_from_slice(&m.data);
        central.extend(header(0x0201_4b50, true));
    }
    let cd_offset = out.len() as u32;
    out.extend_from_slice(&central);
    out.extend_from_slice(&0x0605_4b50u32.to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(members.len() as u16).to_le_bytes());
    out.extend_from_slice(&(central.len() as u32).to_le_bytes());
    out.extend_from_slice(&cd_offset.to_le_bytes());
    out.extend_from_slice(&0u16.to_le_bytes());
    out
}

/// The members `torch.save` writes, for a given main pickle and storages.
fn zip_members(pickle: Vec<u8>, storages: &[(String, Vec<u8>)]) -> Vec<ZipMember> {
    let mut members = vec![
        member("archive/data.pkl", pickle),
        member("archive/byteorder", b"little".to_vec()),
    ];
    for (key, data) in storages {
        members.push(member(&format!("archive/data/{key}"), data.clone()));
    }
    members.push(member("archive/version", b"3\n".to_vec()));
    members
}

fn zip_file(entries: &[(&str, Val)], storages: &[(String, Vec<u8>)]) -> Vec<u8> {
    write_zip(&zip_members(state_dict_pickle(entries, false), storages))
}

// ---------------------------------------------------------------------------------------------
// The legacy format.

const LEGACY_MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];

fn legacy_header(little_endian: bool) -> Vec<u8> {
    let mut out = P::default()
        .proto()
        .op(0x8a)
        .op(10)
        .raw(&LEGACY_MAGIC)
        .op(STOP)
        .0;
    out.extend(
        P::default()
            .proto()
            .op(b'M')
            .raw(&1001u16.to_le_bytes())
            .op(STOP)
            .0,
    );
    let info = P::default()
        .proto()
        .op(EMPTY_DICT)
        .op(MARK)
        .str("protocol_version")
        .op(b'M')
        .raw(&1001u16.to_le_bytes())
        .str("little_endian")
        .op(if little_endian { NEWTRUE } else { NEWFALSE })
        .str("type_sizes")
        .op(EMPTY_DICT)
        .op(MARK)
        .str("short")
        .int(2)
        .str("int")
        .int(4)
        .str("long")
        .int(4)
        .op(SETITEMS)
        .op(SETITEMS)
        .op(STOP);
    out.extend(info.0);
    out
}

fn legacy_file_with(
    entries: &[(&str, Val)],
    storages: &[(String, Vec<u8>)],
    little_endian: bool,
) -> Vec<u8> {
    let mut out = legacy_header(little_endian);
    out.extend(state_dict_pickle(entries, true));
    let keys = storages
        .iter()
        .fold(P::default().proto().op(EMPTY_LIST).op(MARK), |p, (k, _)| {
            p.str(k)
        })
        .op(APPENDS)
        .op(STOP);
    out.extend(keys.0);
    for (_, data) in storages {
        out.extend_from_slice(&((data.len() / 4) as u64).to_le_bytes());
        out.extend_from_slice(data);
    }
    out
}

fn legacy_file(entries: &[(&str, Val)], storages: &[(String, Vec<u8>)]) -> Vec<u8> {
    legacy_file_with(entries, storages, true)
}

fn good_zip() -> Vec<u8> {
    let (entries, storages) = linear_entries();
    zip_file(&entries, &storages)
}

fn good_legacy() -> Vec<u8> {
    let (entries, storages) = linear_entries();
    legacy_file(&entries, &storages)
}

// ---------------------------------------------------------------------------------------------
// Running the corpus.

fn temp_path() -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!("pth_hostile_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{}.pth", N.fetch_add(1, Ordering::Relaxed)))
}

/// Every value of the model, bit for bit.
fn snapshot(model: &Linear) -> Vec<(String, Vec<u32>)> {
    model
        .state_dict()
        .unwrap()
        .iter()
        .map(|(k, t)| {
            let bits = t
                .flatten_all()
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect();
            (k.to_owned(), bits)
        })
        .collect()
}

/// Reads `bytes` as a checkpoint, both into a `StateDict` and into a model, each under
/// `catch_unwind`. A panic fails the test; a failed load must leave the model bit-identical.
fn try_read(bytes: &[u8], label: &str) -> Result<StateDict, Error> {
    let path = temp_path();
    std::fs::write(&path, bytes).unwrap();
    let read = catch_unwind(|| StateDict::read(&path, &LoadOptions::default()))
        .unwrap_or_else(|_| panic!("{label}: reading panicked"));
    let model = model();
    let before = snapshot(&model);
    let loaded = catch_unwind(AssertUnwindSafe(|| {
        model.load_state_dict(&path, &LoadOptions::default())
    }))
    .unwrap_or_else(|_| panic!("{label}: load_state_dict panicked"));
    if loaded.is_err() {
        assert!(
            before == snapshot(&model),
            "{label}: a failed load changed the model"
        );
    }
    // A file that reads can still fail to load (a mutated key); one that does not read never loads.
    assert!(read.is_ok() || loaded.is_err(), "{label}");
    std::fs::remove_file(&path).unwrap();
    read
}

/// `bytes` must be refused with an `Error::Pth`; returns its kind.
fn rejected(bytes: &[u8], label: &str) -> PthErrorKind {
    match try_read(bytes, label) {
        Ok(sd) => panic!(
            "{label}: accepted, with keys {:?}",
            sd.keys().collect::<Vec<_>>()
        ),
        Err(Error::Pth { kind, .. }) => *kind,
        Err(other) => panic!("{label}: not an Error::Pth: {other}"),
    }
}
