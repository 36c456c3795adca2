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
//! checkpoint (one `TrainingCheckpoint` file, `<--checkpoint>/training.safetensors`) holds everything
//! the run depends on (weights, AdamW's moments and step counts, the schedule's position, the
//! epoch, whose number seeds that epoch's shuffle, and the random generator).

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use candle_module::{device_or_env, digits_path, DigitNet, Digits};
use clap::Parser;
use module_runtime::distributed::DistributedSampler;
use module_runtime::prelude::*;

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
        save_checkpoint(&args, epoch + 1, &model, &mut opt, &mut schedule)?;
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

/// The run's progress and the flags its schedule and shuffles depend on.
fn trainer_state(args: &Args, epoch: usize, step: usize) -> TrainerState {
    let mut state = TrainerState {
        epoch,
        global_step: step,
        ..Default::default()
    };
    for (key, value) in [
        ("epochs", args.epochs as f64),
        ("batch_size", args.batch_size.get() as f64),
        ("lr", args.lr),
        ("seed", args.seed as f64),
    ] {
        state.values.insert(key.to_owned(), value);
    }
    state
}

/// The training checkpoint's file in `--checkpoint`.
fn checkpoint_file(args: &Args) -> PathBuf {
    args.checkpoint.join("training.safetensors")
}

/// Writes the training checkpoint: weights, AdamW's state, the schedule, the epoch and step, the
/// run's flags and the random generator, in one file that `TrainingCheckpoint` writes atomically
/// (a kill leaves the previous epoch's checkpoint whole).
fn save_checkpoint(
    args: &Args,
    epoch: usize,
    model: &DigitNet,
    opt: &mut AdamW,
    schedule: &mut LambdaLr,
) -> AnyResult<()> {
    std::fs::create_dir_all(&args.checkpoint)?;
    let state = trainer_state(args, epoch, schedule.last_epoch());
    TrainingCheckpoint::new(model)
        .optimizer(opt)
        .scheduler(schedule)
        .save(checkpoint_file(args), &state)?;
    Ok(())
}

/// Restores the training checkpoint into the model, the optimizer and the schedule (made as at
/// the start of the run) and returns the number of epochs it completed. The checkpoint must come
/// from a run with the same `--epochs`, `--batch-size`, `--lr` and `--seed`.
fn load_checkpoint(
    args: &Args,
    model: &DigitNet,
    opt: &mut AdamW,
    schedule: &mut LambdaLr,
) -> AnyResult<usize> {
    let saved = TrainingCheckpoint::new(model)
        .optimizer(opt)
        .scheduler(schedule)
        .load(checkpoint_file(args))?;
    let expected = trainer_state(args, 0, 0);
    for (flag, want) in &expected.values {
        let found = saved.values.get(flag).copied();
        if found != Some(*want) {
            return Err(format!(
                "{} was made with --{} {}, this run has {want}: resume with the run's flags",
                args.checkpoint.display(),
                flag.replace('_', "-"),
                found.map_or("(none)".to_owned(), |v| v.to_string())
            )
            .into());
        }
    }
    Ok(saved.epoch)
}
