//! The derived BERT, a model written by a user from the runtime's layers (`Linear`, `LayerNorm`,
//! `Embedding`, dropout, `scaled_dot_product_attention`, residual sums through
//! `LayerNorm::call_residual`), trains under `autocast("cpu", BF16)` with no change to its code:
//! the hidden states come out float32 as Hugging Face's BERT's do under PyTorch's CPU autocast
//! (each block's bfloat16 output joins the float32 stream in the residual norm), every parameter
//! stays float32 and gets a float32 gradient, and the values are those of float32 training within
//! bfloat16 rounding. A small random model, so no checkpoint is needed.

use minilm::bert::{BertConfig, BertModel};
use module_runtime::amp::autocast;
use module_runtime::prelude::*;

#[test]
fn bert_trains_under_bfloat16_autocast() -> Result<()> {
    let dev = Device::Cpu;
    let cfg = BertConfig {
        vocab_size: 60,
        hidden_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 256,
        max_position_embeddings: 32,
        ..BertConfig::minilm_l6()
    };
    let model = BertModel::new(&cfg, &dev)?;
    let (batch, seq) = (4, 12);
    let ids: Vec<u32> = (0..batch * seq).map(|i| (i * 7 % 60) as u32).collect();
    let ids = Tensor::from_vec(ids, (batch, seq), &dev)?;
    let mask = Tensor::ones((batch, seq), DType::U32, &dev)?;
    let upstream = Tensor::randn(0f32, 1., (batch, seq, cfg.hidden_size), &dev)?;
    let run = || -> Result<(Tensor, Vec<(String, Tensor)>)> {
        let hidden = model.call((&ids, &mask))?;
        let loss = (hidden.to_dtype(DType::F32)? * &upstream)?.sum_all()?;
        let grads = loss.backward()?;
        let grads = model
            .named_parameters()
            .into_iter()
            .filter(|(name, _)| !name.starts_with("pooler."))
            .map(|(name, p)| (name, grads.get(&p.tensor().unwrap()).unwrap().clone()))
            .collect();
        Ok((hidden, grads))
    };
    // Evaluation mode: no dropout, so both runs compute the same function.
    model.eval();
    let (plain, plain_grads) = run()?;
    let (amp, amp_grads) = autocast("cpu", DType::BF16, run)?;
    assert_eq!(
        amp.dtype(),
        DType::F32,
        "the residual norms' output, as PyTorch's"
    );
    let rel = |a: &Tensor, b: &Tensor| -> Result<f32> {
        let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
        Ok((a - b)?.abs()?.max_all()?.to_scalar::<f32>()? / scale)
    };
    // Measured: 2^-8.8 of the largest value; gradients within 2^-7 of the largest.
    assert!(
        rel(&amp, &plain)? < 2f32.powi(-6),
        "hidden states: {}",
        rel(&amp, &plain)?
    );
    for ((name, g), (_, p)) in amp_grads.iter().zip(&plain_grads) {
        assert_eq!(g.dtype(), DType::F32, "{name}");
        // A key bias's gradient is rounding noise on both sides (a softmax ignores a shift).
        if !name.ends_with("attention.self.key.bias") {
            assert!(rel(g, p)? < 2f32.powi(-5), "{name}: {}", rel(g, p)?);
        }
    }
    for (name, p) in model.named_parameters() {
        assert_eq!(p.dtype(), DType::F32, "{name}: master weights stay float32");
    }
    // Training mode (dropout on the bfloat16 activations) runs too.
    model.train();
    let (hidden, _) = autocast("cpu", DType::BF16, run)?;
    assert_eq!(hidden.dtype(), DType::F32);
    Ok(())
}

/// Under bfloat16 autocast the training graph is no larger than float32 training's: every op
/// between the products takes bfloat16 directly (attention, dropout, GELU, the residual sum), and
/// the products read float32 parameters in place, so no cast is a node of its own (each node is
/// a zero-filled gradient buffer and a sum in candle's backward). Checked where the AVX512-BF16
/// kernel runs; elsewhere the products run in float32 between casts.
#[test]
fn autocast_adds_no_graph_nodes() -> Result<()> {
    if !module_runtime::backends::cpu::kernel_choice().bf16_products {
        println!("not checked: this CPU has no AVX512-BF16 kernel");
        return Ok(());
    }
    let dev = Device::Cpu;
    let cfg = BertConfig {
        vocab_size: 60,
        hidden_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        intermediate_size: 256,
        max_position_embeddings: 32,
        ..BertConfig::minilm_l6()
    };
    let model = BertModel::new(&cfg, &dev)?;
    model.train();
    let ids = Tensor::from_vec((0..24u32).collect::<Vec<_>>(), (2, 12), &dev)?;
    let mask = Tensor::ones((2, 12), DType::U32, &dev)?;
    let nodes = || -> Result<usize> { Ok(model.call((&ids, &mask))?.sorted_nodes().len()) };
    let float32 = nodes()?;
    let bf16 = autocast("cpu", DType::BF16, nodes)?;
    assert!(
        bf16 <= float32,
        "{bf16} nodes under autocast, {float32} in float32"
    );
    Ok(())
}
