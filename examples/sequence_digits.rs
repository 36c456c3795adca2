//! Reads each bundled 8x8 digit as a sequence of 8 rows of 8 pixels with an LSTM, trains it, then
//! classifies the test set twice: over whole sequences (`forward`), and streaming one row at a
//! time through the [`Recurrent`] one-step call with the state explicit — and checks that both
//! give the same predictions.
//!
//! ```text
//! cargo run --release --example sequence_digits -- [--epochs N] [--lr LR] [--hidden N] [--batch-size N] [--device NAME]
//! ```
//!
//! Without `--device`, the device is `MODULE_DEVICE`'s (the CPU when unset); `-- --help`
//! describes every flag. Exits non-zero when streaming changes any prediction.

use std::num::NonZeroUsize;
use std::time::Instant;

use candle_module::{device_or_env, digits_path, Digits};
use candle_nn::Optimizer;
use clap::Parser;
use module_runtime::nn::{Lstm, RnnConfig};
use module_runtime::no_grad;
use module_runtime::prelude::*;

/// Train an LSTM digit classifier that reads images row by row, then stream it.
#[derive(Parser)]
struct Args {
    /// Passes over the training set
    #[arg(long, value_name = "N", default_value_t = 25)]
    epochs: usize,
    /// AdamW learning rate
    #[arg(long, value_name = "LR", default_value_t = 1e-2)]
    lr: f64,
    /// Size of the LSTM's hidden state
    #[arg(long, value_name = "N", default_value = "64")]
    hidden: NonZeroUsize,
    /// Examples per step
    #[arg(long, value_name = "N", default_value = "32")]
    batch_size: NonZeroUsize,
    /// cpu, cuda:0, metal:0 [default: $MODULE_DEVICE, else cpu]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
}

/// Rows, time steps: an image is 8 rows of 8 pixels.
const ROWS: usize = 8;

/// An LSTM over the rows of an image and a linear layer on its last output.
#[derive(Module)]
struct RowLstm {
    /// `[batch, 8 rows, 8 pixels]` → `[batch, 8, hidden]`.
    lstm: Lstm,
    /// `[hidden]` → 10 logits.
    head: Linear,
}

impl RowLstm {
    fn new(hidden: usize, device: &Device) -> Result<Self> {
        let config = RnnConfig {
            batch_first: true,
            ..Default::default()
        };
        Ok(Self {
            lstm: Lstm::with_config(ROWS, hidden, config, device)?,
            head: Linear::new(hidden, 10, device)?,
        })
    }

    /// Classifies a stream one row at a time: the state is an explicit value, carried from one
    /// call of the one-step `Recurrent::step` to the next (as it would be between the arrivals
    /// of the rows), and only the last row's output reaches the head.
    fn classify_streaming(&self, images: &Tensor) -> Result<Tensor> {
        let (batch, rows, _) = images.dims3()?;
        let mut state = self.lstm.initial_state(batch)?;
        let mut last = None;
        for r in 0..rows {
            let row = images.narrow(1, r, 1)?.squeeze(1)?; // [batch, 8]
            let (h, next) = self.lstm.step(&row, state)?;
            state = next;
            last = Some(h);
        }
        match last {
            Some(h) => self.head.call(&h),
            None => Err(Error::InputShape {
                layer: "RowLstm",
                expected: "[batch, rows >= 1, 8]".to_owned(),
                got: images.shape().clone(),
            }),
        }
    }
}

impl Forward<&Tensor> for RowLstm {
    type Output = Tensor;

    /// `[batch, 8, 8]` images, rows as time steps → `[batch, 10]` logits, in one call of the
    /// whole-sequence LSTM.
    fn forward(&self, images: &Tensor) -> Result<Tensor> {
        let (outputs, _final_state) = self.lstm.call(images)?;
        let rows = outputs.dim(1)?;
        self.head.call(&outputs.narrow(1, rows - 1, 1)?.squeeze(1)?)
    }
}

/// Examples `range` as `[n, 8, 8]` images (rows of pixels) and `[n]` labels.
fn batch(
    data: &Digits,
    range: std::ops::Range<usize>,
    device: &Device,
) -> Result<(Tensor, Tensor)> {
    let (x, y) = data.batch(range, device)?;
    let n = x.dim(0)?;
    Ok((x.reshape((n, ROWS, 8))?, y))
}

fn accuracy(predicted: &Tensor, labels: &Tensor) -> Result<f64> {
    let correct = predicted.eq(labels)?.to_dtype(DType::F32)?.sum_all()?;
    Ok(correct.to_scalar::<f32>()? as f64 / labels.dim(0)? as f64)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // Freed tensors' memory reused by the next ones (see `reuse_freed_memory`).
    module_runtime::reuse_freed_memory();
    let args = Args::parse();
    let batch_size = args.batch_size.get();
    let device = device_or_env(args.device.as_deref())?;
    let (train, test) = Digits::load(&digits_path())?.split(0.2, 42);
    println!(
        "digits as sequences: {} training and {} test images, each 8 rows of 8 pixels, device {}",
        train.len(),
        test.len(),
        module_runtime::device_name(&device)
    );

    let model = RowLstm::new(args.hidden.get(), &device)?;
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
    model.train();
    let start = Instant::now();
    for epoch in 1..=args.epochs {
        bar.set_prefix(epoch.to_string());
        let mut total = 0.0;
        for step in 0..steps_per_epoch {
            let lo = step * batch_size;
            let (x, y) = batch(&train, lo..(lo + batch_size).min(train.len()), &device)?;
            let loss = candle_nn::loss::cross_entropy(&model.call(&x)?, &y)?;
            opt.backward_step(&loss)?;
            total += loss.to_scalar::<f32>()?;
            bar.inc(1);
        }
        bar.set_message(format!("{:.4}", total / steps_per_epoch as f32));
    }
    bar.finish();
    let train_time = start.elapsed();

    // Inference: eval mode, and no gradient recording while the guard lives.
    model.eval();
    let _no_grad = no_grad();
    let (x_test, y_test) = batch(&test, 0..test.len(), &device)?;
    let (x_train, y_train) = batch(&train, 0..train.len(), &device)?;
    let whole = model.call(&x_test)?.argmax(D::Minus1)?;
    let test_acc = accuracy(&whole, &y_test)?;
    println!(
        "trained {} epochs in {:.1}s: train accuracy {:.2}%, test accuracy {:.2}%",
        args.epochs,
        train_time.as_secs_f64(),
        100.0 * accuracy(&model.call(&x_train)?.argmax(D::Minus1)?, &y_train)?,
        100.0 * test_acc
    );

    let start = Instant::now();
    let streamed = model.classify_streaming(&x_test)?.argmax(D::Minus1)?;
    let same = whole
        .eq(&streamed)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .to_scalar::<f32>()? as usize;
    println!(
        "streamed the test set one row at a time with an explicit state ({:.0} ms): \
         {same}/{} predictions identical to the whole-sequence pass, test accuracy {:.2}%",
        start.elapsed().as_secs_f64() * 1e3,
        test.len(),
        100.0 * accuracy(&streamed, &y_test)?
    );
    if same != test.len() {
        return Err(format!(
            "streaming changed {} of {} predictions",
            test.len() - same,
            test.len()
        )
        .into());
    }
    Ok(())
}
