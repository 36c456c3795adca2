//! Trains a small network on the bundled handwritten digits, end to end: a model defined with
//! `#[derive(Module)]`, trained as a PyTorch user would (`AdamW` from the prelude's
//! `module_runtime::optim` with no weight decay for biases, `clip_grad_norm_`, a linear schedule
//! with warmup, a new shuffle every epoch), test accuracy, a checkpoint saved and reloaded into a
//! fresh model, and a training checkpoint after every epoch that `--resume` continues from, bit for
//! bit.
//!
//! ```text
//! cargo run --release --example train_digits -- [--epochs N] [--lr LR] [--batch-size N] [--device NAME] [--out PATH]
//!     [--seed N] [--checkpoint DIR] [--resume] [--stop-after N]
//! ```
//!
//! Without `--device`, the device is `MODULE_DEVICE`'s (the CPU when unset), as for the tests;
//! `-- --help` describes every flag. Training 30 epochs in one go, or stopping after 10
//! (`--stop-after 10`) and resuming (`--resume`), gives the same weights to the last bit: the
//! checkpoint holds everything the run depends on (weights, AdamW's moments and step counts, the
//! schedule's position, the epoch, whose number seeds that epoch's shuffle).

use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_module::{device_or_env, digits_path, DigitNet, Digits};
use clap::Parser;
use module_runtime::distributed::DistributedSampler;
use module_runtime::prelude::*;
use module_runtime::StateDict;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Train a digit classifier on the bundled UCI digits data.
#[derive(Parser)]
struct Args {
    /// Passes over the training set
    #[arg(long, value_name = "N", default_value_t = 30)]
    epochs: usize,
    /// AdamW learning rate (peak of the warmup schedule)
    #[arg(long, value_name = "LR", default_value_t = 3e-3)]
    lr: f64,
    /// Examples per step
    #[arg(long, value_name = "N", default_value = "32")]
    batch_size: NonZeroUsize,
    /// cpu, cuda:0, metal:0 [default: $MODULE_DEVICE, else cpu]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
    /// Where to save the trained checkpoint
    #[arg(long, value_name = "PATH", default_value = "digits.safetensors")]
    out: PathBuf,
    /// Seed of the initial weights and of every epoch's shuffle
    #[arg(long, value_name = "N", default_value_t = 0)]
    seed: u64,
    /// Training checkpoint, rewritten after every epoch
    #[arg(long, value_name = "DIR", default_value = "digits-checkpoint")]
    checkpoint: PathBuf,
    /// Continue the run saved in --checkpoint (give the flags it was started with)
    #[arg(long)]
    resume: bool,
    /// Stop after epoch N, as an interrupted run would
    #[arg(long, value_name = "N")]
    stop_after: Option<usize>,
}

