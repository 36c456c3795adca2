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

// ---------------------------------------------------------------------------------------------

#[test]
fn generated_files_are_valid() {
    let source = model();
    let want = source.state_dict().unwrap();
    for (label, bytes) in [("zip", zip_from(&source)), ("legacy", legacy_from(&source))] {
        let sd = try_read(&bytes, label).unwrap();
        assert_eq!(sd.keys().collect::<Vec<_>>(), ["weight", "bias"]);
        let path = temp_path();
        std::fs::write(&path, &bytes).unwrap();
        let target = model();
        target
            .load_state_dict(&path, &LoadOptions::default())
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        for (key, t) in want.iter() {
            assert_eq!(
                f32_bytes(t),
                f32_bytes(sd.get(key).unwrap()),
                "{label} {key}"
            );
            assert_eq!(
                f32_bytes(t),
                f32_bytes(target.state_dict().unwrap().get(key).unwrap()),
                "{label} {key}"
            );
        }
    }
}

fn zip_from(source: &Linear) -> Vec<u8> {
    let (entries, _) = linear_entries();
    let sd = source.state_dict().unwrap();
    let storages = vec![
        ("0".to_owned(), f32_bytes(sd.get("weight").unwrap())),
        ("1".to_owned(), f32_bytes(sd.get("bias").unwrap())),
    ];
    zip_file(&entries, &storages)
}

fn legacy_from(source: &Linear) -> Vec<u8> {
    let (entries, _) = linear_entries();
    let sd = source.state_dict().unwrap();
    let storages = vec![
        ("0".to_owned(), f32_bytes(sd.get("weight").unwrap())),
        ("1".to_owned(), f32_bytes(sd.get("bias").unwrap())),
    ];
    legacy_file(&entries, &storages)
}

#[test]
fn strided_views_are_gathered() {
    // `weight` stored transposed: a [3, 2] storage read as [2, 3] with stride [1, 2].
    let (_, storages) = linear_entries();
    let w: Vec<f32> = (0..6).map(|i| i as f32).collect();
    let storage: Vec<u8> = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    let entries = [
        ("weight", tensor("0", 6, &[2, 3], &[1, 2])),
        ("bias", tensor("1", 2, &[2], &[1])),
    ];
    let storages = [("0".to_owned(), storage), storages[1].clone()];
    for bytes in [
        zip_file(&entries, &storages),
        legacy_file(&entries, &storages),
    ] {
        let sd = try_read(&bytes, "transposed").unwrap();
        let weight = sd.get("weight").unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(weight, [[0.0, 2.0, 4.0], [1.0, 3.0, 5.0]]);
    }
}

#[test]
fn truncated_files_are_errors() {
    for (label, bytes) in [("zip", good_zip()), ("legacy", good_legacy())] {
        for len in 0..bytes.len() {
            let label = format!("{label} truncated to {len}");
            match try_read(&bytes[..len], &label) {
                Err(Error::Pth { .. }) => {}
                // Too short to hold the format's magic bytes: not taken for a PyTorch file.
                Err(Error::Checkpoint { .. }) if len < 4 => {}
                other => panic!("{label}: {other:?}"),
            }
        }
    }
}

#[test]
fn memo_bombs_are_errors() {
    let (_, storages) = linear_entries();
    let bomb = P::default()
        .str("x")
        .op(LONG_BINPUT)
        .raw(&u32::MAX.to_le_bytes())
        .0;
    let entries = [("weight", Val::Raw(bomb))];
    let kind = rejected(&zip_file(&entries, &storages), "memo index u32::MAX");
    assert!(
        matches!(kind, PthErrorKind::MemoTooLarge { index, .. } if index == u64::from(u32::MAX)),
        "{kind}"
    );
    // Reading a memo slot that was never written.
    let entries = [("weight", Val::Raw(P::default().op(BINGET).op(200).0))];
    rejected(&zip_file(&entries, &storages), "unset memo slot");
    // A million memo writes of one slot, and a large fan-out of memo reads of one list: cheap.
    let mut p = P::default()
        .op(EMPTY_LIST)
        .op(LONG_BINPUT)
        .raw(&7u32.to_le_bytes());
    for _ in 0..200_000 {
        p = p.op(b'0').op(BINGET).op(7).op(b'2').op(b'a');
    }
    let entries = [
        ("weight", tensor("0", 6, &[2, 3], &[3, 1])),
        ("bias", Val::Raw(p.0)),
    ];
    let kind = rejected(&zip_file(&entries, &storages), "self-appending list");
    assert!(
        matches!(&kind, PthErrorKind::NotATensor { key, .. } if key == "bias"),
        "{kind}"
    );
}

