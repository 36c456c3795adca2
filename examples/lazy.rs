//! A convolutional digit classifier whose layer sizes are never written by hand: only output
//! channels and features are. One batch of the bundled digits builds it (`build(&sample)`), a few
//! AdamW steps train it, and its checkpoint is reloaded into a fresh, unbuilt model, which the
//! checkpoint's shapes build.
//!
//! ```text
//! cargo run --release --example lazy -- [--steps N] [--device NAME] [--out PATH]
//! ```

use std::path::PathBuf;
use std::time::Instant;

use candle_module::{device_or_env, digits_path, Digits};
use candle_nn::Optimizer;
use clap::Parser;
use module_runtime::nn::{ConvConfig, LazyBatchNorm2d, LazyConv2d, LazyLinear, MaxPool2d};
use module_runtime::prelude::*;

/// 1×8×8 image → conv 8 → pool → conv 16 → pool → 32 → 10 classes. No input size anywhere.
#[derive(Module)]
struct LazyCnn {
    conv1: LazyConv2d,
    bn1: LazyBatchNorm2d,
    conv2: LazyConv2d,
    pool: MaxPool2d,
    fc: LazyLinear,
    head: LazyLinear,
}

impl LazyCnn {
    fn new(device: &Device) -> Result<Self> {
        let same = ConvConfig {
            padding: 1.into(),
            ..Default::default()
        };
        Ok(Self {
            conv1: LazyConv2d::with_config(8, 3, same, device)?,
            bn1: LazyBatchNorm2d::new(device)?,
            conv2: LazyConv2d::with_config(16, 3, same, device)?,
            pool: MaxPool2d::new(2),
            fc: LazyLinear::new(32, device)?,
            head: LazyLinear::new(10, device)?,
        })
    }
}

impl Forward<&Tensor> for LazyCnn {
    type Output = Tensor;

    /// `x`: `[N, 64]` pixels, read as `[N, 1, 8, 8]` images.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = x.reshape((x.dim(0)?, 1, 8, 8))?;
        let h = self.bn1.call(&self.conv1.call(&x)?)?.relu()?;
        let h = self.pool.call(&h)?;
        let h = self.pool.call(&self.conv2.call(&h)?.relu()?)?;
        let h = self.fc.call(&h.flatten_from(1)?)?.relu()?;
        self.head.call(&h)
    }
}

/// Build a lazy CNN from one digits batch, train it briefly, save it, reload it into an unbuilt
/// model.
#[derive(Parser)]
struct Args {
    /// AdamW steps of 64 images
    #[arg(long, value_name = "N", default_value_t = 200)]
    steps: usize,
    /// cpu, cuda:0, metal:0 [default: $MODULE_DEVICE, else cpu]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
    /// Where to save the checkpoint
    #[arg(long, value_name = "PATH", default_value = "lazy_cnn.safetensors")]
    out: PathBuf,
}

/// Test accuracy, in evaluation mode (BatchNorm uses its running statistics).
fn accuracy(model: &LazyCnn, data: &Digits, device: &Device) -> Result<f64> {
    let was_training = model.is_training();
    model.eval();
    let _no_grad = module_runtime::no_grad();
    let (x, y) = data.batch(0..data.len(), device)?;
    let predicted = model.call(&x)?.argmax(D::Minus1)?;
    model.set_training(was_training);
    let correct = predicted.eq(&y)?.to_dtype(DType::F32)?.sum_all()?;
    Ok(correct.to_scalar::<f32>()? as f64 / data.len() as f64)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let device = device_or_env(args.device.as_deref())?;
    let (train, test) = Digits::load(&digits_path())?.split(0.2, 42);
    let batch = 64;

    let model = LazyCnn::new(&device)?;
    println!("unbuilt: {}", model.unbuilt_paths().join(", "));
    let (sample, _) = train.batch(0..batch, &device)?;
    model.build(&sample)?;
    println!("built from one batch of {:?}:", sample.dims());
    for (name, p) in model.named_parameters() {
        println!("  {name:<12} {:?}", p.shape().dims());
    }
    print!("{}", model.summary());

    let mut opt = candle_nn::AdamW::new(
        model.trainable_vars()?,
        candle_nn::ParamsAdamW {
            lr: 3e-3,
            ..Default::default()
        },
    )?;
    let start = Instant::now();
    let batches = train.len() / batch;
    let mut loss_sum = 0.0;
    for step in 0..args.steps {
        let lo = (step % batches) * batch;
        let (x, y) = train.batch(lo..lo + batch, &device)?;
        let loss = candle_nn::loss::cross_entropy(&model.call(&x)?, &y)?;
        opt.backward_step(&loss)?;
        loss_sum += loss.to_scalar::<f32>()?;
        if (step + 1) % 100 == 0 {
            println!("step {:>4}: mean loss {:.4}", step + 1, loss_sum / 100.0);
            loss_sum = 0.0;
        }
    }
    let test_acc = accuracy(&model, &test, &device)?;
    println!(
        "trained {} steps in {:.1}s: test accuracy {:.2}%",
        args.steps,
        start.elapsed().as_secs_f64(),
        100.0 * test_acc
    );

    model.save_safetensors(&args.out)?;
    let restored = LazyCnn::new(&device)?;
    assert!(!restored.is_built());
    restored.load_state_dict(&args.out, &LoadOptions::default())?;
    let restored_acc = accuracy(&restored, &test, &device)?;
    println!(
        "saved {} and loaded it into a fresh unbuilt model (built from the checkpoint's shapes): \
         test accuracy {:.2}%{}",
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
