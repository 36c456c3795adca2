//! Checkpoint files as users have them: one entry point for every format, Hugging Face shards,
//! saves that survive the real world (killed saves, symlinks, permissions, wrong paths), and
//! safetensors files changed while they are read.

use std::path::{Path, PathBuf};

use module_runtime::nn::Linear;
use module_runtime::prelude::*;
use module_runtime::StateDict;

fn fixtures() -> PathBuf {
    candle_module::fixtures::checkpoints_dir()
}

fn tmp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("module-ckpt-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Every value as `f32`, by key, in order.
fn values(sd: &StateDict) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    sd.iter()
        .map(|(k, t)| {
            let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
            (k.to_owned(), t.dims().to_vec(), v.to_vec1().unwrap())
        })
        .collect()
}

fn sorted(mut v: Vec<(String, Vec<usize>, Vec<f32>)>) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

#[test]
fn sharded_checkpoints_read_as_one_state_dict_through_index_or_folder() {
    let reference = sorted(
        values(
            &StateDict::read(
                fixtures().join("gapnet_sharded_safetensors/model-00001-of-00002.safetensors"),
                &LoadOptions::default(),
            )
            .unwrap(),
        )
        .into_iter()
        .chain(values(
            &StateDict::read(
                fixtures().join("gapnet_sharded_safetensors/model-00002-of-00002.safetensors"),
                &LoadOptions::default(),
            )
            .unwrap(),
        ))
        .collect(),
    );
    assert_eq!(reference.len(), 18);
    for path in [
        fixtures().join("gapnet_sharded_safetensors/model.safetensors.index.json"),
        fixtures().join("gapnet_sharded_safetensors"),
        fixtures().join("gapnet_sharded_bin/pytorch_model.bin.index.json"),
        fixtures().join("gapnet_sharded_bin"),
    ] {
        let sd = StateDict::read(&path, &LoadOptions::default()).unwrap();
        // The index's order, which is the model's.
        assert_eq!(
            sd.keys().next(),
            Some("slice1.0.weight"),
            "{}",
            path.display()
        );
        assert_same(&sorted(values(&sd)), &reference, &path);
    }
}

/// Equal keys, shapes and values, with a short message naming what differs.
fn assert_same(
    got: &[(String, Vec<usize>, Vec<f32>)],
    expected: &[(String, Vec<usize>, Vec<f32>)],
    what: &Path,
) {
    let keys =
        |v: &[(String, Vec<usize>, Vec<f32>)]| v.iter().map(|e| e.0.clone()).collect::<Vec<_>>();
    assert_eq!(keys(got), keys(expected), "{}", what.display());
    for (g, e) in got.iter().zip(expected) {
        assert_eq!(g.1, e.1, "{}: shape of {}", what.display(), g.0);
        assert!(g.2 == e.2, "{}: values of {}", what.display(), g.0);
    }
}

/// A small model saved as two safetensors shards with an index, to break in various ways.
fn write_shards(dir: &Path) -> Linear {
    let dev = Device::Cpu;
    let m = Linear::new(3, 2, &dev).unwrap();
    let sd = m.state_dict().unwrap();
    for (key, file) in [("weight", "a.safetensors"), ("bias", "b.safetensors")] {
        let shard: StateDict = [(key, sd.get(key).unwrap().clone())].into_iter().collect();
        shard.save_safetensors(dir.join(file)).unwrap();
    }
    write_index(
        dir,
        r#"{"weight": "a.safetensors", "bias": "b.safetensors"}"#,
    );
    m
}

fn write_index(dir: &Path, weight_map: &str) {
    std::fs::write(
        dir.join("model.safetensors.index.json"),
        format!(r#"{{"metadata": {{"total_size": 32}}, "weight_map": {weight_map}}}"#),
    )
    .unwrap();
}

fn weights(m: &Linear) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    values(&m.state_dict().unwrap())
}

