//! State dicts and checkpoint files through the public API: round trips, strict reports,
//! all-or-nothing loads, key rules, atomic saves and malformed files.

use std::path::{Path, PathBuf};

use module_runtime::prelude::*;
use module_runtime::{Error, LoadOptions};

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

#[derive(Module)]
struct Embeddings {
    word: Linear,
    #[module(rename = "LayerNorm")]
    norm: Linear,
    position_ids: Buffer,
    cache: Buffer,
}

fn embeddings() -> Embeddings {
    let dev = dev();
    Embeddings {
        word: Linear::new(4, 3, &dev).unwrap(),
        norm: Linear::new(3, 3, &dev).unwrap(),
        position_ids: Buffer::new(Tensor::arange(0i64, 6, &dev).unwrap()),
        cache: Buffer::non_persistent(Tensor::zeros(2, DType::F32, &dev).unwrap()),
    }
}

fn tmp(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("module-state-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

fn values(m: &dyn Module) -> Vec<(String, Vec<f32>)> {
    m.state_dict()
        .unwrap()
        .iter()
        .map(|(k, t)| {
            let v = t.flatten_all().unwrap().to_dtype(DType::F32).unwrap();
            (k.to_owned(), v.to_vec1().unwrap())
        })
        .collect()
}

#[test]
fn state_dict_keys_follow_pytorch() {
    let m = embeddings();
    let sd = m.state_dict().unwrap();
    let keys: Vec<&str> = sd.keys().collect();
    assert_eq!(
        keys,
        [
            "position_ids",
            "word.weight",
            "word.bias",
            "LayerNorm.weight",
            "LayerNorm.bias",
        ],
        "own buffers before submodules (PyTorch's order); non-persistent buffers are not saved"
    );
    assert_eq!(sd.get("position_ids").unwrap().dtype(), DType::I64);
}

#[test]
fn safetensors_round_trip() {
    let a = embeddings();
    let path = tmp("round_trip.safetensors");
    a.save_safetensors(&path).unwrap();
    let b = embeddings();
    let report = b.load_state_dict(&path, &LoadOptions::default()).unwrap();
    assert_eq!(report.loaded, 5);
    assert!(report.is_complete());
    assert_eq!(values(&a), values(&b));
    assert_eq!(b.position_ids.dtype(), DType::I64);
}

#[derive(Module)]
struct TiedLm {
    embed: Linear,
    head: Linear,
}

#[test]
fn tied_parameters_stay_tied_after_a_load() {
    let shared = Linear::no_bias(2, 2, &dev()).unwrap();
    let a = TiedLm {
        embed: shared.clone(),
        head: shared,
    };
    let sd = a.state_dict().unwrap();
    assert_eq!(
        sd.len(),
        2,
        "a tied weight is saved under each of its paths"
    );
    let shared = Linear::no_bias(2, 2, &dev()).unwrap();
    let b = TiedLm {
        embed: shared.clone(),
        head: shared,
    };
    b.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    assert!(b.embed.weight.same_as(&b.head.weight));
    assert_eq!(values(&a), values(&b));
}

#[derive(Module)]
struct Misnamed {
    word: Linear,
    #[module(rename = "LayerNrom")]
    norm: Linear,
    position_ids: Buffer,
}

#[test]
fn strict_report_lists_everything_and_changes_nothing() {
    let source = embeddings();
    let sd = source.state_dict().unwrap();
    let dev = dev();
    let target = Misnamed {
        word: Linear::new(4, 3, &dev).unwrap(),
        norm: Linear::new(3, 3, &dev).unwrap(),
        position_ids: Buffer::new(Tensor::arange(0i64, 6, &dev).unwrap()),
    };
    let before = values(&target);
    let err = target
        .load_state_dict(&sd, &LoadOptions::default())
        .unwrap_err();
    let Error::Load(report) = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(report.missing, ["LayerNrom.weight", "LayerNrom.bias"]);
    assert_eq!(report.unexpected, ["LayerNorm.bias", "LayerNorm.weight"]);
    assert_eq!(
        report.suggestions,
        [
            ("LayerNrom.weight".to_owned(), "LayerNorm.weight".to_owned()),
            ("LayerNrom.bias".to_owned(), "LayerNorm.bias".to_owned())
        ]
    );
    let msg = err.to_string();
    assert!(
        msg.contains("missing key(s): \"LayerNrom.weight\""),
        "{msg}"
    );
    assert!(msg.contains("did you mean: \"LayerNorm.weight\""), "{msg}");
    assert_eq!(values(&target), before, "a failed load changes nothing");

    // Non-strict: the matching entries load, the rest is reported.
    let report = target
        .load_state_dict(&sd, &LoadOptions::default().non_strict())
        .unwrap();
    assert_eq!(report.loaded, 3);
    assert_eq!(report.missing.len(), 2);
}

#[test]
fn shape_and_dtype_mismatches_fail_even_when_not_strict() {
    let dev = dev();
    let m = Linear::new(3, 2, &dev).unwrap();
    let before = values(&m);
    let mut sd = m.state_dict().unwrap();
    sd.insert("weight", Tensor::zeros((2, 4), DType::F32, &dev).unwrap());
    sd.insert("bias", Tensor::zeros(2, DType::F64, &dev).unwrap());
    let err = m
        .load_state_dict(&sd, &LoadOptions::default().non_strict().exact_dtype())
        .unwrap_err();
    let Error::Load(report) = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(report.mismatched.len(), 2);
    assert_eq!(report.mismatched[0].key, "weight");
    assert_eq!(report.mismatched[0].shape.dims(), [2, 4]);
    assert_eq!(report.mismatched[0].expected_shape.dims(), [2, 3]);
    assert!(err.to_string().contains("[2, 4]"), "{err}");
    assert_eq!(values(&m), before);

    // By default (PyTorch's `copy_`), the F64 bias is converted once the shape is right.
    let mut sd = m.state_dict().unwrap();
    sd.insert("bias", Tensor::ones(2, DType::F64, &dev).unwrap());
    m.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    assert_eq!(m.bias.as_ref().unwrap().dtype(), DType::F32);
    assert_eq!(
        m.bias
            .as_ref()
            .unwrap()
            .tensor()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        [1.0, 1.0]
    );
}

#[test]
fn key_rules() {
    let a = embeddings();
    let prefixed: module_runtime::StateDict = a
        .state_dict()
        .unwrap()
        .iter()
        .map(|(k, t)| (format!("module.{k}"), t.clone()))
        .collect();
    let b = embeddings();
    assert!(b
        .load_state_dict(&prefixed, &LoadOptions::default())
        .is_err());
    b.load_state_dict(&prefixed, &LoadOptions::default().strip_prefix("module"))
        .unwrap();
    assert_eq!(values(&a), values(&b));

    let opts = LoadOptions::default()
        .add_prefix("bert")
        .rename("gamma", "weight");
    assert_eq!(opts.map_key("ln.gamma"), "bert.ln.weight");
    assert_eq!(opts.map_key("ln.gammas"), "bert.ln.gammas");
    assert_eq!(
        LoadOptions::default()
            .strip_prefix("bert")
            .map_key("bertx.a"),
        "bertx.a"
    );
}

#[test]
fn optimizer_built_before_a_load_trains_the_loaded_values() {
    use candle_nn::Optimizer;
    let dev = dev();
    let m = Linear::no_bias(2, 1, &dev).unwrap();
    let mut opt = candle_nn::SGD::new(m.trainable_vars().unwrap(), 0.0).unwrap();
    let mut sd = module_runtime::StateDict::new();
    sd.insert("weight", Tensor::new(&[[5f32, 7.]], &dev).unwrap());
    m.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    let loss = m
        .call(&Tensor::ones((1, 2), DType::F32, &dev).unwrap())
        .unwrap()
        .sum_all()
        .unwrap();
    opt.backward_step(&loss).unwrap();
    assert_eq!(
        m.weight
            .var()
            .unwrap()
            .as_tensor()
            .to_vec2::<f32>()
            .unwrap(),
        [[5., 7.]]
    );
}

#[test]
fn failed_save_keeps_the_previous_checkpoint() {
    let a = embeddings();
    let path = tmp("keep.safetensors");
    a.save_safetensors(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    // A directory in the way of the temporary file's rename, and a directory that does not exist.
    let missing_dir = tmp("no/such/dir/x.safetensors");
    assert!(matches!(
        a.save_safetensors(&missing_dir),
        Err(Error::Checkpoint { .. } | Error::Io { .. })
    ));
    let dir_target = tmp("a_directory");
    std::fs::create_dir_all(&dir_target).unwrap();
    assert!(a.save_safetensors(&dir_target).is_err());
    assert!(dir_target.is_dir());
    // Overwriting works and leaves no temporary files behind (other tests save into the same
    // folder at the same time: look at this file's temporaries only).
    embeddings().save_safetensors(&path).unwrap();
    assert_ne!(std::fs::read(&path).unwrap(), before);
    let leftovers: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .starts_with(".keep.safetensors.module-tmp-")
        })
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
}

#[cfg(unix)]
#[test]
fn save_into_a_read_only_directory_keeps_the_previous_checkpoint() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tmp("read_only");
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("model.safetensors");
    let a = embeddings();
    a.save_safetensors(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let result = embeddings().save_safetensors(&path);
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    // Root ignores directory permissions; the test is meaningful as an ordinary user.
    if result.is_err() {
        assert_eq!(std::fs::read(&path).unwrap(), before);
    }
    let b = embeddings();
    b.load_state_dict(&path, &LoadOptions::default()).unwrap();
}

/// A valid file to corrupt: header length (8 bytes LE) + JSON header + data.
fn valid_bytes() -> Vec<u8> {
    let path = tmp("valid.safetensors");
    Linear::new(2, 2, &dev())
        .unwrap()
        .save_safetensors(&path)
        .unwrap();
    std::fs::read(path).unwrap()
}

fn with_header(header: &str, data_len: usize) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend(std::iter::repeat_n(0u8, data_len));
    out
}

