//! Trains a small network on the bundled handwritten digits, end to end: a model defined with
//! `#[derive(Module)]`, AdamW on `trainable_vars()`, test accuracy, and a checkpoint saved and
//! reloaded into a fresh model.
//!
//! ```text
//! cargo run --release --example train_digits -- [--epochs N] [--lr LR] [--batch-size N] [--device NAME] [--out PATH]
//! ```
//!
//! Without `--device`, the device is `MODULE_DEVICE`'s (the CPU when unset), as for the tests;
//! `-- --help` describes every flag.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use candle_module::{device_or_env, digits_path, DigitNet, Digits};
use candle_nn::Optimizer;
use clap::Parser;
use module_runtime::prelude::*;

/// Train a digit classifier on the bundled UCI digits data.
#[derive(Parser)]
struct Args {
    /// Passes over the training set
    #[arg(long, value_name = "N", default_value_t = 30)]
    epochs: usize,
    /// AdamW learning rate
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
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
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

    let model = DigitNet::new(&device)?;
    print!("{}", model.summary());

    let mut opt = candle_nn::AdamW::new(
        model.trainable_vars()?,
        candle_nn::ParamsAdamW {
            lr: args.lr,
            ..Default::default()
        },
    )?;
    let steps_per_epoch = train.len().div_ceil(batch_size);
    let bar = candle_module::training_bar(args.epochs * steps_per_epoch);
    let start = Instant::now();
    for epoch in 1..=args.epochs {
        bar.set_prefix(epoch.to_string());
        let mut total = 0.0;
        for step in 0..steps_per_epoch {
            let lo = step * batch_size;
            let (x, y) = train.batch(lo..(lo + batch_size).min(train.len()), &device)?;
            let loss = candle_nn::loss::cross_entropy(&model.call(&x)?, &y)?;
            opt.backward_step(&loss)?;
            total += loss.to_scalar::<f32>()?;
            bar.inc(1);
        }
        bar.set_message(format!("{:.4}", total / steps_per_epoch as f32));
    }
    bar.finish();
    let train_time = start.elapsed();

    let test_acc = model.accuracy(&test, &device)?;
    println!(
        "trained {} epochs in {:.1}s: train accuracy {:.2}%, test accuracy {:.2}%",
        args.epochs,
        train_time.as_secs_f64(),
        100.0 * model.accuracy(&train, &device)?,
        100.0 * test_acc
    );

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
