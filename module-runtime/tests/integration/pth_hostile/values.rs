//! Hostile pickles read as Python values (`PthValues::load`): a list that contains itself, a
//! list that doubles 40 times through the memo and a long string referred to thousands of times
//! are bounded errors, not a hang, an overflow or an allocation beyond the file's size.

use module_runtime::PthValues;

use super::*;

const APPEND: u8 = b'a';
const LIST: u8 = b'l';
const BINPUT: u8 = b'q';

/// Reads `pickle` (with `PROTO` and `STOP` added) as a zip checkpoint's values; returns the
/// error's kind.
fn values_rejected(body: P, label: &str) -> PthErrorKind {
    let pickle = P::default().proto().raw(&body.0).op(STOP).0;
    let path = temp_path();
    std::fs::write(&path, write_zip(&zip_members(pickle, &[]))).unwrap();
    let read = catch_unwind(|| PthValues::load(&path))
        .unwrap_or_else(|_| panic!("{label}: reading panicked"));
    std::fs::remove_file(&path).unwrap();
    match read {
        Ok(v) => panic!("{label}: accepted: {}", v.root().describe()),
        Err(Error::Pth { kind, .. }) => *kind,
        Err(other) => panic!("{label}: not an Error::Pth: {other}"),
    }
}

#[test]
fn a_list_that_contains_itself_is_an_error() {
    let body = P::default()
        .op(EMPTY_LIST)
        .op(LONG_BINPUT)
        .raw(&0u32.to_le_bytes())
        .op(BINGET)
        .op(0)
        .op(APPEND);
    let kind = values_rejected(body, "self-containing list");
    assert!(
        kind.to_string()
            .contains("nests deeper than 128 levels (or contains itself)"),
        "{kind}"
    );
}

#[test]
fn a_doubling_bomb_is_an_error() {
    // x0 = []; x{i} = [x{i-1}, x{i-1}]: 2^40 values from a few hundred bytes.
    let mut body = P::default().op(EMPTY_LIST).op(BINPUT).op(0);
    for i in 1..=40u8 {
        body = body
            .op(MARK)
            .op(BINGET)
            .op(i - 1)
            .op(BINGET)
            .op(i - 1)
            .op(LIST)
            .op(BINPUT)
            .op(i);
    }
    let kind = values_rejected(body, "doubling bomb");
    assert!(kind.to_string().contains("expands to more than"), "{kind}");
}

#[test]
fn a_string_referred_to_many_times_is_an_error() {
    // s = "x" * 65536; [s] * 8192 through the memo: 512 MiB of copies from a 90 KB file.
    let mut body = P::default()
        .str(&"x".repeat(1 << 16))
        .op(BINPUT)
        .op(0)
        .op(EMPTY_LIST)
        .op(MARK);
    for _ in 0..8192 {
        body = body.op(BINGET).op(0);
    }
    let kind = values_rejected(body.op(APPENDS), "string bomb");
    assert!(
        kind.to_string().contains("strings expand to more than"),
        "{kind}"
    );
}

/// The plain values a checkpoint holds besides tensors, read back.
#[test]
fn plain_values_are_read() {
    let body = P::default()
        .op(EMPTY_DICT)
        .op(MARK)
        .str("epoch")
        .int(3)
        .str("none")
        .op(NONE)
        .str("flag")
        .op(NEWTRUE)
        .str("pair")
        .ints(&[1, 2])
        .op(SETITEMS);
    let pickle = P::default().proto().raw(&body.0).op(STOP).0;
    let path = temp_path();
    std::fs::write(&path, write_zip(&zip_members(pickle, &[]))).unwrap();
    let ckpt = PthValues::load(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    assert_eq!(ckpt.extract::<i64>("epoch").unwrap(), 3);
    assert!(ckpt.extract::<bool>("flag").unwrap());
    assert_eq!(ckpt.extract::<Vec<i64>>("pair").unwrap(), [1, 2]);
    assert_eq!(ckpt.extract::<i64>("pair.1").unwrap(), 2);
    let err = ckpt.extract::<f64>("none").unwrap_err().to_string();
    assert!(err.contains("`none`: is None, not a number"), "{err}");
}