#[test]
fn deep_nesting_is_an_error() {
    let (_, storages) = linear_entries();
    for (label, op) in [
        ("EMPTY_LIST", EMPTY_LIST),
        ("MARK", MARK),
        ("EMPTY_DICT", EMPTY_DICT),
    ] {
        let spam = vec![op; 100_000];
        let entries = [("weight", Val::Raw(spam))];
        let kind = rejected(&zip_file(&entries, &storages), label);
        assert!(
            matches!(kind, PthErrorKind::TooDeep { .. }),
            "{label}: {kind}"
        );
    }
    // 100,000 nested tuples built with a stack of one: not a state dict, and no stack overflow.
    let mut nested = P::default().op(EMPTY_TUPLE);
    for _ in 0..100_000 {
        nested = nested.op(TUPLE1);
    }
    let entries = [
        ("weight", tensor("0", 6, &[2, 3], &[3, 1])),
        ("bias", Val::Raw(nested.0)),
    ];
    let kind = rejected(&zip_file(&entries, &storages), "nested tuples");
    assert!(
        matches!(&kind, PthErrorKind::NotATensor { key, .. } if key == "bias"),
        "{kind}"
    );
}

/// Layouts that do not fit (or overflow) a 16-byte or 8-byte storage.
#[test]
fn tensors_must_fit_their_storage() {
    let (_, storages) = linear_entries();
    let layouts: &[(&str, i64, &[i64], &[i64])] = &[
        ("2^40 elements", 0, &[1 << 40], &[1]),
        ("2^40 elements, stride 0", 0, &[1 << 40], &[0]),
        ("past the end", 0, &[2, 4], &[4, 1]),
        ("offset past the end", 5, &[2], &[1]),
        ("negative offset", -1, &[2], &[1]),
        ("negative size", 0, &[-1], &[1]),
        ("negative stride", 0, &[2, 3], &[-3, 1]),
        ("overflowing shape", 0, &[i64::MAX, i64::MAX], &[1, 1]),
        ("overflowing stride", 0, &[2, 2], &[i64::MAX, 1]),
        ("overflowing offset", i64::MAX, &[2], &[1]),
        ("huge rank", 0, &[2; 64], &[1; 64]),
        ("empty, offset past the end", 7, &[0], &[1]),
        ("empty, overflowing offset", i64::MAX, &[2, 0], &[1, 1]),
    ];
    for &(label, offset, size, stride) in layouts {
        let entries = [
            (
                "weight",
                Val::Tensor {
                    storage_type: "FloatStorage",
                    key: "0".into(),
                    numel: 6,
                    offset,
                    size: size.into(),
                    stride: stride.into(),
                },
            ),
            ("bias", tensor("1", 2, &[2], &[1])),
        ];
        for (format, bytes) in [
            ("zip", zip_file(&entries, &storages)),
            ("legacy", legacy_file(&entries, &storages)),
        ] {
            let kind = rejected(&bytes, &format!("{format}: {label}"));
            assert!(
                matches!(&kind, PthErrorKind::StorageOutOfBounds { key, storage_bytes: 24, .. } if key == "weight"),
                "{format} {label}: {kind}"
            );
        }
    }
    // Empty tensors inside their storage are fine.
    let entries = [
        ("weight", tensor("0", 6, &[0, 3], &[3, 1])),
        ("bias", tensor("1", 2, &[2, 0], &[5, 9])),
    ];
    let sd = try_read(&zip_file(&entries, &storages), "empty tensors").unwrap();
    assert_eq!(sd.get("weight").unwrap().dims(), [0, 3]);
    assert_eq!(sd.get("bias").unwrap().dims(), [2, 0]);
    // Shape and stride of different ranks.
    let entries = [("weight", tensor("0", 6, &[2, 3], &[1]))];
    rejected(&zip_file(&entries, &storages), "rank mismatch");
}

#[test]
fn unknown_opcodes_are_errors() {
    let (entries, storages) = linear_entries();
    let mut pickle = state_dict_pickle(&entries, false);
    pickle.insert(2, 0xff);
    let bytes = write_zip(&zip_members(pickle, &storages));
    let path = temp_path();
    std::fs::write(&path, &bytes).unwrap();
    let err = StateDict::read(&path, &LoadOptions::default()).unwrap_err();
    std::fs::remove_file(&path).unwrap();
    let Error::Pth { kind, offset, .. } = err else {
        panic!("{err}")
    };
    assert_eq!(*kind, PthErrorKind::UnknownOpcode { opcode: 0xff });
    // The local header (30 bytes) and the member's name come first.
    assert_eq!(offset, Some(30 + "archive/data.pkl".len() as u64 + 2));
    // Opcodes the reader does not accept: INST, OBJ, EXT1, PERSID (text), NEXT_BUFFER.
    for op in [b'i', b'o', 0x82, b'P', 0x97] {
        let mut pickle = state_dict_pickle(&entries, false);
        pickle.insert(2, op);
        let kind = rejected(&write_zip(&zip_members(pickle, &storages)), "opcode");
        assert_eq!(kind, PthErrorKind::UnknownOpcode { opcode: op });
    }
}

