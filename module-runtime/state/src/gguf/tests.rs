//! The bounded GGUF reader against crafted files, one per fault class: each is a
//! [`QuantizeError::GgufFile`] of the right [`GgufErrorKind`], naming the file and the key or
//! tensor, and no panic.

use super::*;
use candle_core::quantized::{gguf_file, GgmlDType};
use module_core::GgufErrorKind;

/// Reads `bytes` as a GGUF file (written to a file of this test's own).
fn read(bytes: &[u8], name: &str) -> Result<GgufFile> {
    let path = std::env::temp_dir().join(format!("gguf-{name}-{}.gguf", std::process::id()));
    std::fs::write(&path, bytes).unwrap();
    let file = GgufFile::read(&path, &Device::Cpu);
    std::fs::remove_file(&path).unwrap();
    file
}

/// The kind of the error reading `bytes` gives, after checking that its message names the file.
fn kind(bytes: &[u8], name: &str) -> GgufErrorKind {
    match read(bytes, name) {
        Err(Error::Quantize(QuantizeError::GgufFile { file, kind, .. })) => {
            assert!(file.to_string_lossy().contains(name), "{file:?}");
            *kind
        }
        Err(e) => panic!("{name}: not a GGUF layout error: {e}"),
        Ok(_) => panic!("{name}: read"),
    }
}

/// A GGUF file written byte by byte, so that each field can be made wrong.
#[derive(Clone)]
struct Craft {
    version: u32,
    /// Key, value type, the value's bytes.
    kvs: Vec<(Vec<u8>, u32, Vec<u8>)>,
    /// Name, dimensions (innermost first), type, offset.
    tensors: Vec<(String, Vec<u64>, u32, u64)>,
    data: Vec<u8>,
    /// Overrides of the counts in the header.
    counts: Option<(u64, u64)>,
}

fn string(s: &[u8]) -> Vec<u8> {
    let mut b = (s.len() as u64).to_le_bytes().to_vec();
    b.extend(s);
    b
}

impl Craft {
    /// A valid file: `w`, a `q8_0` matrix of 2 rows of 64 (136 bytes, padded to 160), then `b`,
    /// a float32 vector of 2.
    fn valid() -> Self {
        let mut data = vec![0u8; 160];
        for row in 0..4 {
            // Each block: a float16 scale of 1.0, then 32 values.
            data[row * 34..row * 34 + 2].copy_from_slice(&[0x00, 0x3c]);
            data[row * 34 + 2] = row as u8;
        }
        data.extend(1f32.to_le_bytes());
        data.extend(2f32.to_le_bytes());
        Self {
            version: 3,
            kvs: vec![(b"general.name".to_vec(), 8, string(b"crafted"))],
            tensors: vec![
                ("w".into(), vec![64, 2], 8, 0),
                ("b".into(), vec![2], 0, 160),
            ],
            data,
            counts: None,
        }
    }

    fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
        self.kvs.push((key.as_bytes().to_vec(), ty, value));
        self
    }

    fn bytes(&self) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(self.version.to_le_bytes());
        let (nt, nk) = self
            .counts
            .unwrap_or((self.tensors.len() as u64, self.kvs.len() as u64));
        b.extend(nt.to_le_bytes());
        b.extend(nk.to_le_bytes());
        for (key, ty, value) in &self.kvs {
            b.extend(string(key));
            b.extend(ty.to_le_bytes());
            b.extend(value);
        }
        for (name, dims, ty, offset) in &self.tensors {
            b.extend(string(name.as_bytes()));
            b.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(offset.to_le_bytes());
        }
        b.resize(b.len().next_multiple_of(32), 0);
        b.extend(&self.data);
        b
    }
}

