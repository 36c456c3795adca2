//! Hostile pickles: memo and nesting bombs, unknown opcodes, forbidden globals, storage types
//! candle has no dtype for, and stray values where tensors belong.

use super::*;

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
