//! The bundled UCI digits data set and the small classifier the examples and benchmarks train on it.

use std::io::Read;
use std::path::{Path, PathBuf};

use module_runtime::prelude::*;
use rand::seq::SliceRandom;
use rand::SeedableRng;

/// The bundled UCI digits data set (`data/digits.csv.gz`, CC BY 4.0; see `data/README.md`).
pub fn digits_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("data/digits.csv.gz")
}

/// 8x8 grey-level digit images and their labels.
pub struct Digits {
    /// `[n, 64]` pixels scaled to `0..=1`, row-major.
    pub images: Vec<[f32; 64]>,
    /// `n` labels `0..=9`.
    pub labels: Vec<u32>,
}

impl Digits {
    /// Reads `digits.csv.gz`: 65 integers a row, 64 pixels (0..=16) then the label.
    pub fn load(path: &Path) -> Result<Self, Box<dyn std::error::Error>> {
        let mut text = String::new();
        flate2::read::GzDecoder::new(std::fs::File::open(path)?).read_to_string(&mut text)?;
        let mut images = Vec::new();
        let mut labels = Vec::new();
        for (line_no, line) in text.lines().enumerate().filter(|(_, l)| !l.is_empty()) {
            let values = line
                .split(',')
                .map(|v| v.trim().parse::<u32>())
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| format!("line {}: {e}", line_no + 1))?;
            let [pixels @ .., label] = values.as_slice() else {
                unreachable!("split yields at least one value")
            };
            if pixels.len() != 64 || *label > 9 {
                return Err(
                    format!("line {}: expected 64 pixels and a label 0..9", line_no + 1).into(),
                );
            }
            let mut image = [0f32; 64];
            for (dst, &p) in image.iter_mut().zip(pixels) {
                *dst = p as f32 / 16.0;
            }
            images.push(image);
            labels.push(*label);
        }
        Ok(Self { images, labels })
    }

    /// Number of examples.
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// Shuffles with a fixed `seed` and splits off the first `test_fraction` as the test set:
    /// `(train, test)`.
    pub fn split(self, test_fraction: f64, seed: u64) -> (Digits, Digits) {
        let mut order: Vec<usize> = (0..self.len()).collect();
        order.shuffle(&mut rand::rngs::StdRng::seed_from_u64(seed));
        let n_test = (self.len() as f64 * test_fraction).round() as usize;
        let pick = |idx: &[usize]| Digits {
            images: idx.iter().map(|&i| self.images[i]).collect(),
            labels: idx.iter().map(|&i| self.labels[i]).collect(),
        };
        (pick(&order[n_test..]), pick(&order[..n_test]))
    }

    /// The examples at `indices` (in that order) as tensors: images `[len, 64]` (f32) and labels
    /// `[len]` (u32). For samplers that pick examples out of order.
    pub fn gather(&self, indices: &[usize], device: &Device) -> Result<(Tensor, Tensor)> {
        let n = indices.len();
        let pixels: Vec<f32> = (indices.iter()).flat_map(|&i| self.images[i]).collect();
        let labels: Vec<u32> = indices.iter().map(|&i| self.labels[i]).collect();
        let images = Tensor::from_vec(pixels, (n, 64), device)?;
        Ok((images, Tensor::from_vec(labels, n, device)?))
    }

    /// Examples `range` as tensors: images `[len, 64]` (f32) and labels `[len]` (u32).
    pub fn batch(
        &self,
        range: std::ops::Range<usize>,
        device: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let n = range.len();
        let pixels: Vec<f32> = self.images[range.clone()]
            .iter()
            .flatten()
            .copied()
            .collect();
        let images = Tensor::from_vec(pixels, (n, 64), device)?;
        let labels = Tensor::from_slice(&self.labels[range], n, device)?;
        Ok((images, labels))
    }
}

/// The digits classifier of `examples/train_digits.rs` and `benches/modules.rs`: an 8x8 image →
/// 64 → 128 → 64 → 10 classes, ReLU between the layers.
#[derive(Module)]
pub struct DigitNet {
    /// `[128, 64]`.
    pub fc1: Linear,
    /// `[64, 128]`.
    pub fc2: Linear,
    /// `[10, 64]`: one logit per digit.
    pub head: Linear,
}

impl DigitNet {
    /// A randomly initialized network (PyTorch's `Linear` initialization) on `device`: the same
    /// network after the same `module_runtime::manual_seed`.
    pub fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            fc1: Linear::new(64, 128, device)?,
            fc2: Linear::new(128, 64, device)?,
            head: Linear::new(64, 10, device)?,
        })
    }

    /// The fraction of `data` classified correctly, computed under `no_grad` (inference: no graph
    /// recorded).
    pub fn accuracy(&self, data: &Digits, device: &Device) -> Result<f64> {
        let _no_grad = module_runtime::no_grad();
        let (x, y) = data.batch(0..data.len(), device)?;
        let predicted = self.call(&x)?.argmax(D::Minus1)?;
        let correct = predicted.eq(&y)?.to_dtype(DType::F32)?.sum_all()?;
        Ok(correct.to_scalar::<f32>()? as f64 / data.len() as f64)
    }
}

impl Forward<&Tensor> for DigitNet {
    type Output = Tensor;

    /// `[batch, 64]` pixels → `[batch, 10]` logits.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.call(x)?.relu()?;
        let h = self.fc2.call(&h)?.relu()?;
        self.head.call(&h)
    }
}