fn main() -> AnyResult<()> {
    // Freed tensors' memory reused by the next ones (see `reuse_freed_memory`).
    module_runtime::reuse_freed_memory();
    let args = Args::parse();
    let batch_size = args.batch_size.get();
    let device = device_or_env(args.device.as_deref())?;
    let (train, test) = Digits::load(&digits_path())?.split(0.2, 42);
    println!(
        "digits: {} training and {} test images (8x8), device {}",
        train.len(),
        test.len(),
        module_runtime::device_name(&device)
    );

    // torch.manual_seed: the initial weights are the same for the same --seed.
    manual_seed(args.seed);
    let model = DigitNet::new(&device)?;
    print!("{}", model.summary());

    // torch.optim.AdamW over two parameter groups: no weight decay for the biases.
    let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
    let mut opt = AdamW::with_groups(&model, AdamW::options().lr(args.lr), &groups)?;
    let steps_per_epoch = train.len().div_ceil(batch_size);
    let total_steps = args.epochs * steps_per_epoch;
    // get_linear_schedule_with_warmup: up over the first 10% of the steps, then down to 0.
    let mut schedule = LambdaLr::linear_with_warmup(&mut opt, total_steps / 10, total_steps);
    // DataLoader(shuffle=True): a new order every epoch, torch.randperm's from seed + epoch.
    let mut sampler = DistributedSampler::new(train.len(), 1, 0)?.seed(args.seed);
    let params = opt.params();

    let first_epoch = if args.resume {
        let epoch = load_checkpoint(&args, &model, &mut opt, &mut schedule)?;
        println!(
            "resumed {} after epoch {epoch} (step {})",
            args.checkpoint.display(),
            schedule.last_epoch()
        );
        epoch
    } else {
        0
    };
    let last_epoch = args.stop_after.map_or(args.epochs, |n| n.min(args.epochs));

    let bar = candle_module::training_bar(total_steps);
    bar.set_position((first_epoch * steps_per_epoch) as u64);
    let start = Instant::now();
    for epoch in first_epoch..last_epoch {
        bar.set_prefix((epoch + 1).to_string());
        sampler.set_epoch(epoch as u64);
        let mut total = 0.0;
        for batch in sampler.indices().chunks(batch_size) {
            let (x, y) = train.gather(batch, &device)?;
            let loss = candle_nn::loss::cross_entropy(&model.call(&x)?, &y)?;
            let mut grads = loss.backward()?;
            clip_grad_norm(&mut grads, &params, 1.0, 2.0, false)?;
            opt.step(&grads)?;
            schedule.step(&mut opt);
            total += loss.to_scalar::<f32>()?;
            bar.inc(1);
        }
        bar.set_message(format!("{:.4}", total / steps_per_epoch as f32));
        save_checkpoint(&args, epoch + 1, &model, &opt, &schedule)?;
    }
    bar.finish();
    let train_time = start.elapsed();

    let test_acc = model.accuracy(&test, &device)?;
    let trained = match (first_epoch, last_epoch) {
        (0, n) if n == args.epochs => format!("{n} epochs"),
        (0, n) => format!("{n} of {} epochs", args.epochs),
        (a, b) if a >= b => format!("no epochs (the checkpoint had {a} of {})", args.epochs),
        (a, b) => format!("epochs {}-{b} of {}", a + 1, args.epochs),
    };
    println!(
        "trained {trained} in {:.1}s: train accuracy {:.2}%, test accuracy {:.2}%",
        train_time.as_secs_f64(),
        100.0 * model.accuracy(&train, &device)?,
        100.0 * test_acc
    );
    let saved_epoch = first_epoch.max(last_epoch);
    if saved_epoch > 0 {
        println!(
            "checkpoint {}: weights, optimizer, schedule, epoch {saved_epoch} (--resume continues \
             it)",
            args.checkpoint.display()
        );
    }

    model.save_safetensors(&args.out)?;
    let restored = DigitNet::new(&device)?;
    restored.load_state_dict(&args.out, &LoadOptions::default())?;
    let restored_acc = restored.accuracy(&test, &device)?;
    println!(
        "saved {} and reloaded it into a fresh model: test accuracy {:.2}%{}",
        args.out.display(),
        100.0 * restored_acc,
        if restored_acc == test_acc {
            " (identical)"
        } else {
            " (DIFFERENT)"
        }
    );
    if restored_acc != test_acc {
        return Err("the reloaded model does not reproduce the trained one".into());
    }
    Ok(())
}

/// The run's progress and the flags its schedule and shuffles depend on, as `trainer_state`.
fn trainer_state(args: &Args, epoch: usize, step: usize) -> AnyResult<StateDict> {
    let mut sd = StateDict::new();
    for (key, value) in [
        ("epoch", epoch as f64),
        ("global_step", step as f64),
        ("epochs", args.epochs as f64),
        ("batch_size", args.batch_size.get() as f64),
        ("lr", args.lr),
        ("seed", args.seed as f64),
    ] {
        sd.insert(key, Tensor::new(value, &Device::Cpu)?);
    }
    Ok(sd)
}