#[test]
fn zip_member_problems_are_errors() {
    let (entries, storages) = linear_entries();
    let pickle = state_dict_pickle(&entries, false);

    for compressed in ["archive/data.pkl", "archive/data/0"] {
        let mut members = zip_members(pickle.clone(), &storages);
        members
            .iter_mut()
            .find(|m| m.name == compressed)
            .unwrap()
            .method = 8;
        let kind = rejected(&write_zip(&members), compressed);
        assert!(
            matches!(&kind, PthErrorKind::Compressed { member, .. } if member == compressed),
            "{kind}"
        );
    }

    let mut members = zip_members(pickle.clone(), &storages);
    members.push(member("archive/data.pkl", pickle.clone()));
    assert_eq!(
        rejected(&write_zip(&members), "duplicate data.pkl"),
        PthErrorKind::DuplicateMember
    );
    let mut members = zip_members(pickle.clone(), &storages);
    members.push(member("other/data.pkl", pickle.clone()));
    assert_eq!(
        rejected(&write_zip(&members), "two archives"),
        PthErrorKind::DuplicateMember
    );

    let members = zip_members(pickle.clone(), &storages[..1]);
    let kind = rejected(&write_zip(&members), "missing storage");
    assert_eq!(
        kind,
        PthErrorKind::MissingMember {
            member: "archive/data/1".into()
        }
    );
    let mut members = zip_members(pickle.clone(), &storages);
    members.remove(0);
    let kind = rejected(&write_zip(&members), "missing data.pkl");
    assert!(matches!(kind, PthErrorKind::MissingMember { .. }), "{kind}");

    let mut members = zip_members(pickle, &storages);
    members[1].data = b"big".to_vec();
    let kind = rejected(&write_zip(&members), "big-endian");
    assert_eq!(
        kind,
        PthErrorKind::ByteOrder {
            found: "big".into()
        }
    );

    let bytes = legacy_file_with(&entries, &storages, false);
    let kind = rejected(&bytes, "legacy big-endian");
    assert_eq!(
        kind,
        PthErrorKind::ByteOrder {
            found: "big".into()
        }
    );
}

#[test]
fn forbidden_globals_are_errors_not_vanished_entries() {
    let (mut entries, storages) = linear_entries();
    // `os.system` as a dict value, beside valid tensors.
    entries.push(("evil", Val::Raw(P::default().global("os", "system").0)));
    for (format, bytes) in [
        ("zip", zip_file(&entries, &storages)),
        ("legacy", legacy_file(&entries, &storages)),
    ] {
        let kind = rejected(&bytes, format);
        assert_eq!(
            kind,
            PthErrorKind::ForbiddenGlobal {
                module: "os".into(),
                name: "system".into()
            },
            "{format}"
        );
        assert!(kind.to_string().contains("os.system"), "{kind}");
    }
    // `builtins.eval("...")` through REDUCE, and through STACK_GLOBAL.
    let (mut entries, storages) = linear_entries();
    let eval = P::default()
        .global("builtins", "eval")
        .str("__import__('os').system('false')")
        .op(TUPLE1)
        .op(REDUCE);
    entries[1].1 = Val::Raw(eval.0);
    let kind = rejected(&zip_file(&entries, &storages), "eval");
    assert_eq!(
        kind,
        PthErrorKind::ForbiddenGlobal {
            module: "builtins".into(),
            name: "eval".into()
        }
    );
    let stack_global = P::default()
        .str("subprocess")
        .str("Popen")
        .op(STACK_GLOBAL)
        .op(EMPTY_TUPLE)
        .op(REDUCE);
    entries[1].1 = Val::Raw(stack_global.0);
    let kind = rejected(&zip_file(&entries, &storages), "STACK_GLOBAL");
    assert!(
        matches!(&kind, PthErrorKind::ForbiddenGlobal { module, .. } if module == "subprocess"),
        "{kind}"
    );
    // An allowed global used in a forbidden way: calling a storage type.
    entries[1].1 = Val::Raw(
        P::default()
            .global("torch", "FloatStorage")
            .op(EMPTY_TUPLE)
            .op(REDUCE)
            .0,
    );
    rejected(&zip_file(&entries, &storages), "storage call");
}

