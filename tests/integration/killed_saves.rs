//! Saves killed midway (issue 46): a child process (this test binary, re-run) saves a model and
//! its AdamW state over and over, and is SIGKILLed at seeded random moments. Every time, each file
//! on disk is whole (it reads, with one iteration's values throughout), and the next save, from
//! this process, removes the temporary files the killed saves left. Both saves go through
//! `StateDict::save_safetensors`, the one atomic writer.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use module_runtime::optim::{AdamW, Optimizer};
use module_runtime::prelude::*;

const CHILD: &str = "MODULE_KILLED_SAVES_DIR";
const NAME: &str = "killed_saves::saves_killed_midway_leave_whole_files_and_no_debris";

/// A 1024 × 1024 `Linear` (4 MB) whose weight and bias are all `c`, and AdamW over it after one
/// step (12 MB of state).
fn model_and_optimizer(c: f32) -> (Linear, AdamW) {
    let model = Linear::new(1024, 1024, &Device::Cpu).unwrap();
    set_all(&model, c);
    let mut opt = AdamW::new(&model, AdamW::options().lr(0.0).weight_decay(0.0)).unwrap();
    let x = Tensor::ones((2, 1024), DType::F32, &Device::Cpu).unwrap();
    opt.backward_step(&model.call(&x).unwrap().sum_all().unwrap())
        .unwrap();
    (model, opt)
}

fn set_all(model: &Linear, c: f32) {
    for p in model.parameters() {
        let t = p.tensor().unwrap();
        p.set(&t.ones_like().unwrap().affine(c as f64, 0.).unwrap())
            .unwrap();
    }
}

fn temporaries(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".module-tmp-"))
        .collect()
}

/// The child: saves forever, the model's values one more each time, and says when the first
/// pair of files is on disk.
fn child(dir: &Path) -> ! {
    let (model, opt) = model_and_optimizer(0.0);
    for i in 0.. {
        set_all(&model, i as f32);
        model
            .save_safetensors(dir.join("model.safetensors"))
            .unwrap();
        opt.save_state(&dir.join("adamw.safetensors")).unwrap();
        if i == 0 {
            std::fs::write(dir.join("ready"), b"").unwrap();
        }
    }
    unreachable!()
}

#[test]
fn saves_killed_midway_leave_whole_files_and_no_debris() {
    if let Some(dir) = std::env::var_os(CHILD) {
        child(Path::new(&dir));
    }
    let dir: PathBuf = std::env::temp_dir().join(format!("killed-saves-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let (model, mut opt) = model_and_optimizer(-1.0);
    let mut debris_seen = 0;
    // Seeded delays (xorshift), so a failure can be replayed.
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    for round in 0..6 {
        let _ = std::fs::remove_file(dir.join("ready"));
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([NAME, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD, &dir)
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let start = Instant::now();
        while !dir.join("ready").exists() {
            assert!(
                start.elapsed() < Duration::from_secs(60),
                "the child never saved"
            );
            std::thread::sleep(Duration::from_millis(2));
        }
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        std::thread::sleep(Duration::from_millis(seed % 80));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap(); // reaped: its pid is gone
        if !temporaries(&dir).is_empty() {
            debris_seen += 1;
        }

        // The files on disk are whole: one iteration's values throughout.
        let loaded = Linear::new(1024, 1024, &Device::Cpu).unwrap();
        loaded
            .load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())
            .unwrap();
        let w = loaded
            .weight
            .tensor()
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap();
        assert!(
            w.iter().all(|&v| v == w[0]),
            "round {round}: a torn model file"
        );
        opt.load_state(&dir.join("adamw.safetensors")).unwrap();

        // The next saves remove what the killed ones left, and leave none of their own.
        model
            .save_safetensors(dir.join("model.safetensors"))
            .unwrap();
        opt.save_state(&dir.join("adamw.safetensors")).unwrap();
        assert_eq!(temporaries(&dir), Vec::<String>::new(), "round {round}");
    }
    // The kills landed inside a save at least once (each save writes and syncs 4 or 12 MB), so
    // the removal above was exercised.
    eprintln!("{debris_seen} of 6 kills left temporary files");
    assert!(debris_seen > 0, "no kill landed inside a save");
    std::fs::remove_dir_all(&dir).unwrap();
}
