//! The derived BERT trains through the runtime's fused training passes (LayerNorm, GELU, the
//! attention softmax, dropout) on the CPU: its gradients must be those of the composed ops
//! (`without_fusion`), parameter by parameter. A small random model, so no checkpoint is needed;
//! in evaluation mode, so dropout draws nothing and both passes compute the same function while
//! every parameter still records its gradient.

use minilm::bert::{BertConfig, BertModel};
use module_runtime::nn::without_fusion;
use module_runtime::prelude::*;

#[test]
fn fused_training_passes_give_the_composed_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = BertConfig {
        vocab_size: 60,
        hidden_size: 128,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 512,
        max_position_embeddings: 32,
        ..BertConfig::minilm_l6()
    };
    let model = BertModel::new(&cfg, &dev)?;
    model.eval();
    let (batch, seq) = (8, 20);
    let (ids, mask) = super::padded_batch(batch, seq, &dev)?;
    let upstream = Tensor::randn(0f32, 1., (batch, seq, cfg.hidden_size), &dev)?;
    // Every parameter but the pooler's (`call` does not run it) has a gradient.
    let gradients = || -> Result<Vec<(String, Option<Tensor>)>> {
        let hidden = model.call((&ids, &mask))?;
        let grads = (hidden * &upstream)?.sum_all()?.backward()?;
        model
            .named_parameters()
            .into_iter()
            .map(|(name, p)| Ok((name, grads.get(&p.tensor()?).cloned())))
            .collect()
    };
    let fused = gradients()?;
    let composed = without_fusion(gradients)?;
    assert_eq!(fused.len(), composed.len());
    let mut compared = 0;
    for ((name, f), (_, c)) in fused.iter().zip(&composed) {
        let (f, c) = match (f, c) {
            (Some(f), Some(c)) => (f, c),
            (None, None) if name.starts_with("pooler.") => continue,
            _ => panic!("{name}: a gradient on one path only, or none"),
        };
        // A key bias's gradient is zero up to rounding (a softmax ignores a shift common to a
        // row): it is the row sum of the key projection's gradient terms, so its rounding, on
        // either path, is on the scale of the key weight's gradient, not its own. Other small
        // gradients are compared to 1e-2.
        let max_abs = |t: &Tensor| t.abs()?.max_all()?.to_scalar::<f32>();
        let scale = match name.strip_suffix("attention.self.key.bias") {
            Some(layer) => {
                let weight = format!("{layer}attention.self.key.weight");
                let (_, w) = composed.iter().find(|(n, _)| *n == weight).unwrap();
                max_abs(w.as_ref().unwrap())?
            }
            None => max_abs(c)?.max(1e-2),
        };
        let diff = (f - c)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(
            diff <= 1e-4 * scale,
            "{name}: fused and composed gradients differ by {diff} (largest {scale})"
        );
        compared += 1;
    }
    assert_eq!(
        compared,
        fused.len() - 2,
        "all but the pooler's weight and bias"
    );
    Ok(())
}
