//! Hostile files around valid pickles: truncations, strided views, tensors that do not fit their
//! storage, zip member problems, seeded random mutations, and state dicts nested under a key.

use super::*;

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

/// A state dict that names a tensor twice is refused (`torch.save` never writes one; unpickling
/// would keep the last silently). Two tensors sharing one storage (tied weights, views) are
/// what PyTorch writes for shared tensors, and read.
#[test]
fn a_key_named_twice_is_an_error_and_shared_storages_are_not() {
    let (_, storages) = linear_entries();
    let entries = [
        ("weight", tensor("0", 6, &[2, 3], &[3, 1])),
        ("bias", tensor("1", 2, &[2], &[1])),
        ("weight", tensor("0", 6, &[2, 3], &[3, 1])),
    ];
    for (format, bytes) in [
        ("zip", zip_file(&entries, &storages)),
        ("legacy", legacy_file(&entries, &storages)),
    ] {
        let kind = rejected(&bytes, &format!("{format}: twice"));
        assert_eq!(
            kind,
            PthErrorKind::DuplicateKey {
                key: "weight".into()
            },
            "{format}"
        );
    }
    let entries = [
        ("weight", tensor("0", 6, &[2, 3], &[3, 1])),
        ("bias", tensor("0", 6, &[2], &[1])),
    ];
    let sd = try_read(&zip_file(&entries, &storages), "shared").unwrap();
    let (w, b) = (sd.get("weight").unwrap(), sd.get("bias").unwrap());
    let first_row = w.get(0).unwrap().narrow(0, 0, 2).unwrap();
    assert_eq!(
        b.to_vec1::<f32>().unwrap(),
        first_row.to_vec1::<f32>().unwrap()
    );
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