/// Writes the training checkpoint, Hugging Face Trainer's folder in safetensors: `model`,
/// `optimizer`, `scheduler` and `trainer_state`, each through `StateDict::save_safetensors` (a
/// temporary file, flushed, renamed into place). The four are written into a folder beside the
/// checkpoint (`<dir>.tmp`), which then takes its place: the previous checkpoint is renamed aside
/// (`<dir>.old`), the new one into place, and the old one removed. So whole checkpoints only are
/// ever on disk under these names, and an interrupted save leaves the previous epoch's one, under
/// `<dir>` or (killed between the two renames) `<dir>.old`, which [`saved_checkpoint`] finds.
fn save_checkpoint(
    args: &Args,
    epoch: usize,
    model: &DigitNet,
    opt: &AdamW,
    schedule: &LambdaLr,
) -> AnyResult<()> {
    let dir = &args.checkpoint;
    let (tmp, old) = (dir.with_extension("tmp"), dir.with_extension("old"));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(&tmp)?;
    model.save_safetensors(tmp.join("model.safetensors"))?;
    opt.save_state(&tmp.join("optimizer.safetensors"))?;
    let state = trainer_state(args, epoch, schedule.last_epoch())?;
    for (name, sd) in [
        ("scheduler", schedule.state_dict()?),
        ("trainer_state", state),
    ] {
        sd.save_safetensors(tmp.join(format!("{name}.safetensors")))?;
    }
    if dir.exists() {
        if old.exists() {
            std::fs::remove_dir_all(&old)?;
        }
        std::fs::rename(dir, &old)?;
    }
    std::fs::rename(&tmp, dir)?;
    if old.exists() {
        std::fs::remove_dir_all(&old)?;
    }
    Ok(())
}

/// The folder holding the last whole training checkpoint: `--checkpoint`, or `<dir>.old` when a
/// save was killed between moving the previous checkpoint aside and the new one into place.
fn saved_checkpoint(args: &Args) -> PathBuf {
    let old = args.checkpoint.with_extension("old");
    if !args.checkpoint.exists() && old.exists() {
        old
    } else {
        args.checkpoint.clone()
    }
}

/// Loads the training checkpoint into the model, the optimizer and the schedule (made as at the
/// start of the run) and returns the number of epochs it completed. The checkpoint must come from
/// a run with the same `--epochs`, `--batch-size`, `--lr` and `--seed`.
fn load_checkpoint(
    args: &Args,
    model: &DigitNet,
    opt: &mut AdamW,
    schedule: &mut LambdaLr,
) -> AnyResult<usize> {
    let dir: &Path = &saved_checkpoint(args);
    let saved = StateDict::read(
        dir.join("trainer_state.safetensors"),
        &LoadOptions::default(),
    )?;
    let value = |key: &str| -> AnyResult<f64> {
        let t = saved
            .get(key)
            .ok_or_else(|| format!("{}: no {key} in trainer_state", dir.display()))?;
        Ok(t.to_scalar::<f64>()?)
    };
    let expected = trainer_state(args, 0, 0)?;
    for flag in ["epochs", "batch_size", "lr", "seed"] {
        let want = expected
            .get(flag)
            .expect("written above")
            .to_scalar::<f64>()?;
        if value(flag)? != want {
            return Err(format!(
                "{} was made with --{} {}, this run has {want}: resume with the run's flags",
                dir.display(),
                flag.replace('_', "-"),
                value(flag)?
            )
            .into());
        }
    }
    model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
    opt.load_state(&dir.join("optimizer.safetensors"))?;
    let sched = StateDict::read(dir.join("scheduler.safetensors"), &LoadOptions::default())?;
    schedule.load_state_dict(&sched, opt)?;
    let epoch = value("epoch")? as usize;
    if value("global_step")? as usize != schedule.last_epoch() {
        return Err(format!(
            "{}: the schedule and the trainer state disagree",
            dir.display()
        )
        .into());
    }
    Ok(epoch)
}
