//! A pre-norm `nn.TransformerEncoder` text classifier ported from PyTorch with the library's own
//! layers (issue 29): `fixtures/make_transformer_fixtures.py` trains it for a few steps and saves
//! its `state_dict` with `torch.save` (`fixtures/pytorch/transformer_classifier.pt`) and its logits
//! for a padded batch (`transformer_classifier_reference.safetensors`). The same model written here
//! loads the file strictly and gives PyTorch's logits within 1e-5.
//!
//! ```python
//! class Classifier(nn.Module):
//!     def __init__(self, vocab=20, d_model=16, nhead=2, dim_feedforward=32, num_layers=2, classes=3):
//!         super().__init__()
//!         self.embedding = nn.Embedding(vocab, d_model, padding_idx=0)
//!         layer = nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward, dropout=0.1,
//!                                            batch_first=True, norm_first=True)
//!         self.encoder = nn.TransformerEncoder(layer, num_layers, norm=nn.LayerNorm(d_model))
//!         self.head = nn.Linear(d_model, classes)
//!
//!     def forward(self, ids, padding_mask):
//!         h = self.encoder(self.embedding(ids), src_key_padding_mask=padding_mask)
//!         keep = (~padding_mask).unsqueeze(-1).to(h.dtype)
//!         return self.head((h * keep).sum(1) / keep.sum(1))
//! ```

use std::path::PathBuf;

use candle_core::{DType, Device, Tensor};
use module_runtime::nn::{
    Embedding, EmbeddingConfig, EncoderInput, LayerNorm, Linear, TransformerEncoder,
    TransformerEncoderLayer, TransformerLayerConfig,
};
use module_runtime::prelude::*;
use module_runtime::LoadOptions;

use crate::nn_fixture::assert_close;

#[derive(Module)]
struct Classifier {
    embedding: Embedding,
    encoder: TransformerEncoder,
    head: Linear,
}

impl Classifier {
    fn new(dev: &Device) -> Result<Self> {
        let (vocab, d_model, nhead, classes) = (20, 16, 2, 3);
        let config = TransformerLayerConfig {
            dim_feedforward: 32,
            dropout: 0.1,
            batch_first: true,
            norm_first: true,
            ..Default::default()
        };
        let layer = TransformerEncoderLayer::with_config(d_model, nhead, config, dev)?;
        let embedding = EmbeddingConfig {
            padding_idx: Some(0),
            ..Default::default()
        };
        Ok(Self {
            embedding: Embedding::with_config(vocab, d_model, embedding, dev)?,
            encoder: TransformerEncoder::new(&layer, 2, Some(LayerNorm::new(d_model, dev)?))?,
            head: Linear::new(d_model, classes, dev)?,
        })
    }
}

/// `(ids [B, S], padding_mask [B, S] with 1 at padded positions)` → logits `[B, classes]`.
impl Forward<(&Tensor, &Tensor)> for Classifier {
    type Output = Tensor;

    fn forward(&self, (ids, padding_mask): (&Tensor, &Tensor)) -> Result<Tensor> {
        let x = self.embedding.call(ids)?;
        let h = self
            .encoder
            .call(EncoderInput::new(&x).src_key_padding_mask(padding_mask))?;
        let keep = (1.0 - padding_mask.to_dtype(h.dtype())?)?.unsqueeze(2)?;
        let pooled = h
            .broadcast_mul(&keep)?
            .sum(1)?
            .broadcast_div(&keep.sum(1)?)?;
        self.head.call(&pooled)
    }
}

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .ancestors()
        .map(|dir| dir.join("fixtures/pytorch").join(name))
        .find(|path| path.is_file())
        .unwrap_or_else(|| panic!("fixtures/pytorch/{name} in an ancestor of the crate's folder"))
}

#[test]
fn a_pre_norm_encoder_classifier_loads_its_torch_save_strictly_and_matches_pytorch() {
    let dev = Device::Cpu;
    let model = Classifier::new(&dev).unwrap();
    let report = model
        .load_state_dict(
            fixture("transformer_classifier.pt"),
            &LoadOptions::default(),
        )
        .unwrap();
    assert!(report.missing.is_empty() && report.unexpected.is_empty());
    assert_eq!(model.state_dict().unwrap().len(), 29);
    model.eval();

    let reference = candle_core::safetensors::load(
        fixture("transformer_classifier_reference.safetensors"),
        &dev,
    )
    .unwrap();
    let ids = &reference["ids"];
    let mask = &reference["padding_mask"];
    // Padded positions really are padded: the second row has two, the third five.
    let padded: Vec<u8> = mask
        .sum(1)
        .unwrap()
        .to_dtype(DType::U8)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(padded, [0, 2, 5]);
    let logits = model.call((ids, mask)).unwrap();
    assert_close("classifier logits", &logits, &reference["logits"]);
}