#[test]
fn sharded_loads_are_all_or_nothing_with_clear_errors() {
    let dir = tmp_dir("shards");
    let saved = write_shards(&dir);
    let m = Linear::new(3, 2, &Device::Cpu).unwrap();
    m.load_state_dict(&dir, &LoadOptions::default()).unwrap();
    assert_eq!(weights(&m), weights(&saved));

    let fresh = Linear::new(3, 2, &Device::Cpu).unwrap();
    let before = weights(&fresh);
    let index = dir.join("model.safetensors.index.json");
    let cases = [
        (
            r#"{"weight": "a.safetensors", "bias": "missing.safetensors"}"#,
            "shard `missing.safetensors` is missing",
        ),
        (
            r#"{"weight": "a.safetensors", "bias": "a.safetensors"}"#,
            "maps `bias` to `a.safetensors`, which does not hold it",
        ),
        (
            r#"{"weight": "a.safetensors", "bias": "../b.safetensors"}"#,
            "outside the index's folder",
        ),
        // `b.safetensors` is in no entry of the index, so nothing reads it.
        (r#"{"weight": "a.safetensors"}"#, "missing key(s): \"bias\""),
        (r#"{"weight": 3}"#, "not a file name"),
    ];
    for (map, expected) in cases {
        write_index(&dir, map);
        let err = fresh
            .load_state_dict(&index, &LoadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(expected), "{map}: {err}");
        assert_eq!(weights(&fresh), before, "{map}: the model changed");
    }
    std::fs::write(&index, "{ not json").unwrap();
    let err = fresh
        .load_state_dict(&index, &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("invalid JSON"), "{err}");
    assert_eq!(weights(&fresh), before);
}

#[test]
fn the_format_comes_from_the_bytes_not_the_extension() {
    let dir = tmp_dir("sniff");
    let m = Linear::new(3, 2, &Device::Cpu).unwrap();
    // A safetensors file named like a pickle.
    m.save_safetensors(dir.join("weights.bin")).unwrap();
    let other = Linear::new(3, 2, &Device::Cpu).unwrap();
    other
        .load_state_dict(dir.join("weights.bin"), &LoadOptions::default())
        .unwrap();
    assert_eq!(weights(&other), weights(&m));

    std::fs::write(dir.join("notes.pth"), "hello, these are not weights").unwrap();
    let err = other
        .load_state_dict(dir.join("notes.pth"), &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("not a checkpoint format"), "{err}");
    let err = other
        .load_state_dict(&dir, &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("none of Hugging Face's"), "{err}");
    let err = other
        .load_state_dict(dir.join("absent.safetensors"), &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("absent.safetensors"), "{err}");
}

#[test]
fn a_killed_save_leaves_nothing_behind_after_the_next_save() {
    let dir = tmp_dir("stale");
    let m = Linear::new(3, 2, &Device::Cpu).unwrap();
    let path = dir.join("model.safetensors");
    // What a save killed mid-write leaves: a temporary file of a process that is gone.
    let dead = dir.join(".model.safetensors.module-tmp-4000000000-0");
    std::fs::write(&dead, b"half a checkpoint").unwrap();
    // A temporary file of this very process (a concurrent save) is not touched.
    let ours = dir.join(format!(
        ".model.safetensors.module-tmp-{}-999",
        std::process::id()
    ));
    std::fs::write(&ours, b"in progress").unwrap();
    // Nor is a file that merely looks alike.
    let unrelated = dir.join(".model.safetensors.backup");
    std::fs::write(&unrelated, b"mine").unwrap();
    m.save_safetensors(&path).unwrap();
    assert!(!dead.exists());
    assert!(ours.exists() && unrelated.exists());
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names.len(), 3, "{names:?}");
}

#[cfg(unix)]
#[test]
fn saves_follow_the_umask_keep_modes_and_write_through_symlinks() {
    use std::os::unix::fs::{symlink, PermissionsExt};
    let dir = tmp_dir("perms");
    let m = Linear::new(3, 2, &Device::Cpu).unwrap();

    // A new file gets what `open(..., 0o666)` gives under the umask, like `torch.save`'s.
    let probe = dir.join("probe");
    std::fs::File::create(&probe).unwrap();
    let umask_mode = std::fs::metadata(&probe).unwrap().permissions().mode() & 0o777;
    let path = dir.join("new.safetensors");
    m.save_safetensors(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, umask_mode);

    // An existing file keeps its mode.
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o640)).unwrap();
    m.save_safetensors(&path).unwrap();
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o640);

    // A symlink stays a symlink; its target gets the new checkpoint.
    let target = dir.join("real.safetensors");
    std::fs::write(&target, b"old").unwrap();
    let link = dir.join("latest.safetensors");
    symlink("real.safetensors", &link).unwrap();
    m.save_safetensors(&link).unwrap();
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let other = Linear::new(3, 2, &Device::Cpu).unwrap();
    other
        .load_state_dict(&target, &LoadOptions::default())
        .unwrap();
    assert_eq!(weights(&other), weights(&m));
}

#[test]
fn saving_to_a_folder_or_into_a_missing_folder_says_so() {
    let dir = tmp_dir("wrong");
    let m = Linear::new(3, 2, &Device::Cpu).unwrap();
    let err = m.save_safetensors(&dir).unwrap_err();
    assert!(err.to_string().contains("is a directory"), "{err}");
    let err = m
        .save_safetensors(dir.join("no/such/folder/m.safetensors"))
        .unwrap_err();
    assert!(err.to_string().contains("no such folder"), "{err}");
    assert!(!err.to_string().contains("os error"), "{err}");
}

/// A safetensors file cut short at any length is an error and leaves the model unchanged (a
/// cut *while* a file is open is tested in `io.rs`: nothing is memory-mapped, so it cannot SIGBUS).
#[test]
fn a_truncated_safetensors_file_is_an_error_at_every_length() {
    let dir = tmp_dir("truncate");
    let path = dir.join("m.safetensors");
    let saved = Linear::new(16, 8, &Device::Cpu).unwrap();
    saved.save_safetensors(&path).unwrap();
    let bytes = std::fs::read(&path).unwrap();
    let m = Linear::new(16, 8, &Device::Cpu).unwrap();
    let before = weights(&m);
    for cut in (0..bytes.len()).step_by(7) {
        std::fs::write(&path, &bytes[..cut]).unwrap();
        let err = m
            .load_state_dict(&path, &LoadOptions::default())
            .unwrap_err();
        assert!(!err.to_string().is_empty());
        assert_eq!(weights(&m), before, "cut at {cut}");
    }
    std::fs::write(&path, &bytes).unwrap();
    m.load_state_dict(&path, &LoadOptions::default()).unwrap();
    assert_eq!(weights(&m), weights(&saved));
}