#[test]
fn a_crafted_valid_file_reads() {
    let file = read(&Craft::valid().bytes(), "valid").unwrap();
    assert_eq!(file.tensors["w"].dtype(), GgmlDType::Q8_0);
    assert_eq!(file.tensors["w"].shape().dims(), [2, 64]);
    let b = file.tensors["b"].dequantize(&Device::Cpu).unwrap();
    assert_eq!(b.to_vec1::<f32>().unwrap(), [1., 2.]);
    let w = file.tensors["w"].dequantize(&Device::Cpu).unwrap();
    assert_eq!(
        w.get(1)
            .unwrap()
            .get(32)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap(),
        3.
    );
    assert_eq!(
        file.get("general.name").unwrap().to_string().unwrap(),
        "crafted"
    );
}

#[test]
fn candles_writer_and_version_1_files_read() {
    let dev = Device::Cpu;
    let w = Tensor::arange(0f32, 128., &dev)
        .unwrap()
        .reshape((2, 64))
        .unwrap();
    let w = QTensor::quantize(&w, GgmlDType::Q8_0).unwrap();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &[], &[("w", &w)]).unwrap();
    let file = read(&out.into_inner(), "candle").unwrap();
    assert_eq!(file.tensors["w"].data().unwrap(), w.data().unwrap());
    // Version 1: lengths, counts and dimensions as u32.
    let mut b = b"GGUF".to_vec();
    for n in [1u32, 1, 0, 1] {
        b.extend(n.to_le_bytes());
    }
    b.push(b'v');
    b.extend(1u32.to_le_bytes());
    b.extend(4u32.to_le_bytes());
    b.extend(0u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(64, 0);
    b.extend([0u8; 16]);
    assert_eq!(read(&b, "v1").unwrap().tensors["v"].shape().dims(), [4]);
}

#[test]
fn truncated_files_are_errors_that_name_the_file() {
    let bytes = Craft::valid().bytes();
    // A cut into the last tensor's padding loses nothing, as llama.cpp reads it; there is none
    // after `b` here, so every cut is an error.
    for cut in 0..bytes.len() {
        let Err(err) = read(&bytes[..cut], "cut") else {
            panic!("a file cut at {cut} of {} bytes was read", bytes.len())
        };
        assert!(err.to_string().contains("gguf-cut"), "{err}");
    }
}

#[test]
fn an_alignment_of_zero_or_not_a_power_of_two_is_an_error() {
    // Candle's own reader divides by a zero alignment.
    for (name, ty, value) in [
        ("align0", 4, 0u32.to_le_bytes().to_vec()),
        ("align3", 4, 3u32.to_le_bytes().to_vec()),
        ("alignneg", 5, (-32i32).to_le_bytes().to_vec()),
        ("alignstr", 8, string(b"32")),
        ("alignhuge", 10, (1u64 << 63).to_le_bytes().to_vec()),
    ] {
        let bytes = Craft::valid().kv("general.alignment", ty, value).bytes();
        assert!(
            matches!(kind(&bytes, name), GgufErrorKind::Alignment { .. }),
            "{name}"
        );
    }
    // A power of two larger than the file puts the data past its end.
    let bytes = Craft::valid()
        .kv("general.alignment", 4, (1u32 << 31).to_le_bytes().to_vec())
        .bytes();
    assert!(matches!(
        kind(&bytes, "alignbig"),
        GgufErrorKind::PastEnd { .. }
    ));
}