#[test]
fn unsupported_storage_types_and_stray_values_are_named() {
    let (mut entries, storages) = linear_entries();
    entries[1].1 = Val::Tensor {
        storage_type: "ComplexFloatStorage",
        key: "1".into(),
        numel: 1,
        offset: 0,
        size: vec![1],
        stride: vec![1],
    };
    let kind = rejected(&zip_file(&entries, &storages), "complex");
    assert_eq!(
        kind,
        PthErrorKind::UnsupportedDType {
            key: "bias".into(),
            storage_type: "torch.ComplexFloatStorage".into()
        }
    );
    let (mut entries, storages) = linear_entries();
    entries.push(("note", Val::Raw(P::default().str("hello").0)));
    let kind = rejected(&zip_file(&entries, &storages), "stray string");
    assert!(
        matches!(&kind, PthErrorKind::NotATensor { key, .. } if key == "note"),
        "{kind}"
    );
}

/// A deterministic xorshift generator.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

/// Seeded byte flips, overwrites, insertions and truncations of valid zip and legacy files: 3000
/// by default (under a second in debug), `PTH_FUZZ=<n>` for more.
#[test]
fn random_mutations_never_panic() {
    let start = std::time::Instant::now();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let originals = [good_zip(), good_legacy()];
    let (mut ok, mut err) = (0, 0);
    for i in 0..std::env::var("PTH_FUZZ").map_or(3000, |v| v.parse().unwrap()) {
        let mut bytes = originals[i % 2].clone();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(bytes.len());
            match rng.below(4) {
                0 => bytes[at] ^= 1 << rng.below(8),
                1 => bytes[at] = rng.next() as u8,
                2 => bytes.insert(at, rng.next() as u8),
                _ => bytes.truncate(at),
            }
            if bytes.is_empty() {
                break;
            }
        }
        // Flips inside tensor data are valid files; everything else must be an error.
        match try_read(&bytes, &format!("mutation {i}")) {
            Ok(_) => ok += 1,
            Err(_) => err += 1,
        }
    }
    eprintln!("{err} errors, {ok} accepted");
    assert!(err > ok, "{err} errors, {ok} accepted");
    assert!(start.elapsed().as_secs() < 60, "{:?}", start.elapsed());
}

#[test]
fn nested_and_dotted_keys_select_a_state_dict() {
    let source = model();
    let (entries, storages) = linear_entries();
    let sd = source.state_dict().unwrap();
    let storages: Storages = vec![
        (storages[0].0.clone(), f32_bytes(sd.get("weight").unwrap())),
        (storages[1].0.clone(), f32_bytes(sd.get("bias").unwrap())),
    ];
    // {"epoch": 3, "model": {"ema": state_dict}, "lr": 0.1}
    let pickle = P::default()
        .proto()
        .op(EMPTY_DICT)
        .op(MARK)
        .str("epoch")
        .int(3)
        .str("model")
        .op(EMPTY_DICT)
        .op(MARK)
        .str("ema")
        .raw(&state_dict_body(&entries, false))
        .op(SETITEMS)
        .str("lr")
        .op(b'G')
        .raw(&0.1f64.to_be_bytes())
        .op(SETITEMS)
        .op(STOP)
        .0;
    let path = temp_path();
    std::fs::write(&path, write_zip(&zip_members(pickle, &storages))).unwrap();

    let read = StateDict::read(&path, &LoadOptions::default().nested_in("model.ema")).unwrap();
    assert_eq!(read.keys().collect::<Vec<_>>(), ["weight", "bias"]);
    let target = model();
    target
        .load_state_dict(&path, &LoadOptions::default().nested_in("model.ema"))
        .unwrap();
    assert_eq!(
        f32_bytes(target.state_dict().unwrap().get("weight").unwrap()),
        f32_bytes(sd.get("weight").unwrap())
    );

    let kind = |key: Option<&str>| match StateDict::read(&path, &nested(key)) {
        Err(Error::Pth { kind, .. }) => *kind,
        other => panic!("{key:?}: {other:?}"),
    };
    assert!(
        matches!(kind(None), PthErrorKind::NotAStateDict { candidates, .. } if candidates == ["model.ema"])
    );
    assert!(
        matches!(kind(Some("model")), PthErrorKind::NotAStateDict { candidates, .. } if candidates == ["ema"])
    );
    assert!(
        matches!(kind(Some("model.emma")), PthErrorKind::NoSuchKey { available, .. } if available == ["ema"])
    );
    assert!(matches!(
        kind(Some("epoch")),
        PthErrorKind::NotAStateDict { .. }
    ));
    std::fs::remove_file(&path).unwrap();
}

/// Options that read the state dict under `key` (the top level with `None`).
fn nested(key: Option<&str>) -> LoadOptions {
    match key {
        Some(key) => LoadOptions::default().nested_in(key),
        None => LoadOptions::default(),
    }
}