fn corpus() -> Vec<(&'static str, Vec<u8>)> {
    let valid = valid_bytes();
    let header_len = u64::from_le_bytes(valid[..8].try_into().unwrap()) as usize;
    let w = r#""weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}"#;
    let b = r#""bias":{"dtype":"F32","shape":[2],"data_offsets":[16,24]}"#;
    vec![
        ("empty", vec![]),
        ("shorter than the length prefix", vec![1, 2, 3]),
        ("length prefix only", 16u64.to_le_bytes().to_vec()),
        ("header length past the end", {
            let mut v = valid.clone();
            v[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
            v
        }),
        ("truncated data", valid[..valid.len() - 5].to_vec()),
        ("truncated header", valid[..8 + header_len / 2].to_vec()),
        ("header not JSON", with_header("this is not json", 24)),
        ("header not UTF-8", {
            let mut v = valid.clone();
            v[9] = 0xff;
            v
        }),
        ("header a JSON list", with_header("[1, 2, 3]", 24)),
        (
            "unknown dtype",
            with_header(
                &format!(
                    r#"{{"weight":{{"dtype":"F99","shape":[2,2],"data_offsets":[0,16]}},{b}}}"#
                ),
                24,
            ),
        ),
        (
            "offsets past the data",
            with_header(
                &format!(
                    r#"{{"weight":{{"dtype":"F32","shape":[2,2],"data_offsets":[0,1600]}},{b}}}"#
                ),
                24,
            ),
        ),
        (
            "offsets reversed",
            with_header(
                &format!(
                    r#"{{"weight":{{"dtype":"F32","shape":[2,2],"data_offsets":[16,0]}},{b}}}"#
                ),
                24,
            ),
        ),
        (
            "shape disagrees with offsets",
            with_header(
                &format!(
                    r#"{{"weight":{{"dtype":"F32","shape":[3,3],"data_offsets":[0,16]}},{b}}}"#
                ),
                24,
            ),
        ),
        (
            "overlapping tensors",
            with_header(
                r#"{"weight":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"bias":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}"#,
                24,
            ),
        ),
        (
            "missing data_offsets",
            with_header(
                &format!(r#"{{"weight":{{"dtype":"F32","shape":[2,2]}},{b}}}"#),
                24,
            ),
        ),
        (
            "negative shape",
            with_header(
                &format!(
                    r#"{{"weight":{{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}},{b}}}"#
                ),
                24,
            ),
        ),
        (
            "a wrong dtype for the model",
            with_header(
                &format!(
                    r#"{{"weight":{{"dtype":"I64","shape":[2,2],"data_offsets":[0,32]}},{b}}}"#
                ),
                40,
            ),
        ),
        (
            "a tensor named twice",
            with_header(
                &format!(
                    r#"{{{w},"weight":{{"dtype":"F32","shape":[2],"data_offsets":[16,24]}}}}"#
                ),
                24,
            ),
        ),
        (
            "overlapping data",
            with_header(
                &format!(r#"{{{w},"bias":{{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}}}"#),
                16,
            ),
        ),
        (
            "a size that does not match the dtype and shape",
            with_header(
                &format!(r#"{{{w},"bias":{{"dtype":"F32","shape":[2],"data_offsets":[16,28]}}}}"#),
                28,
            ),
        ),
        (
            "valid but for another model",
            with_header(&format!(r#"{{{w}}}"#), 16),
        ),
    ]
}

#[test]
fn malformed_files_are_typed_errors_and_change_nothing() {
    let m = Linear::new(2, 2, &dev()).unwrap();
    let before = values(&m);
    let cases = corpus();
    assert!(cases.len() >= 15);
    for (i, (what, bytes)) in cases.into_iter().enumerate() {
        let path = tmp(&format!("malformed-{i}.safetensors"));
        std::fs::write(&path, bytes).unwrap();
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            m.load_state_dict(&path, &LoadOptions::default())
        }));
        let result = result.unwrap_or_else(|_| panic!("{what}: the load panicked"));
        match result {
            Err(Error::Checkpoint { path: p, reason }) => {
                assert_eq!(p, path, "{what}");
                if what.contains("twice") {
                    assert!(reason.contains("`weight` is named twice"), "{reason}");
                }
            }
            Err(Error::Load(_)) => assert!(what.contains("model"), "{what}"),
            Err(other) => panic!("{what}: unexpected error type {other:?}"),
            Ok(_) => panic!("{what}: loaded"),
        }
        assert_eq!(values(&m), before, "{what}: the model changed");
    }
    assert!(matches!(
        m.load_state_dict(
            Path::new("/no/such/file.safetensors"),
            &LoadOptions::default()
        ),
        Err(Error::Io { .. })
    ));
}

#[test]
fn pth_errors_are_typed() {
    let m = Linear::new(2, 2, &dev()).unwrap();
    // A zip that is no checkpoint: read as a PyTorch file, and refused by the pickle reader.
    let path = tmp("not_a_pickle.pth");
    std::fs::write(&path, b"PK\x03\x04definitely not a zip of pickles").unwrap();
    let err = m
        .load_state_dict(&path, &LoadOptions::default())
        .unwrap_err();
    assert!(
        matches!(&err, Error::Pth { path: p, .. } if *p == path),
        "{err:?}"
    );
    assert!(matches!(
        StateDict::read(&path, &LoadOptions::default()),
        Err(Error::Pth { .. })
    ));
    // Bytes of no format at all: the error names the file and the formats read.
    let path = tmp("no_format.pth");
    std::fs::write(&path, b"definitely not a zip of pickles").unwrap();
    let err = m
        .load_state_dict(&path, &LoadOptions::default())
        .unwrap_err();
    assert!(
        matches!(&err, Error::Checkpoint { path: p, .. } if *p == path),
        "{err:?}"
    );
}