#[test]
fn lengths_and_counts_beyond_the_file_are_errors_before_allocating() {
    let too_large = |bytes: Vec<u8>, name: &str, what: &str| match kind(&bytes, name) {
        GgufErrorKind::TooLarge {
            what: w,
            declared,
            limit,
        } => {
            assert!(w.contains(what), "{name}: {w}");
            assert!(declared > limit, "{name}");
        }
        k => panic!("{name}: {k:?}"),
    };
    // A key's length of 2^60.
    let mut craft = Craft::valid();
    let mut key = (1u64 << 60).to_le_bytes().to_vec();
    key.extend(b"x");
    craft.kvs.insert(0, (Vec::new(), 4, Vec::new()));
    let mut bytes = craft.bytes();
    // Replace the empty key's length (right after the 24-byte header) with 2^60.
    bytes[24..32].copy_from_slice(&key[..8]);
    too_large(bytes, "keylen", "the length of metadata key 0");
    // A string value's length.
    let mut value = (u64::MAX).to_le_bytes().to_vec();
    value.extend(b"abc");
    too_large(
        Craft::valid().kv("s", 8, value).bytes(),
        "strlen",
        "the length of the metadata value of `s`",
    );
    // An array of 2^40 u32.
    let mut value = 4u32.to_le_bytes().to_vec();
    value.extend((1u64 << 40).to_le_bytes());
    too_large(Craft::valid().kv("a", 9, value).bytes(), "arraylen", "`a`");
    // Tensor and metadata counts.
    let mut craft = Craft::valid();
    craft.counts = Some((u64::MAX / 2, 1));
    too_large(craft.bytes(), "tensorcount", "the tensor count");
    let mut craft = Craft::valid();
    craft.counts = Some((2, 1 << 50));
    too_large(craft.bytes(), "kvcount", "the metadata count");
    // Five dimensions.
    let mut craft = Craft::valid();
    craft.tensors[1].1 = vec![2, 1, 1, 1, 1];
    too_large(craft.bytes(), "dims", "the dimension count of tensor `b`");
}

#[test]
fn metadata_that_would_take_much_more_memory_than_the_file_is_an_error() {
    // 3 M one-byte values: 3 MB on disk, 96 MB as values; the budget is 64 MiB + 8 × the file.
    let n = 3u64 << 20;
    let mut value = 0u32.to_le_bytes().to_vec();
    value.extend(n.to_le_bytes());
    value.resize(value.len() + n as usize, 1);
    let bytes = Craft::valid().kv("tokenizer.bytes", 9, value).bytes();
    match kind(&bytes, "budget") {
        GgufErrorKind::TooLarge { what, .. } => assert!(what.contains("memory"), "{what}"),
        k => panic!("{k:?}"),
    }
}

#[test]
fn duplicated_keys_and_tensor_names_are_errors() {
    let bytes = Craft::valid()
        .kv("general.name", 8, string(b"again"))
        .bytes();
    assert_eq!(
        kind(&bytes, "dupkey"),
        GgufErrorKind::DuplicateKey {
            key: "general.name".into()
        }
    );
    let mut craft = Craft::valid();
    craft.tensors[1].0 = "w".into();
    craft.tensors[1].1 = vec![32];
    craft.tensors[1].2 = 8;
    assert_eq!(
        kind(&craft.bytes(), "dupname"),
        GgufErrorKind::DuplicateTensor { name: "w".into() }
    );
}

#[test]
fn shapes_without_a_size_in_their_type_are_errors() {
    for (name, dims, ty) in [
        // Rows of 48 are not whole q8_0 blocks of 32.
        ("rows", vec![48, 2], 8),
        // 2^80 elements: the product overflows.
        ("overflow", vec![1 << 40, 1 << 40], 0),
        ("scalar", vec![], 0),
    ] {
        let mut craft = Craft::valid();
        craft.tensors[0] = ("w".into(), dims, ty, 0);
        match kind(&craft.bytes(), name) {
            GgufErrorKind::TensorShape { name: t, .. } => assert_eq!(t, "w"),
            k => panic!("{name}: {k:?}"),
        }
    }
    let mut craft = Craft::valid();
    craft.tensors[0].2 = 4; // type 4 (the removed Q4_2)
    assert!(matches!(
        kind(&craft.bytes(), "type"),
        GgufErrorKind::Malformed { .. }
    ));
}

