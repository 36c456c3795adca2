//! Training survives a kill (issue 46, item 4): the `train_digits` example, killed with SIGKILL at
//! seeded random moments of its training-checkpoint writes, then run again with `--resume`, ends
//! with the weights of the run nobody killed, to the last bit — every time.
//!
//! The example's binary is the one `cargo test` builds beside this test's (`cargo test
//! --workspace` builds every example first); the moment of a write is seen from outside, as the
//! atomic writer's temporary file appearing beside the checkpoint.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Epochs of each run: the kills land in the writes after epochs 1 to `EPOCHS - 1`.
const EPOCHS: usize = 4;
const ROUNDS: usize = 6;

/// `target/<profile>/examples/train_digits`, built by `cargo test` with this test.
fn example() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let profile_dir = exe.parent().and_then(Path::parent).unwrap();
    let path = profile_dir
        .join("examples")
        .join(format!("train_digits{}", std::env::consts::EXE_SUFFIX));
    assert!(
        path.is_file(),
        "{} is missing: `cargo test --workspace` builds it (or `cargo build --example train_digits`)",
        path.display()
    );
    path
}

/// `train_digits` writing its checkpoint into `dir/ck` and its trained weights to `dir/out`.
fn train_digits(dir: &Path, resume: bool) -> Command {
    let mut cmd = Command::new(example());
    cmd.args([
        "--epochs",
        &EPOCHS.to_string(),
        "--seed",
        "3",
        "--device",
        "cpu",
    ])
    .arg("--checkpoint")
    .arg(dir.join("ck"))
    .arg("--out")
    .arg(dir.join("out.safetensors"))
    .current_dir(dir)
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    if resume {
        cmd.arg("--resume");
    }
    cmd
}

fn temporaries(dir: &Path) -> usize {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .filter(|e| {
                let name = e.as_ref().unwrap().file_name();
                name.to_string_lossy().contains(".module-tmp-")
            })
            .count()
    })
}

/// Waits until the child has begun its `nth` checkpoint write after the first one (a temporary
/// file beside a checkpoint already whole), then `delay_us` more, and kills it. `false` when the
/// child finished first.
fn kill_in_write(child: &mut Child, ck: &Path, nth: usize, delay_us: u64) -> bool {
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut writes_seen = 0;
    let mut in_write = false;
    while Instant::now() < deadline {
        if child.try_wait().unwrap().is_some() {
            return false;
        }
        let writing = ck.join("training.safetensors").is_file() && temporaries(ck) > 0;
        if writing && !in_write {
            writes_seen += 1;
            if writes_seen == nth {
                std::thread::sleep(Duration::from_micros(delay_us));
                child.kill().unwrap();
                child.wait().unwrap();
                return true;
            }
        }
        in_write = writing;
    }
    panic!("train_digits did not reach checkpoint write {nth} in 300 s");
}

#[test]
fn train_digits_killed_in_its_checkpoint_writes_resumes_to_the_same_weights() {
    let root = std::env::temp_dir().join(format!("killed-training-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let reference = root.join("reference");
    std::fs::create_dir_all(&reference).unwrap();
    assert!(train_digits(&reference, false).status().unwrap().success());
    let expected = std::fs::read(reference.join("out.safetensors")).unwrap();

    // Seeded choices (xorshift), so a failure can be replayed.
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let mut killed = 0;
    for round in 0..ROUNDS {
        let dir = root.join(format!("round-{round}"));
        std::fs::create_dir_all(&dir).unwrap();
        let nth = 1 + (next() % (EPOCHS as u64 - 1)) as usize;
        let delay_us = next() % 1500;
        let mut child = train_digits(&dir, false).spawn().unwrap();
        let was_killed = kill_in_write(&mut child, &dir.join("ck"), nth, delay_us);
        killed += usize::from(was_killed);
        let left = temporaries(&dir.join("ck"));
        eprintln!(
            "round {round}: write {nth} + {delay_us} µs: {}, {left} temporary file(s) left",
            if was_killed {
                "killed"
            } else {
                "finished first"
            }
        );
        let resumed = train_digits(&dir, true).status().unwrap();
        assert!(
            resumed.success(),
            "round {round}: --resume failed after a kill in write {nth} (+{delay_us} µs)"
        );
        let got = std::fs::read(dir.join("out.safetensors")).unwrap();
        assert!(
            got == expected,
            "round {round}: the weights after a kill in write {nth} (+{delay_us} µs) and --resume \
             differ from the uninterrupted run's"
        );
        assert_eq!(
            temporaries(&dir.join("ck")),
            0,
            "round {round}: the resumed run left the killed write's temporary file"
        );
    }
    assert!(
        killed >= ROUNDS / 2,
        "only {killed} of {ROUNDS} runs were killed in a write"
    );
    let _ = std::fs::remove_dir_all(&root);
}