#[test]
fn misaligned_overlapping_and_unaccounted_data_are_errors() {
    let mut craft = Craft::valid();
    craft.tensors[1].3 = 150;
    assert!(matches!(
        kind(&craft.bytes(), "misaligned"),
        GgufErrorKind::Misaligned { offset: 150, .. }
    ));
    let mut craft = Craft::valid();
    craft.tensors[1].3 = 128;
    match kind(&craft.bytes(), "overlap") {
        GgufErrorKind::Overlap {
            name,
            previous,
            previous_end,
            ..
        } => {
            assert_eq!(
                (name.as_str(), previous.as_str(), previous_end),
                ("b", "w", 136)
            );
        }
        k => panic!("{k:?}"),
    }
    let mut craft = Craft::valid();
    craft.tensors[1].3 = 192;
    craft.data.splice(160..160, [0u8; 32]);
    assert!(matches!(
        kind(&craft.bytes(), "gap"),
        GgufErrorKind::Unaccounted {
            unaccounted: 32,
            ..
        }
    ));
    let mut craft = Craft::valid();
    craft.data.extend([0u8; 64]);
    assert!(matches!(
        kind(&craft.bytes(), "trailing"),
        GgufErrorKind::Unaccounted { .. }
    ));
    // Both tensors at offset 0: the second reads the first's bytes.
    let mut craft = Craft::valid();
    craft.tensors[1].3 = 0;
    assert!(matches!(
        kind(&craft.bytes(), "same"),
        GgufErrorKind::Overlap { .. }
    ));
}

#[test]
fn a_tensor_relabelled_as_another_type_is_an_error() {
    // The q8_0 `w` relabelled float32: 512 bytes declared where 136 lie (and the file's 168).
    let mut craft = Craft::valid();
    craft.tensors[0].2 = 0;
    assert!(matches!(
        kind(&craft.bytes(), "relabel"),
        GgufErrorKind::PastEnd { bytes: 512, .. }
    ));
    // Last in the file, it runs past the end.
    let mut craft = Craft::valid();
    craft.tensors.swap(0, 1);
    craft.tensors[0].3 = 0;
    craft.tensors[1].3 = 32;
    let (w, b) = craft.data.split_at(160);
    craft.data = [b, &[0u8; 24], &w[..136]].concat();
    read(&craft.bytes(), "reordered").unwrap();
    craft.tensors[1].2 = 0;
    assert!(matches!(
        kind(&craft.bytes(), "relabellast"),
        GgufErrorKind::PastEnd { .. }
    ));
    // A float32 vector of 64 relabelled q8_0 leaves 188 of its 256 bytes unaccounted.
    let mut craft = Craft::valid();
    craft.tensors = vec![("v".into(), vec![64], 8, 0)];
    craft.data = vec![0; 256];
    assert!(matches!(
        kind(&craft.bytes(), "relabelfloat"),
        GgufErrorKind::Unaccounted { .. }
    ));
}

#[test]
fn malformed_values_are_errors() {
    for (name, ty, value) in [
        ("valuetype", 13, vec![0]),
        ("bool", 7, vec![2]),
        (
            "arraytype",
            9,
            [99u32.to_le_bytes().to_vec(), 1u64.to_le_bytes().to_vec()].concat(),
        ),
    ] {
        let bytes = Craft::valid().kv("k", ty, value).bytes();
        match kind(&bytes, name) {
            GgufErrorKind::Malformed { reason } => assert!(reason.contains("`k`"), "{reason}"),
            k => panic!("{name}: {k:?}"),
        }
    }
    // Arrays nested 100 deep.
    let mut value = Vec::new();
    for _ in 0..100 {
        value.extend(9u32.to_le_bytes());
        value.extend(1u64.to_le_bytes());
    }
    value.extend(4u32.to_le_bytes());
    value.extend(0u64.to_le_bytes());
    assert!(matches!(
        kind(&Craft::valid().kv("deep", 9, value).bytes(), "deep"),
        GgufErrorKind::Malformed { .. }
    ));
    assert!(matches!(
        kind(b"GGML\x03\0\0\0", "magic"),
        GgufErrorKind::Malformed { .. }
    ));
}
